"""Our C++ CPU kernels, each built on first use with the compiler torch.compile uses, for the
instruction set PyTorch's own kernels picked on this machine, and kept in PyTorch's extension cache
(TORCH_EXTENSIONS_DIR): a later start loads one in well under a second. Where one cannot be built,
`build` says so and its callers use tensor operations instead."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The flags inductor's own C++ kernels get for the same capability: at::vec then uses those registers.
# F16C converts float16 halves as they load (AVX-512F has the conversion of its own).
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def build(source: Path, what: str, instead: str) -> bool:
    """Build (or load from the cache) the extension at `source`, which registers its ops; where it
    cannot be built, False and a warning: `what` could not be built, `instead`. Once per process."""
    capability = torch.backends.cpu.get_cpu_capability()
    capability = capability if capability in ISA_FLAGS else "DEFAULT"
    try:
        from torch.utils import cpp_extension

        find_ninja()
        cpp_extension.load(
            name=f"drivetrain_{source.stem}_{capability.lower()}",
            sources=[str(source)],
            extra_cflags=compile_flags(capability),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the tensor operations serve
        first_line = next(iter(str(exc).splitlines()), "")[:300]
        log.warning("%s could not be built (%s: %s); %s", what, type(exc).__name__, first_line, instead)
        log.debug("building %s", source.name, exc_info=True)
        return False
    return True


def compile_flags(capability: str) -> list[str]:
    """The compiler's flags for one of PyTorch's CPU capabilities (AVX512, AVX2, or DEFAULT: none)."""
    return ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
            *ISA_FLAGS.get(capability, [])]


def find_ninja() -> None:
    """cpp_extension runs `ninja` from PATH; a process started without its virtualenv's bin on PATH
    finds the one the `ninja` package installed there all the same."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
