"""Engine over token ids: greedy output equal token for token to a plain dense loop under chunked
prefill, prefix-cache hits and preemption; failures isolated to their request; seeded sampling
repeatable; stop conditions; the padding rows that CUDA graphs rely on."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import random

import numpy as np
import pytest
import torch

from services.worker.engine.chunk_cost import attention_parity
from services.worker.engine.cuda_graphs import graph_batch_sizes
from services.worker.engine.engine import Engine, RequestUpdate, resolve
from services.worker.engine.model import LlamaModel
from services.worker.engine.model_runner import ModelRunner, mix_seed, prepare_inputs
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import ScheduledChunk, SchedulerOutput
from services.worker.engine.settings import EngineSettings
from services.worker.engine.weights import load_model
from shared.models.spec import context_length, resolve_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tiny_fixture_output_depends_on_early_context(tiny: LlamaModel) -> None:
    prompt = random_prompts(0, [40])[0]
    changed = list(prompt)
    changed[2] += 1
    assert dense_greedy(tiny, prompt, 4) != dense_greedy(tiny, changed, 4)


@pytest.fixture(scope="module")
def smollm2():
    return load_model(resolve_model("smollm2"), "cpu", torch.float32)


def dense_greedy(model: LlamaModel, prompt: list[int], max_tokens: int, eos: tuple[int, ...] = ()) -> list[int]:
    """The ground truth: recompute the whole sequence densely for every new token, no cache."""
    ids = list(prompt)
    for _ in range(max_tokens):
        token = int(model.dense_forward(torch.tensor(ids))[-1].argmax())
        ids.append(token)
        if token in eos:
            break
    return ids[len(prompt) :]


def run_all(engine: Engine, requests: list[Request]) -> list[RequestUpdate]:
    for request in requests:
        engine.add_request(request)
    updates = []
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return updates
        updates.extend(engine.step())
    raise AssertionError("the engine did not finish")


def random_prompts(seed: int, lengths: list[int], shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


# Lengths from 1 token to several blocks; max_tokens varies so requests finish at different steps.
LENGTHS = [1, 5, 16, 17, 31, 48, 70, 90]
MAX_TOKENS = [6, 1, 9, 4, 12, 7, 3, 10]
SCENARIOS = {
    # a budget of 24 tokens a step: the longer prompts are computed a chunk at a time
    "chunked": (EngineSettings(max_batch_tokens=24, num_kv_blocks=128), 0),
    # 40 shared tokens = 2 full blocks + 8: later prompts hit the first two blocks
    "prefix": (EngineSettings(max_batch_tokens=64, num_kv_blocks=128), 40),
    # 13 usable blocks cannot hold all eight requests: the newest are preempted and recomputed
    "preempt": (EngineSettings(max_batch_tokens=48, num_kv_blocks=14, max_num_seqs=8), 0),
}


class RecordingRunner(ModelRunner):
    """Keeps (request id, start position, tokens, sample) of every chunk it runs."""

    def launch(self, out: SchedulerOutput):
        self.chunks = getattr(self, "chunks", [])
        self.chunks += [(c.request_id, c.start_position, c.num_tokens, c.sample) for c in out.chunks]
        return super().launch(out)


@pytest.mark.parametrize("overlap", ["off", "on"], ids=["in-turn", "overlapped"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_tiny_engine_greedy_equals_dense_loop(tiny: LlamaModel, scenario: str, overlap: str) -> None:
    config, shared = SCENARIOS[scenario]
    prompts = random_prompts(1, LENGTHS, shared)
    config = dataclasses.replace(config, overlap_scheduling=overlap)
    engine = Engine(tiny, config, eos_token_ids=(), runner_cls=RecordingRunner)
    requests = [
        Request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0))
        for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS))
    ]
    updates = run_all(engine, requests)

    for request, prompt, n in zip(requests, prompts, MAX_TOKENS):
        assert request.output_token_ids == dense_greedy(tiny, prompt, n), request.request_id
        assert request.status.finish_reason == "length"
        assert [u.finish_reason for u in updates if u.request_id == request.request_id][-1] == "length"
    chunks = engine.runner.chunks
    if scenario == "chunked":  # prompts continued from the middle, over several steps
        assert sum(1 for _, start, _, sample in chunks if start > 0 and not sample) >= 3
    if scenario == "prefix":
        # The first step admits two prompts before any block is cached; the rest hit both blocks
        # and start computing at position 32. Overlapped, blocks enter the cache when their step is
        # back, after the next step is scheduled: that step's prompt misses too.
        misses = 2 if overlap == "off" else 3
        expected = [0] * misses + [32] * (len(requests) - misses)
        assert sorted(r.num_cached_tokens for r in requests) == expected
        first_starts = {rid: start for rid, start, _, _ in reversed(chunks)}
        assert sorted(first_starts.values()) == expected
    if scenario == "preempt":  # preempted requests compute again what they had lost
        assert engine.scheduler.num_preemptions > 0
        computed: dict[str, int] = {}
        recomputed = 0
        for rid, start, num_tokens, _ in chunks:
            recomputed += start < computed.get(rid, 0)
            computed[rid] = start + num_tokens
        assert recomputed > 0
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks  # everything given back


def test_stock_tiny_shape_equals_dense_loop() -> None:
    model = load_model(resolve_model("tiny"), "cpu", torch.float32)[0]
    prompts = random_prompts(8, [9, 33, 50])
    engine = Engine(model, EngineSettings(max_batch_tokens=20, num_kv_blocks=7), eos_token_ids=())
    requests = [Request(str(i), p, SamplingParams(max_tokens=5, temperature=0.0)) for i, p in enumerate(prompts)]
    run_all(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == dense_greedy(model, prompt, 5)


def test_smollm2_engine_greedy_equals_dense_loop(smollm2) -> None:
    model, tokenizer = smollm2
    questions = ["What is the capital of France?", "Say hi.", "Count: one, two,"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    eos = model.config.eos_token_ids
    # A budget of 16 tokens splits every chat prompt; the shared template opening is a cache hit.
    engine = Engine(model, EngineSettings(max_batch_tokens=16, num_kv_blocks=32))
    requests = [Request(str(i), p, SamplingParams(max_tokens=5, temperature=0.0)) for i, p in enumerate(prompts)]
    run_all(engine, requests)
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == dense_greedy(model, prompt, 5, eos)


def test_a_request_that_raises_fails_alone(tiny: LlamaModel, faulty_runner: type[ModelRunner]) -> None:
    prompts = random_prompts(2, [7, 20, 33])
    settings = EngineSettings(max_batch_tokens=64, num_kv_blocks=64)
    engine = Engine(tiny, settings, eos_token_ids=(), runner_cls=faulty_runner)
    good = [Request(f"g{i}", p, SamplingParams(max_tokens=6, temperature=0.0)) for i, p in enumerate(prompts)]
    bad = Request("bad", random_prompts(3, [12])[0], SamplingParams(max_tokens=6, temperature=0.0))
    updates = run_all(engine, [good[0], bad, good[1], good[2]])

    failed = [u for u in updates if u.error is not None]
    assert [u.request_id for u in failed] == ["bad"] and failed[0].finish_reason is None
    assert bad.status is RequestStatus.FINISHED_ERROR and bad.num_output_tokens == 0
    assert engine.num_isolated_failures >= 1
    for request, prompt in zip(good, prompts):
        assert request.output_token_ids == dense_greedy(tiny, prompt, 6)
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def run_seeded(model: LlamaModel, config: EngineSettings, target: list[int], others: list[list[int]]) -> Request:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    engine = Engine(model, config, eos_token_ids=())
    request = Request("target", target, seeded)
    # Others sample too, unseeded, from the global stream: they must not disturb the target's draws.
    noise = [Request(f"o{i}", p, SamplingParams(max_tokens=9, temperature=0.8)) for i, p in enumerate(others)]
    run_all(engine, noise + [request])  # the target last: the newest, so the first preempted
    return request


def test_seeded_sampling_repeats_across_runs_and_batches(tiny: LlamaModel) -> None:
    target, *others = random_prompts(4, [21, 9, 40, 3, 64])
    roomy = EngineSettings(max_batch_tokens=64, num_kv_blocks=128)
    alone = run_seeded(tiny, roomy, target, []).output_token_ids
    assert len(set(alone)) > 6  # really sampled, not one token over and over
    assert run_seeded(tiny, roomy, target, []).output_token_ids == alone
    assert run_seeded(tiny, roomy, target, others).output_token_ids == alone
    chunked = EngineSettings(max_batch_tokens=16, num_kv_blocks=128)
    assert run_seeded(tiny, chunked, target, others[:2]).output_token_ids == alone
    # Even a preempted and recomputed request draws the same tokens.
    preempted = run_seeded(tiny, EngineSettings(max_batch_tokens=64, num_kv_blocks=8), target, others[:3])
    assert preempted.num_preemptions > 0 and preempted.output_token_ids == alone
    other_seed = Request("x", target, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1235))
    run_all(Engine(tiny, roomy, eos_token_ids=()), [other_seed])
    assert other_seed.output_token_ids != alone


def test_eos_and_max_model_len_stop_a_request(tiny: LlamaModel) -> None:
    prompt = random_prompts(5, [30])[0]
    first = dense_greedy(tiny, prompt, 10)
    # Declare EOS the first greedy token that is new after the first one: the request stops there.
    end = next(i for i, t in enumerate(first) if i > 0 and t not in first[:i])
    engine = Engine(tiny, EngineSettings(num_kv_blocks=64), eos_token_ids=(first[end],))
    request = Request("a", prompt, SamplingParams(max_tokens=10, temperature=0.0))
    updates = run_all(engine, [request])
    assert request.output_token_ids == first[: end + 1] and updates[-1].finish_reason == "stop"
    # 30 prompt tokens and max_model_len 32: two tokens, then "length" despite max_tokens 10.
    engine = Engine(tiny, EngineSettings(num_kv_blocks=64), max_model_len=32, eos_token_ids=())
    request = Request("b", prompt, SamplingParams(max_tokens=10, temperature=0.0))
    updates = run_all(engine, [request])
    assert request.output_token_ids == first[:2] and updates[-1].finish_reason == "length"


def test_abort_frees_blocks_at_once(tiny: LlamaModel) -> None:
    engine = Engine(tiny, EngineSettings(num_kv_blocks=32), eos_token_ids=())
    pool = engine.kv_cache_manager.block_pool
    a, b = (Request(n, p, GREEDY) for n, p in zip("ab", random_prompts(6, [40, 20])))
    engine.add_request(a)
    engine.add_request(b)
    engine.step()
    held_by_a = len(engine.kv_cache_manager.get_block_ids(a))
    free_before = pool.num_free_blocks
    assert held_by_a == 3 and engine.abort_request("a")
    assert pool.num_free_blocks == free_before + held_by_a
    assert engine.request_ids() == ["b"] and a.status.finish_reason == "cancelled"
    assert not engine.abort_request("a")
    assert all(u.request_id == "b" for u in engine.step())


def test_chunks_count_their_attention_by_the_model_s_parity_unless_set_off(tiny: LlamaModel) -> None:
    def parity(settings: EngineSettings) -> int:
        return resolve(settings, tiny.config, 256, torch.device("cpu"))[0].attention_parity

    assert parity(EngineSettings()) == attention_parity(tiny.config) > 0
    assert parity(EngineSettings(count_chunk_attention=False)) == 0


def test_padding_rows_write_nothing_and_leave_real_rows_unchanged(tiny: LlamaModel) -> None:
    """What a CUDA graph replay relies on: padded decode rows (slot -1, null block, context 1)."""
    settings = EngineSettings(num_kv_blocks=16)
    runner = ModelRunner(tiny, resolve(settings, tiny.config, context_length(tiny.config), torch.device("cpu"))[1])
    prompt = random_prompts(7, [19])[0]
    tables = np.array([[3, 5]], dtype=np.int32)  # request a's blocks: row 0
    prefill = SchedulerOutput([ScheduledChunk("a", prompt, 0, 0, True, GREEDY)], block_tables=tables)
    token = runner.run(prefill).tokens["a"]
    decode = SchedulerOutput([ScheduledChunk("a", [token], 19, 0, True, GREEDY)], block_tables=tables)
    plain, padded = prepare_inputs(decode, 16), prepare_inputs(decode, 16, pad_to=4)
    assert padded.meta.slot_mapping.tolist() == [5 * 16 + 3, -1, -1, -1]
    assert padded.meta.context_lens.tolist() == [20, 1, 1, 1]
    assert padded.meta.block_tables.tolist() == [[3, 5], [0, 0], [0, 0], [0, 0]]
    assert padded.meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4] and padded.meta.decode_only
    caches_before = [k.clone() for k, _ in runner.kv_caches]
    with torch.no_grad():
        hidden_padded = runner._forward(padded)  # (4, C)
        hidden_plain = runner._forward(plain)  # (1, C)
    torch.testing.assert_close(hidden_padded[:1], hidden_plain)
    for (k, _), before in zip(runner.kv_caches, caches_before):
        assert torch.equal(k[0], before[0])  # the null block never written
        assert not torch.equal(k[5][3], before[5][3])  # the real row was


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a GPU, and the compiled kernels: run with TRITON_INTERPRET=0",
)
def test_cuda_graph_replay_equals_eager_and_dense(tiny: LlamaModel) -> None:
    model = copy.deepcopy(tiny).to("cuda")
    prompts = random_prompts(9, [3, 18, 40, 7, 29])  # five sequences: replayed padded to 8, then 4, 2, 1
    max_tokens = [9, 5, 12, 3, 7]
    outputs = {}
    for graphs in (True, False):
        engine = Engine(model, EngineSettings(num_kv_blocks=64, max_num_seqs=8, cuda_graphs=graphs), eos_token_ids=())
        assert (engine.runner.graphs is not None) == graphs
        requests = [Request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0))
                    for i, (p, n) in enumerate(zip(prompts, max_tokens))]
        run_all(engine, requests)
        outputs[graphs] = [r.output_token_ids for r in requests]
    assert outputs[True] == outputs[False]
    assert outputs[True] == [dense_greedy(tiny, p, n) for p, n in zip(prompts, max_tokens)]


def test_graph_batch_sizes_cover_every_batch() -> None:
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    for max_num_seqs in (1, 3, 8, 20, 100, 256):
        sizes = graph_batch_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
        assert all(b - a <= 16 for a, b in itertools.pairwise(sizes))


def test_mix_seed_spreads_and_fits_a_generator() -> None:
    seeds = {mix_seed(s, p) for s in range(20) for p in range(50)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
