"""Logit bias, min_tokens and the penalties, batched: equal to a plain per-row reference on mixed
batches, and in the engine, greedy with penalties equal to a dense loop that applies them by hand."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.engine.logits_processors import PendingTokens, process_logits
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import RequestRejected
from tests.unit.engine_runs import finish

VOCAB = 50
EOS = frozenset({2})


def reference(logits: list[float], p: SamplingParams, history: list[int], prompt_len: int) -> list[float]:
    """One row, one token at a time, as the OpenAI and vLLM documentation describe each control."""
    out = list(logits)
    for token, bias in p.logit_bias:
        out[token] += bias
    if len(history) - prompt_len < p.min_tokens:
        for token in {*p.stop_token_ids, *(() if p.ignore_eos else EOS)}:
            out[token] = float("-inf")
    output = history[prompt_len:]
    for token in range(len(out)):
        if token in history and p.repetition_penalty != 1.0:
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        count = output.count(token)
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        max_tokens=20,
        frequency_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
        presence_penalty=rng.choice([0.0, 1.0, -0.5]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        logit_bias=tuple((rng.randrange(VOCAB), rng.uniform(-100, 100)) for _ in range(rng.randrange(3))),
        min_tokens=rng.choice([0, 0, 3, 10]),
        stop_token_ids=rng.choice([(), (7,)]),
        ignore_eos=rng.random() < 0.2,
    )


def test_a_mixed_batch_equals_the_per_row_reference():
    rng = random.Random(0)
    params = [random_params(rng) for _ in range(32)] + [SamplingParams()] * 4
    rng.shuffle(params)
    histories = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))] for _ in params]
    prompt_lens = [rng.randrange(1, len(h) + 1) for h in histories]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(1))
    expected = torch.tensor([reference(row, p, h, n) for row, p, h, n in zip(logits.tolist(), params, histories, prompt_lens)])
    got = process_logits(logits.clone(), params, histories, prompt_lens, [len(h) for h in histories], EOS)
    torch.testing.assert_close(got, expected)
    assert any(p.processes_logits for p in params) and any(not p.processes_logits for p in params)


def test_a_token_still_on_the_device_counts_as_if_it_were_in_the_history():
    """An overlapped step's decodes take their last token from the device; the penalties count it
    there: the same logits as with the token in the history, whether seen before or new."""
    rng = random.Random(2)
    params = [random_params(rng) for _ in range(24)]
    histories = [[rng.randrange(VOCAB) for _ in range(rng.randrange(2, 40))] for _ in params]
    prompt_lens = [rng.randrange(1, len(h)) for h in histories]  # the last token is an output
    pending = [i for i in range(len(params)) if i % 3 != 2]  # some rows' last tokens are known
    histories[pending[0]][-1] = histories[pending[0]][prompt_lens[pending[0]] - 1]  # in the prompt already
    histories[pending[1]][-1] = VOCAB - 1  # seen nowhere else
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3))
    positions = [len(h) for h in histories]
    expected = process_logits(logits.clone(), params, histories, prompt_lens, positions, EOS)
    known = [h[:-1] if i in pending else h for i, h in enumerate(histories)]
    late = PendingTokens(pending, torch.tensor([histories[i][-1] for i in pending]))
    got = process_logits(logits.clone(), params, known, prompt_lens, positions, EOS, late)
    torch.testing.assert_close(got, expected)
    without = process_logits(logits.clone(), params, known, prompt_lens, positions, EOS)
    assert not torch.allclose(without, expected)  # the pending tokens change the logits


def test_rows_that_ask_nothing_are_not_touched():
    logits = torch.randn(3, VOCAB)
    got = process_logits(logits.clone(), [SamplingParams()] * 3, [[1, 2]] * 3, [1] * 3, [2] * 3, EOS)
    assert torch.equal(got, logits)


def dense_greedy_penalised(model, prompt: list[int], p: SamplingParams) -> list[int]:
    ids = list(prompt)
    for _ in range(p.max_tokens):
        logits = model.dense_forward(torch.tensor(ids))[-1].tolist()
        scores = reference(logits, p, ids, len(prompt))
        ids.append(max(range(len(scores)), key=scores.__getitem__))
    return ids[len(prompt) :]


PENALISED = [
    SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=1.5),
    SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=2.0),
    SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.8),
    SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.7, presence_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(max_tokens=12, temperature=0.0),
]


def test_greedy_with_penalties_equals_a_dense_loop_token_for_token(tiny):
    # A small vocabulary slice of the prompt repeats, so the penalties change what greedy picks.
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 40))] for _ in PENALISED]
    engine = Engine(tiny, EngineSettings(max_batch_tokens=32, num_kv_blocks=64), eos_token_ids=())
    requests = [Request(f"r{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, PENALISED))]
    outputs = finish(engine, requests)
    for request, prompt, p in zip(requests, prompts, PENALISED):
        assert request.output_token_ids == dense_greedy_penalised(tiny, prompt, p), request.request_id
    assert len({tuple(o) for o in outputs[:4]}) == 4  # the penalties did change the outputs
    assert len(set(outputs[1])) == len(outputs[1])  # a presence penalty of 2 never repeats here


def run(engine: Engine, request: Request) -> Request:
    finish(engine, [request])
    return request


def test_logit_bias_forces_a_token_and_min_tokens_holds_back_the_end(tiny):
    engine = Engine(tiny, EngineSettings(num_kv_blocks=32), eos_token_ids=(5,))
    forced = run(engine, Request("f", [9, 10, 11], SamplingParams(max_tokens=6, temperature=1.0, logit_bias=((42, 100.0),))))
    assert forced.output_token_ids == [42] * 6
    # Bias towards EOS: without min_tokens it ends at once; with it, not before 4 tokens.
    eos_bias = ((5, 100.0),)
    ended = run(engine, Request("e", [9, 10], SamplingParams(max_tokens=8, temperature=0.0, logit_bias=eos_bias)))
    assert ended.output_token_ids == [5] and ended.status.finish_reason == "stop"
    held = run(engine, Request("m", [9, 10], SamplingParams(max_tokens=8, temperature=0.0, logit_bias=eos_bias, min_tokens=4)))
    assert len(held.output_token_ids) == 5 and held.output_token_ids[-1] == 5 and 5 not in held.output_token_ids[:4]
    ignoring = run(engine, Request("i", [9, 10], SamplingParams(max_tokens=4, temperature=0.0, logit_bias=eos_bias, ignore_eos=True)))
    assert ignoring.output_token_ids == [5] * 4 and ignoring.status.finish_reason == "length"
    stop_id = run(engine, Request("s", [9, 10], SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((33, 100.0),), stop_token_ids=(33,))))
    assert stop_id.output_token_ids == [33] and stop_id.status.finish_reason == "stop"


def test_a_token_id_outside_the_vocabulary_is_refused(tiny):
    engine = Engine(tiny, EngineSettings(num_kv_blocks=16), eos_token_ids=())
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.add_request(Request("x", [1, 2], SamplingParams(logit_bias=((10**7, 1.0),))))


@pytest.mark.parametrize(
    ("field", "value"),
    [("frequency_penalty", 2.5), ("presence_penalty", -3.0), ("repetition_penalty", 0.0), ("min_tokens", 300),
     ("logit_bias", ((1, 101.0),)), ("logprobs", 21), ("stop_token_ids", (-1,))],
)  # fmt: skip
def test_controls_out_of_range_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
