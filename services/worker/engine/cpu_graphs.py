"""Decode steps on a CPU through a compiled graph, logits included.

Eager PyTorch spends a SmolLM2 decode step on about 1,600 small operations, and MKL reads float32
weights one row at a time at under half the memory bandwidth (on the AMD machines measured). With
the weights frozen as constants, inductor fuses the small operations into a few dozen C++ kernels
and multiplies with GEMM kernels of its own, each picked by timing it against oneDNN's at compile
time: one stream's step fell from 94 to 38 ms. Compiling takes minutes on two cores, in the
background if asked, while steps run eagerly. Each graph is exported (torch.export) and compiled
ahead of time by AOTInductor into a library kept on disk, keyed by the weights' digest among the
rest (cpu_graph_store.py), so the next start loads it in seconds. Models whose weights are oneDNN's
opaque packs (w8a8) do not export: their graphs compile through torch.compile at every start.

A step runs a graph when every sequence decodes one token and their contexts lie within a factor
of two of each other (the eager path would make them one group too), or pad the short ones to the
longest with few positions read in vain (MAX_PADDED_POSITIONS); anything else, and any step the
graphs were not compiled for, runs eagerly. Float32 weights get two sets of graphs, one for
a few rows and one for more (FEW_ROWS, MANY_ROWS), and int8 ones two, one for one row and one for
more (INT8_ONE_ROW, INT8_ROWS); bfloat16 and other quantized ones one for every batch. A set holds
a graph per warm-up batch: one for a single row, and one for every batch of two rows or more.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import gc
import hashlib
import itertools
import logging
import sys
import threading
import time
import types
import unittest.mock
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
import torch.compiler.config as compiler_config
import torch.fx.config as fx_config
from torch import nn
from torch.export import Dim, ExportedProgram

from services.worker.engine.attention import AttentionMetadata, DecodeGroupMetadata
from services.worker.engine.block_pool import NULL_BLOCK_ID
from services.worker.engine.cpu_graph_store import DecodeLibrary, Shapes, load_or_build, shapes_of
from services.worker.engine.cpu_linear import CpuLinear, traced_dense
from services.worker.engine.model import KVCache, LlamaModel
from services.worker.engine.quantize import scheme_of
from services.worker.engine.shared_weights import SharedWeights, tensor_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphPlan:
    """Steps of up to max_rows rows (None: any) run the graphs compiled with these inductor options
    (set around the compiling calls: torch.compile's `options` do not reach the freezing passes),
    one graph per warm-up batch. An exported graph's float32 projections are traced with the weights
    the eager path packed (cpu_linear.py), which freezing would otherwise pack from the dense ones:
    the products it keeps, or what autotuning packs for kernels of its own. With dense_products, those
    held in the panel kernel's layout are traced as linears over their dense weights, for autotuning
    to time inductor's kernels against oneDNN's."""

    max_rows: int | None
    inductor_options: dict
    warmup_batches: tuple[int, ...]
    dense_products: bool = False


# A few rows read the weights more than they multiply: max_autotune times inductor's own GEMM
# kernels, over weights it packs for them, against the ATen (oneDNN) ones at the warm-up's shape.
# More rows are bound by arithmetic, where the kernels picked at two rows fall behind oneDNN's
# packed products, which frozen bfloat16 linears get without autotuning, and float32 ones take as
# the eager path packed them (traced the same speed as frozen ones: 16 rows 50.6 against 49.9 ms,
# 64 rows 162.7 against 162.4, one process, rounds taking turns; a copy less). SmolLM2 float32
# on a 2-core AVX-512 EPYC, ms a step, autotuned graph against oneDNN graph: 2 rows 22.9 against
# 34.8, 4 rows 18.6 against 33.8, 6 rows 31.6 against 29.9, 16 rows 70.8 against 49.1; at 64 rows
# the oneDNN graph took 152 ms, the eager step 188 and the autotuned graph 298 (another run).
# A quantized graph kept its autotuned kernels' lead at every batch (w8a8 at 64 rows: 93 against
# 134 ms eagerly), so it takes them all.
# Every graph's weights are frozen in. Its indirect loads (the KV cache's slots) index by the engine's
# own block tables, not by anything a request carries, so they go unchecked: a bounds check on each
# load of the attention's keys and values cost as much as a third of its time.
FROZEN = {"freezing": True, "assert_indirect_indexing": False}
AUTOTUNED = {**FROZEN, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
FEW_ROWS = GraphPlan(max_rows=5, inductor_options=AUTOTUNED, warmup_batches=(1, 2), dense_products=True)
MANY_ROWS = GraphPlan(max_rows=None, inductor_options=FROZEN, warmup_batches=(8,))
QUANTIZED = GraphPlan(max_rows=None, inductor_options=AUTOTUNED, warmup_batches=(1, 2))
# Autotuning times each kernel on weights that stay in the cache, where a step reads them from memory.
# One row of int8 weights multiplies fastest through inductor's own weight-only int8 kernel, which
# AVX2 and AVX-512 have for every frozen weight, but ATen's `_weight_int8pack_mm` won the timing for
# SmolLM2's down projection (1,536 in, 576 out). Read from memory, 80 such layers took 3.6-4.1 ms
# through inductor's kernel against 5.3-6.0 through ATen's (2-core Zen 3 EPYC, AVX2), and one
# SmolLM2 stream decoded 112.4 against 106.5 tok/s (10 rounds taking turns, paired median 1.06),
# the same tokens. So int8 weights there get a one-row module of inductor's kernels alone; int4's and
# w8a8's products have none on AVX2, and a module with no kernel for a product fails to compile.
INT8_ONE_ROW = GraphPlan(max_rows=1, inductor_options={**AUTOTUNED, "max_autotune_gemm_backends": "CPP"},
                         warmup_batches=(1,))
INT8_ROWS = replace(QUANTIZED, warmup_batches=(2,))
INT8_KERNEL_CAPABILITIES = ("AVX2", "AVX512")  # torch.backends.cpu's names of the ISAs that have it
# Bfloat16 needs no few-rows module: oneDNN's products beat the autotuned kernels at every batch.
# SmolLM2 on a 2-core Zen 5 EPYC, ms a step, rounds taking turns: one row 8.2, 8.4, 9.7 against
# 13.8, 13.4, 13.8; 4 rows 10.6, 10.8, 10.7 against 19.9, 19.2, 19.0 (the autotuned kernels are
# timed on weights that fit in the cache, where a step reads them from memory). Float32's one row
# is the other way round there too: 17.8, 17.1 against 33.9, 30.7. Where the CPU has AVX512_BF16, the
# projections are the panel kernel's (cpu_linear.py), traced as they are held.
BFLOAT16 = GraphPlan(max_rows=None, inductor_options=FROZEN, warmup_batches=(1, 8))
# The model's Python floats (each norm's epsilon, the attention's scale) never change, but under dynamic
# shapes dynamo makes each an input of the graph: 91 numbers wrapped as tensors before every SmolLM2
# call, and kernels reading them through pointers. Traced as constants, a call of a 30-layer model with
# next to no arithmetic took 0.92 ms where it took 1.80, and one SmolLM2 float32 stream's step 10.9 ms
# where it took 11.7 (2-core Zen 5 EPYC, one process, 7 rounds taking turns, paired median 0.91).
CONSTANT_FLOATS = {"specialize_float": True}
# Positions a group may read past its sequences' contexts (masked) to run as a graph rather than
# eagerly, when its contexts lie more than a factor of two apart: a long chat beside new ones.
# SmolLM2 float32, one context of 1,000 beside short ones (~40-150), ms a step, graph against eager
# (8 rounds taking turns in one process, paired medians): 2 rows (~1k padded) 20.0 against 31.4;
# 8 rows (~7k) 36.8 against 37.8; 24 rows (~22k) 64.8 against 60.0.
MAX_PADDED_POSITIONS = 8192
MIN_BLOCKS = 2  # a group reads at least two blocks: a width of one would be a third specialisation
# The warm-up's block width. Sizes equal at compile time are taken to be equal for good (duck
# shaping), so it differs from the batch sizes above; the caches' sizes are marked static.
WARMUP_BLOCKS = 5
BACKGROUND_SWITCH_INTERVAL_S = 1e-4  # the GIL handed over this often while compiling behind serving
RECOMPILE_REFUSED = "fail_on_recompile"  # in the error dynamo raises for a call no graph covers


def _give_back_freed_memory() -> None:
    """Compiling frees much of what it allocated in pieces glibc keeps in its heap instead of returning
    them: SmolLM2 float32 stayed 0.54 GiB larger than it needed until malloc_trim. Elsewhere than
    glibc there is nothing to call."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _final(model: LlamaModel, hidden: torch.Tensor, output_layer: bool) -> torch.Tensor:
    """A step's output: (N, V) float32 logits, or without the output layer the (N, C) final states."""
    return model.compute_logits(hidden) if output_layer else hidden


class _DecodeLogits(nn.Module):
    """The model's forward and its output layer as one module, so both compile into one graph."""

    def __init__(self, model: LlamaModel, output_layer: bool) -> None:
        super().__init__()
        self.model = model
        self.output_layer = output_layer
        # Dynamo keeps compiled graphs per code object, and the module guards are filtered out (below):
        # two engines in one process sharing `forward`'s code would share one engine's frozen weights.
        # A copy of the code object gives this instance a cache of its own.
        forward = type(self).forward
        self.forward = types.MethodType(types.FunctionType(forward.__code__.replace(), forward.__globals__), self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecodeGroupMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:  # (N, V) float32, or (N, C)
        return _final(self.model, self.model(input_ids, positions, meta, kv_caches), self.output_layer)


class _ExportedStep(nn.Module):
    """The same step as torch.export takes it: the group's tensors one by one (lengths None without the
    C++ kernel), in the order step_inputs gives them to the compiled library."""

    def __init__(self, model: LlamaModel, output_layer: bool) -> None:
        super().__init__()
        self.model = model
        self.output_layer = output_layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                read_slots: torch.Tensor, visible: torch.Tensor, lengths: torch.Tensor | None,
                kv_caches: list[KVCache]) -> torch.Tensor:  # (N, V) float32, or (N, C)
        group = DecodeGroupMetadata(slot_mapping, read_slots, visible, lengths)
        return _final(self.model, self.model(input_ids, positions, group, kv_caches), self.output_layer)


def step_inputs(input_ids: torch.Tensor, positions: torch.Tensor, group: DecodeGroupMetadata,
                kv_caches: list[KVCache]) -> list[torch.Tensor]:
    """A step's tensors, flat, as an exported graph's library takes them."""
    tensors = [input_ids, positions, group.slot_mapping, group.read_slots, group.visible]
    if group.lengths is not None:
        tensors.append(group.lengths)
    return tensors + [tensor for cache in kv_caches for tensor in cache]


def named_tensors_of(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor a module tree holds, by name: parameters, buffers, and plain attributes (packed
    weights)."""
    attributes = ((f"{prefix}.{name}" if prefix else name, value) for prefix, module in model.named_modules()
                  for name, value in vars(module).items() if isinstance(value, torch.Tensor))
    return itertools.chain(model.named_parameters(), model.named_buffers(), attributes)


def tensors_of(model: nn.Module) -> Iterable[torch.Tensor]:
    return (tensor for _, tensor in named_tensors_of(model))


def _sharing_weights(model: nn.Module) -> nn.Module:
    """A copy of the module tree holding the very same tensors. Exporting traces a model with stand-ins
    for its weights swapped into its modules: on a copy, the steps served meanwhile keep the real ones."""
    return copy.deepcopy(model, memo={id(tensor): tensor for tensor in tensors_of(model)})


def decode_group(meta: AttentionMetadata, block_size: int,
                 attention_kernel: bool = False) -> DecodeGroupMetadata | None:
    """The step as one decode group, or None when it is not one: a prompt chunk in it, or contexts so
    far apart that padding the short ones to the longest would cost more than an eager step. With
    attention_kernel, the group carries its contexts' lengths, for the C++ kernel to read by."""
    if not meta.decode_only:
        return None
    contexts = meta.context_lens.numpy()  # (N,)
    longest = int(contexts.max())
    num_blocks = max(MIN_BLOCKS, -(-longest // block_size))
    padding = len(contexts) * num_blocks * block_size - int(contexts.sum())
    if longest > 2 * int(contexts.min()) and padding > MAX_PADDED_POSITIONS:
        return None
    tables = meta.block_tables.numpy()  # (N, W), NULL_BLOCK_ID past each table
    blocks = np.full((tables.shape[0], num_blocks), NULL_BLOCK_ID, dtype=np.int64)
    width = min(num_blocks, tables.shape[1])
    blocks[:, :width] = tables[:, :width]
    read_slots = (blocks[:, :, None] * block_size + np.arange(block_size)).reshape(len(blocks), -1)  # (N, S)
    visible = np.arange(num_blocks * block_size)[None, :] < contexts[:, None]  # (N, S)
    return DecodeGroupMetadata(
        slot_mapping=meta.slot_mapping,
        read_slots=torch.from_numpy(read_slots),
        visible=torch.from_numpy(visible)[:, None, None, :],
        lengths=torch.from_numpy(contexts.astype(np.int64)) if attention_kernel else None,
    )


def weights_digest(model: nn.Module) -> str | None:
    """A digest of every weight and buffer a graph of `model` freezes in, for the keys of the stored graphs
    (cpu_graph_store) and of torch.compile's caches; a packed float32 weight counts as the dense one it
    was packed from. None where a weight is opaque with nothing to stand for it (w8a8's oneDNN weights).
    Inductor's cache keys a frozen weight by its shape and dtype alone, and caches the copies it packs
    from it with the graph: without the digest, an int8 or int4 model compiled after another of the
    same shapes, in any process, decoded with the first one's weights."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if tensor.is_mkldnn:
            return None
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(tensor_bytes(tensor))
    for name, module in model.named_modules():
        if isinstance(module, CpuLinear):
            layout = "panels" if module.in_panels else "oneDNN"
            digest.update(f"{name} packed for {layout} from {module.dense_digest.hex()};".encode())
    return digest.hexdigest()


@contextlib.contextmanager
def compiling(plan: GraphPlan, digest: str | None):
    """torch.compile's settings while a plan's graphs compile: its inductor options, the model's floats as
    constants, and the caches keyed by the weights' digest (off where there is none)."""
    cached = {} if digest else {"fx_graph_cache": False}
    with (inductor_config.patch({**plan.inductor_options, **cached}), dynamo_config.patch(CONSTANT_FLOATS),
          compiler_config.patch(cache_key_tag=digest or "")):
        yield


def quantized_plans(scheme: str) -> tuple[GraphPlan, ...]:
    """The modules the graphs of a model quantized by `scheme` are compiled into, fewest rows first."""
    if scheme == "int8" and torch.backends.cpu.get_cpu_capability() in INT8_KERNEL_CAPABILITIES:
        return INT8_ONE_ROW, INT8_ROWS
    return (QUANTIZED,)


def _plans(model: LlamaModel) -> tuple[GraphPlan, ...]:
    """The modules a model's graphs are compiled into, fewest rows first."""
    scheme = scheme_of(model)
    if scheme is not None:
        return quantized_plans(scheme)
    if model.embed_tokens.weight.dtype == torch.bfloat16:
        return (BFLOAT16,)
    return FEW_ROWS, MANY_ROWS


class CpuDecodeGraphs:
    """Owns the compiled decode graphs of one model over one KV cache; `run` runs a step through them
    once they are ready, and never compiles on the caller's thread. store: where the compiled libraries
    are kept between starts (None: rebuilt at every start). states_from_rows: the graphs of plans whose
    steps all have at least this many rows end at the final norm, for a caller that applies the output
    layer itself (screened_output.py); None: every graph ends with the output layer."""

    def __init__(self, model: LlamaModel, kv_caches: list[KVCache], block_size: int, *,
                 attention_kernel: bool, store: Path | None, states_from_rows: int | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.attention_kernel = attention_kernel  # the C++ kernel, built already; else tensor operations
        self.block_size = block_size
        self.store = store
        self.plans = _plans(model)
        fewest_rows = [1] + [plan.max_rows + 1 for plan in self.plans[:-1]]  # each plan's smallest step
        self.output_layers = tuple(states_from_rows is None or rows < states_from_rows for rows in fewest_rows)
        self.libraries: list[list[DecodeLibrary]] = []  # per plan, a graph per warm-up batch
        self.compiled: list[nn.Module] = []  # per plan, its torch.compile module: weights that do not export
        self.ready = threading.Event()
        self.failed = False  # compiling raised: every step runs eagerly
        self._thread: threading.Thread | None = None
        self.num_uncovered_steps = 0  # decode groups no graph covers: run eagerly

    def start(self, background: bool) -> None:
        """Compile the graphs: on a thread of its own (steps run eagerly until it is done), or now."""
        if background:
            self._thread = threading.Thread(target=self._compile_behind, name="cpu-decode-compile", daemon=True)
            self._thread.start()
        else:
            self._compile()

    def _compile_behind(self) -> None:
        # Tracing and lowering are Python: the compiling thread holds the GIL for whole switch
        # intervals, and the serving thread waits for it at every operation that let it go. With
        # 0.1 ms intervals, one SmolLM2 stream decoded 1.3-1.7 tok/s during the compile, against
        # 0.2-0.5 with the default 5 ms (2 cores; ~8 tok/s eagerly with no compile running).
        interval = sys.getswitchinterval()
        sys.setswitchinterval(BACKGROUND_SWITCH_INTERVAL_S)
        try:
            self._compile()
        finally:
            sys.setswitchinterval(interval)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the graphs are ready (or compiling failed); whether they are ready."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready.is_set()

    @torch.no_grad()
    def _compile(self) -> None:
        started = time.perf_counter()
        meanwhile = "steps run eagerly meanwhile" if self._thread is not None else "the engine serves once done"
        log.info("compiling CPU decode graphs (minutes on a few cores, unless kept from before; %s)", meanwhile)
        try:
            digest = weights_digest(self.model)
            if digest is None:
                self._compile_modules()
            else:
                self._load_libraries(digest)
        except Exception:  # a compiler failure costs speed, never service
            self.failed = True
            log.exception("compiling the CPU decode graphs failed; every step runs eagerly")
            return
        # Compiling SmolLM2 leaves ~12,700 objects in reference cycles (0.35 s to collect). Collected
        # here, before any step runs a graph, their finalizers run on this thread, not at whatever
        # point of a serving step the collector next chose (inside one of torch's own loops, say).
        gc.collect()
        self.ready.set()
        _give_back_freed_memory()
        log.info("CPU decode graphs ready after %.0f s", time.perf_counter() - started)

    def _load_libraries(self, digest: str) -> None:
        """Every plan's graphs from the store, each built first where it has none. Finding their keys
        takes a trace of the step for one row and one for more (for each way of tracing its products):
        traced at any number of rows from two on, the step is the same graph (export refuses a size it
        cannot leave free), and only a build traces it again at its plan's own warm-up batch, whose
        sizes inductor takes as hints. SmolLM2 float32's two-row and eight-row traces had the same key;
        a trace takes ~6 s on two cores."""
        model = _sharing_weights(self.model)
        shared = SharedWeights(named_tensors_of(self.model))
        # (one row, output layer, dense products): (batch, program)
        traced: dict[tuple[bool, bool, bool], tuple[int, ExportedProgram]] = {}
        for plan, output_layer in zip(self.plans, self.output_layers, strict=True):
            step = _ExportedStep(model, output_layer)
            libraries = []
            for batch in plan.warmup_batches:
                key = batch == 1, output_layer, plan.dense_products
                if key not in traced:
                    traced[key] = batch, self._export(step, batch, plan.dense_products)
                traced_at, program = traced[key]
                trace_to_build = (None if traced_at == batch
                                  else functools.partial(self._export, step, batch, plan.dense_products))
                with compiling(plan, digest):
                    library = load_or_build(self.store, program, digest, plan.inductor_options,
                                            self._shapes(program), shared, trace_to_build)
                ids, positions, group, caches = self._warmup_args(batch)
                library(step_inputs(ids, positions, group, caches))  # loads its pages before a step needs them
                libraries.append(library)
            self.libraries.append(libraries)

    def _export(self, step: nn.Module, batch: int, dense_products: bool) -> ExportedProgram:
        """The step traced at a warm-up batch: one row, or any number of two or more, reading any number
        of positions of a pool of any number of blocks (so the pool's size is not in the store's key);
        with dense_products, its projections as linears over their dense weights."""
        rows = Dim.STATIC if batch == 1 else Dim.DYNAMIC
        per_row, pool = {0: rows}, {0: Dim.DYNAMIC}
        dims = (per_row, per_row, per_row, {0: rows, 1: Dim.DYNAMIC}, {0: rows, 3: Dim.DYNAMIC},
                per_row if self.attention_kernel else None, [(pool, pool)] * len(self.kv_caches))
        ids, positions, group, caches = self._warmup_args(batch)
        args = (ids, positions, group.slot_mapping, group.read_slots, group.visible, group.lengths, caches)
        # Each node's Python stack, kept for error messages, took ~1.4 s of a SmolLM2 trace's ~7.5.
        dense = traced_dense() if dense_products else contextlib.nullcontext()
        with unittest.mock.patch.object(fx_config, "do_not_emit_stack_traces", True), dense:
            return torch.export.export(step, args, dynamic_shapes=dims)

    def _shapes(self, program: ExportedProgram) -> Shapes:
        """What the library takes: rows are the first input's, positions the read slots' (step_inputs)."""
        caches = [(index, 0) for index in range(-2 * len(self.kv_caches), 0)]
        return shapes_of(program, rows=(0, 0), positions=(3, 1), others=caches)

    def _compile_modules(self) -> None:
        """torch.compile's graphs, for weights that do not export (oneDNN's opaque packs): at every start."""
        for cache in self.kv_caches:  # fixed shapes: no symbols, so no step's sizes can be taken for theirs
            for tensor in cache:
                torch._dynamo.mark_static(tensor)
        # The weights are frozen into the graphs, so guards on the modules would only cost time: with
        # them, looking the graph up took 1.7 ms of a 24 ms SmolLM2 step.
        skip_module_guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        for plan, output_layer in zip(self.plans, self.output_layers, strict=True):
            module = _DecodeLogits(self.model, output_layer)
            compiled = torch.compile(module, dynamic=True, options=skip_module_guards)
            with compiling(plan, None):
                for batch in plan.warmup_batches:
                    compiled(*self._warmup_args(batch))
            self.compiled.append(compiled)

    def plan_for(self, rows: int) -> int:
        """The index of the plan (and compiled module) a step of `rows` rows runs."""
        return next(i for i, plan in enumerate(self.plans) if plan.max_rows is None or rows <= plan.max_rows)

    def ends_with_logits(self, rows: int) -> bool:
        """Whether a step of `rows` rows gives logits through its graph, not final states."""
        return self.output_layers[self.plan_for(rows)]

    def _warmup_args(self, batch: int) -> tuple:
        """A batch whose tokens all write into the null block (which no request reads unmasked)."""
        context = (WARMUP_BLOCKS - 1) * self.block_size + 1
        meta = AttentionMetadata(
            slot_mapping=torch.full((batch,), NULL_BLOCK_ID * self.block_size, dtype=torch.int64),
            block_tables=torch.full((batch, WARMUP_BLOCKS), NULL_BLOCK_ID, dtype=torch.int32),
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
            context_lens=torch.full((batch,), context, dtype=torch.int32),
            max_query_len=1,
        )
        group = decode_group(meta, self.block_size, self.attention_kernel)
        ids = torch.zeros(batch, dtype=torch.int64)
        return ids, torch.zeros(batch, dtype=torch.int64), group, self.kv_caches

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Every row's (N, V) float32 logits, or (N, C) final states (see ends_with_logits); or None
        (the step then runs eagerly): the graphs are not ready, the step is not one decode group, or it
        has a shape they were not compiled for. Nothing is ever compiled on the caller's thread."""
        if not self.ready.is_set():
            return None
        group = decode_group(meta, self.block_size, self.attention_kernel)
        if group is None:
            return None
        return self.run_group(input_ids, positions, group)

    def run_group(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  group: DecodeGroupMetadata) -> torch.Tensor | None:
        """A decode group's output through the graph that covers its shape, or None where none does."""
        rows = input_ids.shape[0]
        plan = self.plan_for(rows)
        if self.libraries:
            read = group.read_slots.shape[1]
            library = next((lib for lib in self.libraries[plan] if lib.shapes.covers(rows, read)), None)
            if library is not None:
                return library(step_inputs(input_ids, positions, group, self.kv_caches))
            uncovered = f"{rows} rows reading {read} positions"
        else:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self.compiled[plan](input_ids, positions, group, self.kv_caches)
            except RuntimeError as exc:
                if RECOMPILE_REFUSED not in str(exc):  # dynamo says so in a plain RuntimeError
                    raise
                uncovered = str(exc)
        if self.num_uncovered_steps == 0:
            log.warning("a decode step the CPU graphs do not cover runs eagerly: %s", uncovered)
        self.num_uncovered_steps += 1
        return None
