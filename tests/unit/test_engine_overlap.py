"""Overlapped steps (engine.overlap_scheduling): each step is launched before the one before it is
read back, and what comes out is what the engine gives stepping in turn, update for update: greedy
and seeded draws, logprobs, penalties, min_tokens, end tokens, stop token ids, aborts, preemption,
a constrained request and a request that fails. On a CPU a launch computes at once; the order of
launches and reads is what a GPU would overlap."""

from __future__ import annotations

import copy
import dataclasses
import os
import random
from collections.abc import Callable, Iterator

import pytest
import torch
from llguidance import LLMatcher

from services.worker.engine.engine import Engine, RequestUpdate
from services.worker.engine.grammar_compiler import GrammarCompiler
from services.worker.engine.model import LlamaModel
from services.worker.engine.model_runner import ModelRunner, PendingStep
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import PLACEHOLDER, SchedulerOutput
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import Constraint
from shared.models.shapes import SHAPES
from shared.models.spec import resolve_model
from shared.models.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


class EventRunner(ModelRunner):
    """Records the order of launches and reads, and how many inputs were PLACEHOLDER."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int]] = []
        self.placeholders = 0

    def launch(self, out: SchedulerOutput) -> PendingStep:
        number = sum(kind == "launch" for kind, _ in self.events) + 1
        self.events.append(("launch", number))
        self.placeholders += sum(chunk.token_ids == [PLACEHOLDER] for chunk in out.chunks)
        pending = super().launch(out)
        events = self.events

        class Recorded(PendingStep):
            def result(self):
                events.append(("read", number))
                return super().result()

        return Recorded(pending.sample_ids, pending.tokens, pending.logprobs, pending.ready)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def run(
    model: LlamaModel,
    settings: EngineSettings,
    requests: list[Request],
    eos: tuple[int, ...] = (),
    abort_at: dict[str, int] | None = None,
    runner_cls: type[ModelRunner] = EventRunner,
    grammars: dict[str, LLMatcher] | None = None,
) -> tuple[Engine, list[RequestUpdate]]:
    """Step to the end; abort_at: abort a request once it has that many output tokens."""
    engine = Engine(model, settings, eos_token_ids=eos, runner_cls=runner_cls)
    for request in requests:
        engine.add_request(request, (grammars or {}).get(request.request_id))
    updates: list[RequestUpdate] = []
    for _ in range(2_000):
        if not engine.has_unfinished_requests():
            return engine, updates
        updates += engine.step()
        for request_id, after in (abort_at or {}).items():
            request = engine.get_request(request_id)
            if request is not None and request.num_output_tokens >= after:
                engine.abort_request(request_id)
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def lowercase_words() -> Iterator[Callable[[], LLMatcher]]:
    """A fresh matcher, each call, for text of lowercase words: a grammar that runs for many steps."""
    compiler = GrammarCompiler(Tokenizer.from_folder(resolve_model("tiny").tokenizer_folder), 49152, (2,))
    yield lambda: compiler.matcher(Constraint("regex", "[a-z]+( [a-z]+)*"))
    compiler.close()


def mixed_requests(end_token: int) -> list[Request]:
    lengths = [5, 17, 33, 48, 9, 70, 21, 40]
    p = prompts(11, lengths)
    sampling = [
        GREEDY,
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7),  # seeded: repeats exactly
        SamplingParams(max_tokens=9, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=2.0, frequency_penalty=2.0),
        # The end token is the favourite, masked until 4 tokens are out: it comes 5th, not 6th.
        SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4, logit_bias=((end_token, 100.0),)),
        SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=(end_token,)),
        GREEDY,
        SamplingParams(max_tokens=11, temperature=0.0, logit_bias=((end_token, 5.0),), presence_penalty=2.0),
    ]
    return [Request(f"r{i}", prompt, s) for i, (prompt, s) in enumerate(zip(p, sampling, strict=True))]


def by_request(updates: list[RequestUpdate], approximate: bool = False) -> dict[str, list[tuple]]:
    """Each request's updates in order; `approximate`: logprobs to 1e-4, for comparing with another
    run, where preemption can make other batches and a product over another batch rounds its last
    bits otherwise."""
    near = (lambda x: pytest.approx(x, abs=1e-4)) if approximate else (lambda x: x)
    seen: dict[str, list[tuple]] = {}
    for u in updates:
        logprobs = [
            (lp.token_id, near(lp.logprob), [t for t, _ in lp.top], near([p for _, p in lp.top])) for lp in u.logprobs
        ]
        seen.setdefault(u.request_id, []).append((u.new_token_ids, u.finish_reason, u.error, logprobs))
    return seen


ON_A_GPU = pytest.param(
    "cuda",
    marks=pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
        reason="needs a GPU, and the compiled kernels: run with TRITON_INTERPRET=0",
    ),
)


def read_at_once(events: list[tuple[str, int]]) -> int:
    """Steps whose tokens were read before the next step was launched."""
    return sum(a == ("launch", n) and b == ("read", n) for a, b in zip(events, events[1:]) for n in [a[1]])


@pytest.mark.parametrize("device", ["cpu", ON_A_GPU])
@pytest.mark.parametrize("constrained", [False, True], ids=["overlapped-throughout", "grammar-waits"])
@pytest.mark.parametrize("kv_blocks", [128, 14], ids=["roomy", "preempting"])
def test_overlapped_steps_give_the_same_updates_as_steps_in_turn(
    tiny: LlamaModel, kv_blocks: int, constrained: bool, device: str, lowercase_words: Callable[[], LLMatcher]
) -> None:
    """On a GPU, with CUDA graphs, pinned copies and the events the host waits on. Penalised
    requests overlap; with `constrained`, r2's grammar makes every step it is in wait for the one before."""
    tiny = copy.deepcopy(tiny).to(device)
    # An end token that greedy decoding meets: the second output token of r6 in turn.
    probe = Request("probe", mixed_requests(0)[6].all_token_ids, GREEDY)
    run(tiny, EngineSettings(num_kv_blocks=128), [probe])
    end_token = probe.output_token_ids[1]
    settings = EngineSettings(max_batch_tokens=48, num_kv_blocks=kv_blocks, max_num_seqs=8)
    results = {}
    for overlap in ("off", "on"):
        requests = mixed_requests(end_token)
        grammars = {"r2": lowercase_words()} if constrained else None
        engine, updates = run(tiny, dataclasses.replace(settings, overlap_scheduling=overlap), requests,
                              eos=(end_token,), abort_at={"r0": 4}, grammars=grammars)  # fmt: skip
        pool = engine.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_usable_blocks  # everything given back
        outputs = [(r.output_token_ids, r.status) for r in requests]
        results[overlap] = (by_request(updates, approximate=overlap == "off"), outputs, engine)
    in_turn, overlapped = results["off"], results["on"]
    held_to_min, _ = in_turn[1][4]  # counted one short (its last token still on the device), it would end 6th
    assert held_to_min == held_to_min[:4] + [end_token] and end_token not in held_to_min[:4]
    assert overlapped[0] == in_turn[0]  # every update, in order per request
    assert overlapped[1] == in_turn[1]
    statuses = {status for _, status in in_turn[1]}
    assert {RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH} <= statuses
    assert overlapped[2].runner.placeholders > 0 and in_turn[2].runner.placeholders == 0
    assert (read_at_once(overlapped[2].runner.events) > 0) == constrained  # else every step overlapped
    if kv_blocks == 14:
        assert overlapped[2].scheduler.num_preemptions > 0


