"""/v1/completions `logprobs` (OpenAI's integer form), pure: the request reaches the frame, and bodies and
chunks carry tokens, logprobs, alternatives as dicts and text offsets."""

from __future__ import annotations

import json

from services.edge.completion_logprobs import CompletionLogprobs, top_dict
from services.edge.openai_completions_schema import parse_completions_request
from services.edge.openai_schema import CompletionHeader
from services.edge.protocol import DoneFrame, LogprobBody, UsageBody
from shared.codes import FinishReason

HEAD = CompletionHeader("cmpl-1", 1700000000, "echo")
DONE = DoneFrame("c", FinishReason.STOP, UsageBody(prompt_tokens=2, cached_tokens=0, completion_tokens=3))
HEL = LogprobBody("Hel", -0.25, [("Hel", -0.25), ("Hi", -1.5)])
LO = LogprobBody("lo", -0.5, [("lo", -0.5), ("p", -2.0)])
BANG = LogprobBody("!", -1.0, [("!", -1.0), (".", -1.25)])


def completions(**fields):
    return parse_completions_request(json.dumps({"model": "echo", "prompt": "Say", **fields}).encode(), "echo", "c1", HEAD)


def test_the_integer_asks_the_engine_for_that_many_alternatives():
    assert completions(logprobs=3).frame.logprobs == 3
    assert completions(logprobs=0).frame.logprobs == 0  # the chosen token's own logprob only
    assert completions().frame.logprobs is None


def test_a_whole_body_carries_openais_logprobs_object():
    body = completions(logprobs=2).renderer.body("Hello!", DONE, [HEL, LO, BANG])
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Hel", "lo", "!"],
        "token_logprobs": [-0.25, -0.5, -1.0],
        "top_logprobs": [{"Hel": -0.25, "Hi": -1.5}, {"lo": -0.5, "p": -2.0}, {"!": -1.0, ".": -1.25}],
        "text_offset": [0, 3, 5],
    }
    assert completions().renderer.body("Hello!", DONE)["choices"][0]["logprobs"] is None  # not asked


def test_stream_chunks_carry_their_own_tokens_and_offsets_run_on():
    render = completions(logprobs=1, stream=True).renderer
    first, second = render.token("Hello", [HEL, LO]), render.token("!", [BANG])
    assert first[0].data["choices"][0]["logprobs"]["text_offset"] == [0, 3]
    assert second[0].data["choices"][0]["logprobs"] == {
        "tokens": ["!"], "token_logprobs": [-1.0], "top_logprobs": [{"!": -1.0, ".": -1.25}], "text_offset": [5]
    }  # fmt: skip
    last = render.done(DONE)[0].data["choices"][0]
    assert last["finish_reason"] == "stop" and last["logprobs"] is None


def test_a_chunk_of_held_back_text_has_empty_lists_and_the_offset_counts_token_text():
    take = CompletionLogprobs().take
    assert take([]) == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    logprobs = CompletionLogprobs()
    logprobs.take([LogprobBody("é", -0.1)])
    assert logprobs.take([HEL])["text_offset"] == [1]  # characters, as the choice's text is indexed


def test_alternatives_that_decode_alike_keep_the_likelier_one():
    assert top_dict([("a", -0.1), ("b", -0.5), ("a", -3.0)]) == {"a": -0.1, "b": -0.5}
    assert top_dict([]) == {}
