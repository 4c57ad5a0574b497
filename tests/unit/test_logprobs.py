"""Logprobs of sampled tokens: those of the distribution drawn from (after the logit changes and the
temperature), each row's top alternatives most likely first, only for rows that ask; and through
the engine, one per generated token, whose text is the token's."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.engine.llm_engine import build_llm_engine
from services.worker.engine.logprobs import FLOOR, token_logprobs
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import EngineRequest, Message
from shared.models.spec import resolve_model


def test_each_row_gets_its_own_temperature_and_count_and_others_get_none():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    logits[3, 5:] = float("-inf")  # a row whose distribution rules most tokens out
    params = [SamplingParams(temperature=0.5, logprobs=3), SamplingParams(), SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0, logprobs=8)]  # fmt: skip
    tokens = torch.tensor([7, 1, 2, 4])
    got = token_logprobs(logits, params, tokens, ["a", "b", "c", "d"]).read()
    assert token_logprobs(logits, [SamplingParams()] * 4, tokens, ["a", "b", "c", "d"]) is None  # none asked
    assert set(got) == {"a", "c", "d"}
    expected = torch.log_softmax(logits[0] / 0.5, dim=-1)
    assert got["a"].token_id == 7 and got["a"].logprob == pytest.approx(float(expected[7]), abs=1e-5)
    assert [t for t, _ in got["a"].top] == expected.topk(3).indices.tolist()
    assert got["c"].top == () and got["c"].logprob == pytest.approx(float(torch.log_softmax(logits[2], -1)[2]), abs=1e-5)
    masked = got["d"].top
    assert sum(math.exp(p) for _, p in masked) == pytest.approx(1.0, abs=1e-4)  # the 5 allowed hold all the mass
    assert [p for _, p in masked][5:] == [FLOOR] * 3  # the ruled-out ones, floored: JSON has no -inf


def test_the_engine_reports_a_logprob_per_generated_token():
    llm = build_llm_engine(resolve_model("tiny", max_model_len=256), EngineSettings(num_kv_blocks=24), "cpu")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4)
    llm.add_request(EngineRequest("g", "t", [Message("user", "hello there")], greedy))
    llm.add_request(EngineRequest("n", "t", [Message("user", "hello there")], SamplingParams(max_tokens=6)))
    outputs: dict[str, list] = {"g": [], "n": []}
    while llm.has_unfinished_requests():
        for output in llm.step():
            outputs[output.request_id].append(output)
    logprobs = [lp for o in outputs["g"] for lp in o.logprobs]
    assert len(logprobs) == outputs["g"][-1].usage.completion_tokens == 6
    for lp in logprobs:
        assert len(lp.top) == 4 and lp.top[0] == (lp.token, lp.logprob)  # greedy draws the likeliest
        assert lp.logprob <= 0 and sum(math.exp(p) for _, p in lp.top) <= 1 + 1e-5
    assert "".join(lp.token for lp in logprobs) == "".join(o.text for o in outputs["g"])
    assert all(not o.logprobs for o in outputs["n"])