def test_a_step_is_launched_before_the_one_before_is_read(tiny: LlamaModel) -> None:
    settings = EngineSettings(num_kv_blocks=64, overlap_scheduling="on")
    engine, _ = run(tiny, settings, [Request("a", prompts(1, [20])[0], SamplingParams(max_tokens=4, temperature=0.0))])
    # The prompt draws token 1, three decodes tokens 2-4, each read once the next step is out; a
    # request whose pending token is its last is not scheduled again, so there is no fifth.
    assert engine.runner.events == [
        ("launch", 1), ("launch", 2), ("read", 1), ("launch", 3), ("read", 2), ("launch", 4), ("read", 3), ("read", 4),
    ]  # fmt: skip


def test_a_constrained_request_is_not_overlapped(tiny: LlamaModel, lowercase_words: Callable[[], LLMatcher]) -> None:
    settings = EngineSettings(num_kv_blocks=64, overlap_scheduling="on")
    request = Request("a", prompts(2, [20])[0], SamplingParams(max_tokens=3, temperature=0.0))
    engine, _ = run(tiny, settings, [request], grammars={"a": lowercase_words()})
    assert engine.runner.events == [("launch", 1), ("read", 1), ("launch", 2), ("read", 2), ("launch", 3), ("read", 3)]
    assert engine.runner.placeholders == 0


