"""Compiled CPU decode steps: which steps a graph takes, and an engine that compiles them (in the
background, serving eagerly meanwhile) produces exactly the eager engine's tokens."""

from __future__ import annotations

import copy
import os
import sys
import threading

import pytest
import torch

from kernels import cpu_panel_linear
from services.worker.engine import cpu_graph_store, cpu_graphs, shared_weights
from services.worker.engine.attention import AttentionMetadata
from services.worker.engine.cpu_graphs import (
    BFLOAT16,
    FEW_ROWS,
    INT8_KERNEL_CAPABILITIES,
    INT8_ONE_ROW,
    INT8_ROWS,
    MANY_ROWS,
    MIN_BLOCKS,
    QUANTIZED,
    decode_group,
    step_inputs,
    weights_digest,
)
from services.worker.engine.cpu_linear import CpuLinear, use_cpu_linear_
from services.worker.engine.engine import Engine
from services.worker.engine.library_call import releases_gil
from services.worker.engine.model import LlamaModel
from services.worker.engine.model_runner import ModelRunner, StepInputs
from services.worker.engine.quantize import quantize_
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from tests.unit.engine_runs import tokens_for

BLOCK = 16
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def decode_meta(contexts: list[int], tables: list[list[int]]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor([t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for c, t in zip(contexts, tables)]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        cu_seqlens_q=torch.arange(len(contexts) + 1, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        max_query_len=1,
    )


def test_a_decode_group_reads_whole_blocks_and_masks_past_each_context() -> None:
    group = decode_group(decode_meta([20, 33], [[5, 6], [7, 8, 9]]), BLOCK)
    assert group is not None
    blocks = [[5, 6, 0], [7, 8, 9]]  # past a table: the null block
    assert group.read_slots.tolist() == [[b * BLOCK + i for b in row for i in range(BLOCK)] for row in blocks]
    visible = group.visible[:, 0, 0, :]
    assert visible.shape == (2, 3 * BLOCK)
    assert visible.sum(dim=1).tolist() == [20, 33] and visible[0, :20].all() and visible[1, :33].all()
    assert group.slot_mapping.tolist() == [6 * BLOCK + 3, 9 * BLOCK + 0]


def test_a_short_context_still_reads_two_blocks() -> None:
    group = decode_group(decode_meta([3], [[4]]), BLOCK)
    assert group is not None and MIN_BLOCKS == 2
    assert group.read_slots.tolist() == [[4 * BLOCK + i for i in range(BLOCK)] + list(range(BLOCK))]


def test_contexts_far_apart_are_a_group_while_padding_the_short_ones_reads_few_positions() -> None:
    group = decode_group(decode_meta([10, 21], [[1], [2, 3]]), BLOCK)  # 21 > 2 x 10, 33 positions padded
    assert group is not None and group.visible[:, 0, 0, :].sum(dim=1).tolist() == [10, 21]
    longest = cpu_graphs.MAX_PADDED_POSITIONS + 100
    blocks = list(range(2, 2 + -(-longest // BLOCK)))
    assert decode_group(decode_meta([10, longest], [[1], blocks]), BLOCK) is None  # padding 10 to it: eagerly


def test_prompt_chunks_are_not_a_group() -> None:
    chunk = decode_meta([10], [[1]])
    chunk.max_query_len = 4
    assert decode_group(chunk, BLOCK) is None


def run(engine: Engine, prompts: list[list[int]], prefix: str) -> list[list[int]]:
    return tokens_for(engine, prompts, GREEDY, prefix)


@pytest.fixture(scope="module")
def engines(tiny: LlamaModel, one_torch_thread) -> tuple[Engine, Engine]:
    """An eager engine and one compiling its decode graphs in the background, over copies of one model
    with the projections float32 serving gives them, packed."""
    eager = Engine(use_cpu_linear_(copy.deepcopy(tiny)), EngineSettings(num_kv_blocks=64), 512,
                   eos_token_ids=())
    compiled = Engine(use_cpu_linear_(copy.deepcopy(tiny)),
                      EngineSettings(num_kv_blocks=64, cpu_compile="background", cpu_graph_store=False), 512,
                      eos_token_ids=())  # no store: the graphs are built while it serves, whatever was built before
    return eager, compiled


def test_background_compiling_serves_eagerly_then_through_the_graphs_with_the_same_tokens(engines) -> None:
    eager, compiled = engines
    graphs = compiled.runner.decode_graphs
    assert graphs is not None and not graphs.ready.is_set()
    prompts = [list(range(3, 40)), list(range(50, 70))]
    assert run(compiled, prompts, "before") == run(eager, prompts, "before")  # while it compiles: eagerly
    assert compiled.load().graph_steps == 0
    assert graphs.wait(timeout=600) and not graphs.failed
    for batch in ([list(range(7, 29))], [list(range(100 + 9 * i, 130 + 11 * i)) for i in range(3)]):  # both graphs
        before = compiled.load().graph_steps
        assert run(compiled, batch, "after") == run(eager, batch, "after")
        assert compiled.load().graph_steps >= GREEDY.max_tokens - 1 + before  # every decode step took a graph
    assert graphs.num_uncovered_steps == 0


def test_more_rows_than_a_few_run_the_second_graph_with_the_eager_tokens(engines) -> None:
    eager, compiled = engines
    graphs = compiled.runner.decode_graphs
    assert graphs.wait(timeout=600)
    assert graphs.plans == (FEW_ROWS, MANY_ROWS)  # not quantized
    few = FEW_ROWS.max_rows
    assert [graphs.plan_for(rows) for rows in (1, 2, few, few + 1, 64)] == [0, 0, 0, 1, 1]
    wide = [list(range(3 + i, 30 + i)) for i in range(few + 1)]
    before = compiled.load().graph_steps
    assert run(compiled, wide, "wide") == run(eager, wide, "wide")
    assert compiled.load().graph_steps >= before + GREEDY.max_tokens - 1


def test_the_graphs_write_the_kv_cache_as_the_eager_path_does(engines) -> None:
    eager, compiled = engines
    assert compiled.runner.decode_graphs.wait(timeout=600)
    run(compiled, [list(range(1, 30))], "kv")
    run(eager, [list(range(1, 30))], "kv")
    # Both engines ran the same requests in the same order, so their pools handed out the same blocks;
    # every block but the null one (the graphs' warm-up writes there) holds the same K/V.
    for (k_ours, v_ours), (k_ref, v_ref) in zip(compiled.runner.kv_caches, eager.runner.kv_caches, strict=True):
        torch.testing.assert_close(k_ours[1:], k_ref[1:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v_ours[1:], v_ref[1:], rtol=1e-4, atol=1e-5)


def test_the_graphs_attend_through_the_cpp_kernel(engines) -> None:
    _, compiled = engines
    graphs = compiled.runner.decode_graphs
    assert graphs.wait(timeout=600) and graphs.attention_kernel
    ids, positions, group, _ = graphs._warmup_args(8)
    with torch.no_grad(), torch.profiler.profile() as profile:
        assert graphs.run_group(ids, positions, group) is not None
    names = [event.name for event in profile.events()]
    assert names.count("drivetrain::paged_decode_attention") == compiled.runner.model.config.num_layers


def test_without_the_kernel_the_graphs_attend_by_tensor_operations_with_the_eager_tokens(
        tiny: LlamaModel, one_torch_thread) -> None:
    settings = EngineSettings(num_kv_blocks=64, cpu_compile="on", cpu_attention_kernel=False)
    compiled = Engine(use_cpu_linear_(copy.deepcopy(tiny)), settings, 512, eos_token_ids=())
    eager = Engine(copy.deepcopy(tiny), EngineSettings(num_kv_blocks=64), 512, eos_token_ids=())
    assert not compiled.runner.decode_graphs.attention_kernel
    batch = [list(range(10 + 7 * i, 40 + 5 * i)) for i in range(3)]
    assert run(compiled, batch, "ops") == run(eager, batch, "ops")
    assert compiled.load().graph_steps >= GREEDY.max_tokens - 1


def test_a_graph_step_lets_the_gil_go(engines) -> None:
    """A worker's event loop and gossip thread run while its engine thread is in a compiled step. With
    no forced hand-over of the GIL, another thread gets it only where its holder lets it go: during the
    first of many calls if a call lets it go, after the last if none does."""
    _, compiled = engines
    graphs = compiled.runner.decode_graphs
    assert graphs.wait(timeout=600) and releases_gil()
    ids, positions, group, caches = graphs._warmup_args(8)
    inputs = step_inputs(ids, positions, group, caches)
    read = group.read_slots.shape[1]
    library = next(lib for lib in graphs.libraries[graphs.plan_for(8)] if lib.shapes.covers(8, read))
    calls, begun = 50, []

    def steps() -> None:
        for call in range(calls):
            begun.append(call)
            library(inputs)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        stepping = threading.Thread(target=steps)
        stepping.start()  # returns once this thread holds the GIL again
        calls_begun = len(begun)
        stepping.join()
    finally:
        sys.setswitchinterval(interval)
    assert calls_begun < calls


def test_contexts_far_apart_run_the_graph_padded_with_the_eager_tokens(engines) -> None:
    eager, compiled = engines
    assert compiled.runner.decode_graphs.wait(timeout=600)
    spread = [list(range(5, 12)), list(range(20, 80))]  # contexts 7 and 60: two groups eagerly, one padded here
    before = compiled.load().graph_steps
    assert run(compiled, spread, "padded") == run(eager, spread, "padded")
    assert compiled.load().graph_steps >= before + GREEDY.max_tokens - 1


def test_a_step_the_graphs_do_not_take_runs_eagerly_with_the_same_tokens(engines, monkeypatch) -> None:
    eager, compiled = engines
    graphs = compiled.runner.decode_graphs
    assert graphs.wait(timeout=600)
    monkeypatch.setattr(cpu_graphs, "MAX_PADDED_POSITIONS", 0)  # contexts 7 and 60 are then no group
    spread = [list(range(5, 12)), list(range(20, 80))]
    before = compiled.load().graph_steps
    assert run(compiled, spread, "spread") == run(eager, spread, "spread")
    assert compiled.load().graph_steps - before < GREEDY.max_tokens - 1  # the steps of both ran eagerly


def negated(model: LlamaModel) -> LlamaModel:
    """A copy with every weight negated: a different model of the same shapes and types."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(-1.0)
    return other


def test_two_compiled_engines_in_one_process_keep_their_own_weights(tiny: LlamaModel, one_torch_thread) -> None:
    other = negated(tiny)
    settings = EngineSettings(num_kv_blocks=64, cpu_compile="on")
    prompt = [list(range(11, 40))]
    ours = [run(Engine(copy.deepcopy(m), settings, 512, eos_token_ids=()), prompt, "w") for m in (tiny, other)]
    eager = [run(Engine(copy.deepcopy(m), EngineSettings(num_kv_blocks=64), 512, eos_token_ids=()), prompt, "w")
             for m in (tiny, other)]
    assert ours == eager and ours[0] != ours[1]


def test_w8a8_projections_compile_into_the_graphs_with_the_eager_tokens(tiny: LlamaModel, one_torch_thread) -> None:
    # oneDNN's int8 product is an opaque packed weight to the compiler: it must lower, not fall back.
    compiled, eager = (
        Engine(quantize_(copy.deepcopy(tiny), "w8a8"), EngineSettings(num_kv_blocks=64, cpu_compile=mode),
               512, eos_token_ids=())
        for mode in ("on", "off")
    )
    graphs = compiled.runner.decode_graphs
    assert not graphs.failed and graphs.plans == (QUANTIZED,)
    assert graphs.compiled and not graphs.libraries  # torch.compile's: AOTInductor cannot export these weights
    batch = [list(range(100 + 3 * i, 130 + 3 * i)) for i in range(FEW_ROWS.max_rows + 1)]  # any batch: its graph
    assert run(compiled, batch, "q") == run(eager, batch, "q")
    assert compiled.load().graph_steps >= GREEDY.max_tokens - 1


class EagerBesideGraphs(ModelRunner):
    """Runs every step the graphs may take eagerly first, on the same inputs, and keeps both logits
    of each step a graph took."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _logits(self, inputs: StepInputs) -> torch.Tensor | None:
        graphs = self.decode_graphs
        if graphs is None or not graphs.ready.is_set() or len(inputs.sample_ids) != inputs.num_seqs:
            return super()._logits(inputs)
        eager = self.model.compute_logits(self._forward(inputs)[inputs.sample_rows])  # then the graph rewrites the KV
        graph_steps = self.num_graph_steps
        logits = super()._logits(inputs)
        if self.num_graph_steps > graph_steps:
            self.pairs.append((logits, eager))
        return logits


@pytest.mark.parametrize("panels", [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_panel_linear.available(torch.bfloat16), reason="bfloat16 panels need AVX512_BF16's dot products"))])
def test_bfloat16_compiles_one_module_for_every_batch_with_the_eager_logits(tiny: LlamaModel, panels: bool,
                                                                           one_torch_thread) -> None:
    """oneDNN's bfloat16 products outrun the autotuned kernels at a few rows too (cpu_graphs.BFLOAT16), and so
    do the panels, which the graphs call as the eager steps do."""
    settings = EngineSettings(num_kv_blocks=64, cpu_compile="on")
    model = copy.deepcopy(tiny).to(torch.bfloat16)
    if panels:
        use_cpu_linear_(model)
        assert all(isinstance(layer.mlp.down_proj, CpuLinear) and layer.mlp.down_proj.in_panels
                   for layer in model.layers)
    engine = Engine(model, settings, 512, eos_token_ids=(), runner_cls=EagerBesideGraphs)
    graphs = engine.runner.decode_graphs
    assert not graphs.failed and graphs.plans == (BFLOAT16,) and graphs.plan_for(1) == graphs.plan_for(64) == 0
    for batch in ([list(range(7, 29))], [list(range(100 + 3 * i, 130 + 3 * i)) for i in range(FEW_ROWS.max_rows + 1)]):
        engine.runner.pairs.clear()
        run(engine, batch, f"b{len(batch)}")
        assert len(engine.runner.pairs) == GREEDY.max_tokens - 1  # every decode step took the graph
        assert_close_to_eager(engine.runner.pairs, len(batch), tiny.config.vocab_size)


def assert_close_to_eager(pairs: list[tuple[torch.Tensor, torch.Tensor]], rows: int, vocab_size: int) -> None:
    """Bfloat16 rows round differently in fused kernels, and greedy breaks near-ties apart: logits, not tokens.
    Measured for bfloat16 weights: up to 0.022 and 0.0027 of the scale (attending to 3 positions past each
    context, 0.0055)."""
    for logits, eager in pairs:
        assert logits.shape == eager.shape == (rows, vocab_size)
        scale = eager.abs().amax().item()
        torch.testing.assert_close(logits, eager, rtol=0, atol=0.04 * scale)
        assert (logits - eager).abs().mean() < 0.004 * scale


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in INT8_KERNEL_CAPABILITIES,
                    reason="inductor has no weight-only int8 kernel for this CPU's vector ISA")
def test_one_int8_row_multiplies_through_inductors_kernels_alone(tiny: LlamaModel, one_torch_thread) -> None:
    """Autotuning may pick ATen's int8 product on weights that stay in the cache, which read from memory
    is the slower one (cpu_graphs.INT8_ONE_ROW): no one-row graph step may call it."""
    settings = EngineSettings(num_kv_blocks=64, cpu_compile="on")
    model = quantize_(copy.deepcopy(tiny), "int8")
    engine = Engine(model, settings, 512, eos_token_ids=(), runner_cls=EagerBesideGraphs)
    graphs = engine.runner.decode_graphs
    assert not graphs.failed and graphs.plans == (INT8_ONE_ROW, INT8_ROWS)
    aten_products: list[int] = []  # per one-row step the graph took
    graph_logits = graphs.run

    def counted(input_ids: torch.Tensor, *args) -> torch.Tensor | None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            logits = graph_logits(input_ids, *args)
        if logits is not None and input_ids.shape[0] == 1:
            aten_products.append(sum(event.name == "aten::_weight_int8pack_mm" for event in profile.events()))
        return logits

    graphs.run = counted
    for batch in ([list(range(7, 29))], [list(range(100 + 3 * i, 130 + 3 * i)) for i in range(3)]):
        engine.runner.pairs.clear()
        run(engine, batch, f"b{len(batch)}")
        assert len(engine.runner.pairs) == GREEDY.max_tokens - 1  # every decode step took a graph
        assert_close_to_eager(engine.runner.pairs, len(batch), tiny.config.vocab_size)
    assert aten_products == [0] * (GREEDY.max_tokens - 1)


def test_the_weights_digest_tells_models_apart_by_any_weight_and_gives_up_on_opaque_ones(tiny: LlamaModel) -> None:
    same, other = copy.deepcopy(tiny), copy.deepcopy(tiny)
    with torch.no_grad():
        other.layers[-1].mlp.down_proj.weight[0, 0] += 1e-3  # one weight of millions
    assert weights_digest(tiny) == weights_digest(same) != weights_digest(other)
    int8 = weights_digest(quantize_(copy.deepcopy(tiny), "int8"))
    assert int8 is not None and int8 != weights_digest(tiny)
    assert weights_digest(quantize_(copy.deepcopy(tiny), "w8a8")) is None  # oneDNN's packed weights
    packed = weights_digest(use_cpu_linear_(copy.deepcopy(tiny)))  # as the dense weights packed
    assert packed == weights_digest(use_cpu_linear_(copy.deepcopy(same))) != weights_digest(use_cpu_linear_(other))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_model_gets_graphs_of_its_own_after_another_of_its_shapes(
        tiny: LlamaModel, scheme: str, one_torch_thread) -> None:
    """A compiled graph holds what it packed from the weights: keyed by the weights' digest
    (cpu_graphs.weights_digest), the second model is not served the first one's graphs, from this
    process or any before it (inductor's own cache keys a frozen weight by its shape alone)."""
    settings = EngineSettings(num_kv_blocks=64, cpu_compile="on")
    first = Engine(quantize_(copy.deepcopy(tiny), scheme), settings, 512, eos_token_ids=())
    second = Engine(quantize_(negated(tiny), scheme), settings, 512, eos_token_ids=(), runner_cls=EagerBesideGraphs)
    assert not first.runner.decode_graphs.failed and not second.runner.decode_graphs.failed
    run(second, [list(range(7, 29))], "second")
    assert len(second.runner.pairs) == GREEDY.max_tokens - 1  # every decode step took a graph
    assert_close_to_eager(second.runner.pairs, 1, tiny.config.vocab_size)


def float32_engine(model: LlamaModel, **settings) -> Engine:
    return Engine(use_cpu_linear_(copy.deepcopy(model)),
                  EngineSettings(cpu_compile="on", **settings), 512, eos_token_ids=())


def refuse_to_build(*args) -> None:
    raise AssertionError("built a graph the store holds")


def refuse_to_digest(*args) -> None:
    raise AssertionError("digested a weight to load a stored graph")


def test_the_next_start_loads_the_graphs_it_built_whatever_the_pools_size(
        tiny: LlamaModel, tmp_path, monkeypatch, one_torch_thread) -> None:
    monkeypatch.setattr(cpu_graph_store, "default_store", lambda: tmp_path / "cpu-graphs")
    traced_at = []
    export = cpu_graphs.CpuDecodeGraphs._export
    monkeypatch.setattr(cpu_graphs.CpuDecodeGraphs, "_export",
                        lambda graphs, step, batch, dense: traced_at.append(batch) or export(graphs, step, batch, dense))
    first = float32_engine(tiny, num_kv_blocks=64)
    assert not first.runner.decode_graphs.failed
    assert len(list((tmp_path / "cpu-graphs").iterdir())) == 3  # one row, a few rows, more rows
    assert sorted(traced_at) == [1, 2, 8]  # each built from a trace at its warm-up batch
    monkeypatch.setattr(cpu_graph_store, "_build", refuse_to_build)
    monkeypatch.setattr(cpu_graph_store, "contents_key", refuse_to_digest)
    monkeypatch.setattr(shared_weights, "contents_key", refuse_to_digest)
    traced_at.clear()
    second = float32_engine(tiny, num_kv_blocks=96)
    assert not second.runner.decode_graphs.failed
    # A row and more rows: the keys of all three libraries; more rows twice where projections are held
    # in panels, which the few-rows graphs trace as dense linears and the many-rows graph does not.
    in_panels = first.runner.model.lm_head.in_panels
    assert sorted(traced_at) == ([1, 2, 8] if in_panels else [1, 2])
    for batch in ([list(range(7, 29))], [list(range(3 + i, 30 + i)) for i in range(FEW_ROWS.max_rows + 1)]):
        before = second.load().graph_steps
        assert run(second, batch, "again") == run(first, batch, "again")
        assert second.load().graph_steps >= before + GREEDY.max_tokens - 1


def test_the_graphs_hold_no_weight_twice(tiny: LlamaModel, tmp_path, monkeypatch, one_torch_thread) -> None:
    """Each library runs on the model's own tensors where it has them (oneDNN's packs, the embedding,
    the norms), and the few-rows graphs on one copy of what they packed for themselves."""
    monkeypatch.setattr(cpu_graph_store, "default_store", lambda: tmp_path / "cpu-graphs")
    engine = float32_engine(tiny, num_kv_blocks=64)
    model, graphs = engine.runner.model, engine.runner.decode_graphs
    (one, few), (many,) = graphs.libraries

    def held(library: cpu_graph_store.DecodeLibrary) -> set[int]:
        return {id(tensor) for tensor in library.weights.values()}

    packs = {id(layer.mlp.down_proj.packed) for layer in model.layers} | {id(model.lm_head.packed)}
    assert packs <= held(many)
    assert held(many) <= {id(tensor) for tensor in cpu_graphs.tensors_of(model)}
    assert held(one) == held(few)
    assert all(id(model.embed_tokens.weight) in held(library) for library in (one, few, many))
    # Those of their own lie at 64 bytes, as PyTorch allocates: where AOTInductor's reader put them,
    # 16 bytes past, oneDNN's products ran ~20 % slower (cpu_graph_store).
    model_ids = {id(tensor) for tensor in cpu_graphs.tensors_of(model)}
    own = [weight for weight in one.weights.values() if id(weight) not in model_ids]
    assert own and all(weight.data_ptr() % 64 == 0 for weight in own)
    # On disk, each library keeps the weights of its own alone, saved by PyTorch, and none for the
    # many rows; not AOTInductor's blob of them all.
    kept = {folder: {path.name for path in folder.iterdir()} for folder in (tmp_path / "cpu-graphs").iterdir()}
    assert not any(cpu_graph_store.WEIGHTS in names for names in kept.values())
    assert sorted(cpu_graph_store.OWN_WEIGHTS in names for names in kept.values()) == [False, True, True]


def test_weights_packed_by_inductor_stay_in_aotinductors_blob_and_load_from_it(
        tiny: LlamaModel, tmp_path, monkeypatch, one_torch_thread) -> None:
    """Dense float32 projections, which inductor's freezing packs for oneDNN itself (as it does bfloat16
    ones where oneDNN multiplies bfloat16): those packs are opaque, PyTorch does not save them, so the
    library keeps AOTInductor's blob and a load reads them from it, by the keys its build recorded."""
    monkeypatch.setattr(cpu_graph_store, "default_store", lambda: tmp_path / "cpu-graphs")
    settings = EngineSettings(num_kv_blocks=64, cpu_compile="on")
    first = Engine(copy.deepcopy(tiny), settings, 512, eos_token_ids=())
    blobs = [library for plan in first.runner.decode_graphs.libraries for library in plan
             if (library.folder / cpu_graph_store.WEIGHTS).is_file()]
    assert blobs and all(any(weight.is_mkldnn for weight in library.weights.values()) for library in blobs)
    monkeypatch.setattr(cpu_graph_store, "_build", refuse_to_build)
    monkeypatch.setattr(cpu_graph_store, "contents_key", refuse_to_digest)
    monkeypatch.setattr(shared_weights, "contents_key", refuse_to_digest)
    second = Engine(copy.deepcopy(tiny), settings, 512, eos_token_ids=())
    assert not second.runner.decode_graphs.failed
    wide = [list(range(3 + i, 30 + i)) for i in range(FEW_ROWS.max_rows + 1)]
    for batch in ([list(range(7, 29))], wide):
        before = second.load().graph_steps
        assert run(second, batch, "again") == run(first, batch, "again")
        assert second.load().graph_steps >= before + GREEDY.max_tokens - 1


@pytest.mark.parametrize("damage", ["cut short", "overwritten"])
def test_a_stored_graph_that_does_not_load_is_built_again(
        tiny: LlamaModel, tmp_path, monkeypatch, one_torch_thread, damage: str) -> None:
    monkeypatch.setattr(cpu_graph_store, "default_store", lambda: tmp_path / "cpu-graphs")
    float32_engine(tiny, num_kv_blocks=64)
    # A library's own weights cut short, as by a copy of the cache interrupted: reading them mapped would
    # read past their end (SIGBUS); or bytes of the same size that are not PyTorch's file. (Not its shared
    # object: this process has it mapped, and a file mapped is never rewritten in place; the store only
    # ever renames whole folders into place.)
    weights = next((tmp_path / "cpu-graphs").glob(f"*/{cpu_graph_store.OWN_WEIGHTS}"))
    if damage == "cut short":
        os.truncate(weights, weights.stat().st_size // 2)
    else:
        weights.write_bytes(os.urandom(weights.stat().st_size))
    again = float32_engine(tiny, num_kv_blocks=64)
    eager = Engine(copy.deepcopy(tiny), EngineSettings(num_kv_blocks=64), 512, eos_token_ids=())
    assert not again.runner.decode_graphs.failed
    wide = [list(range(3 + i, 30 + i)) for i in range(FEW_ROWS.max_rows + 1)]
    assert run(again, wide, "rebuilt") == run(eager, wide, "rebuilt")
    assert again.load().graph_steps >= GREEDY.max_tokens - 1
