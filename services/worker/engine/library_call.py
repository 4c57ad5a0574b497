"""Calling a stored decode library (cpu_graph_store.py) with the GIL let go, through a one-function
C++ extension (library_call.cpp) built on first use and kept in PyTorch's extension cache.

PyTorch's Python binding of AOTInductor's runner holds the GIL for the whole of a call, where its own
operators let it go. In a worker the engine steps on a thread of its own, beside the event loop that
publishes its tokens and feeds its Kafka clients, and the gossip thread: each waited out every
compiled decode step, ~25 ms for one SmolLM2 stream on the Zen 3 and ~160 ms for 64. An event loop's
1 ms timer fired, at p99, 30-37 ms late beside one stream decoding and 156 ms late beside 64; through
this call 3 ms and 1.6 ms (scratch checks, one process). 64 chats at once through `make run`'s fleet
(4 fleets each way, taking turns): 236-307 tok/s against 257-284 with the GIL held, the gaps between
a chat's tokens 322-336 ms at p99 against 422-434 (the second run of each fleet). Where the extension
cannot be built, the binding's own call serves, the GIL held.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
Runner = torch._C._aoti.AOTIModelContainerRunnerCpu
Call = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@functools.cache
def _extension() -> ModuleType | None:
    """The built extension (building it now if needed, once per process), or None where it cannot be."""
    try:
        from torch.utils import cpp_extension

        from kernels.cpu_extension import find_ninja

        find_ninja()
        return cpp_extension.load(name="drivetrain_library_call", sources=[str(SOURCE)], extra_cflags=["-O2"])
    except Exception as exc:  # no compiler, no ninja, a failed build: the binding's own call serves
        first_line = next(iter(str(exc).splitlines()), "")[:300]
        log.warning("the GIL-free library call could not be built (%s: %s); a compiled decode step holds the "
                    "GIL", type(exc).__name__, first_line)
        log.debug("building the GIL-free library call", exc_info=True)
        return None


def releasing_gil(runner: Runner) -> Call:
    """runner.run, letting the GIL go while the library runs where the extension builds and takes it."""
    extension = _extension()
    if extension is None:
        return runner.run
    try:
        extension.takes(runner)
    except TypeError as exc:
        log.warning("the GIL-free library call does not take PyTorch's runner (%s); a compiled decode step "
                    "holds the GIL", exc)
        return runner.run
    return functools.partial(extension.run, runner)


def releases_gil() -> bool:
    """Whether calls made through `releasing_gil` let the GIL go (the extension is built)."""
    return _extension() is not None