def test_penalties_count_the_token_on_the_device_so_they_are_overlapped() -> None:
    # Stock random weights: greedy repeats the prompt's last token, 38 ahead of the next; biased to
    # lead by less than the penalties, it is drawn again only if they miss the last draw.
    torch.manual_seed(0)
    stock = LlamaModel(SHAPES["tiny"]).eval()
    prompt = prompts(4, [20])[0]
    penalised = SamplingParams(max_tokens=6, temperature=0.0, frequency_penalty=1.0, presence_penalty=1.0,
                               logit_bias=((prompt[-1], -36.0),))  # fmt: skip
    outputs = {}
    for overlap in ("off", "on"):
        request = Request("a", prompt, penalised)
        engine, _ = run(stock, EngineSettings(num_kv_blocks=64, overlap_scheduling=overlap), [request])
        outputs[overlap] = request.output_token_ids
    assert engine.runner.events[:3] == [("launch", 1), ("launch", 2), ("read", 1)]
    assert read_at_once(engine.runner.events) == 0 and engine.runner.placeholders == 5
    assert outputs["off"][:2] == [prompt[-1], 41256]  # the first draw counted against the second
    assert outputs["on"] == outputs["off"]


def test_min_tokens_is_counted_from_positions_so_it_is_overlapped(tiny: LlamaModel) -> None:
    held = SamplingParams(max_tokens=3, temperature=0.0, min_tokens=3)
    settings = EngineSettings(num_kv_blocks=64, overlap_scheduling="on")
    engine, _ = run(tiny, settings, [Request("a", prompts(2, [20])[0], held)])
    assert engine.runner.events[:3] == [("launch", 1), ("launch", 2), ("read", 1)] and engine.runner.placeholders == 2


def test_an_end_token_costs_one_dropped_row(tiny: LlamaModel) -> None:
    prompt = prompts(3, [25])[0]
    probe = Request("probe", prompt, GREEDY)
    run(tiny, EngineSettings(num_kv_blocks=64), [probe])
    end_token = probe.output_token_ids[2]  # the third token ends it
    settings = EngineSettings(num_kv_blocks=64, overlap_scheduling="on")
    request = Request("a", prompt, GREEDY)
    engine, updates = run(tiny, settings, [request], eos=(end_token,))
    assert request.output_token_ids == probe.output_token_ids[:3] and request.status is RequestStatus.FINISHED_STOPPED
    assert [u.new_token_ids for u in updates] == [[t] for t in probe.output_token_ids[:3]]  # nothing after the end
    assert sum(kind == "launch" for kind, _ in engine.runner.events) == 4  # the fourth: computed, dropped


def test_a_request_that_raises_fails_alone_overlapped(tiny: LlamaModel, faulty_runner: type[ModelRunner]) -> None:
    good = [Request(f"g{i}", p, GREEDY) for i, p in enumerate(prompts(4, [7, 20, 33]))]
    alone = [Request(r.request_id, r.all_token_ids, GREEDY) for r in good]
    run(tiny, EngineSettings(num_kv_blocks=64), alone, runner_cls=ModelRunner)
    bad = Request("bad", prompts(5, [12])[0], GREEDY)
    settings = EngineSettings(max_batch_tokens=64, num_kv_blocks=64, overlap_scheduling="on")
    # Added after the others have started: its first step holds their pending tokens.
    engine = Engine(tiny, settings, eos_token_ids=(), runner_cls=faulty_runner)
    for request in good:
        engine.add_request(request)
    updates = engine.step() + engine.step()
    engine.add_request(bad)
    while engine.has_unfinished_requests():
        updates += engine.step()
    failed = [u for u in updates if u.error is not None]
    assert [u.request_id for u in failed] == ["bad"] and bad.status is RequestStatus.FINISHED_ERROR
    assert [r.output_token_ids for r in good] == [r.output_token_ids for r in alone]
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
