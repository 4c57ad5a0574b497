"""The echo model: word pieces that concatenate to the message exactly."""

import pytest

from services.worker.echo import EchoEngine
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.types import EngineRequest, Message, RequestRejected
from shared.models.echo import CONTEXT_PIECES, split_pieces


@pytest.mark.parametrize(
    "text, pieces",
    [
        ("Hello there world", ["Hello ", "there ", "world"]),
        ("  lead and trail  ", ["  lead ", "and ", "trail  "]),
        ("line\nbreak\t tab", ["line\n", "break\t ", "tab"]),
        ("   ", ["   "]),
        ("", []),
        ("日本語 テキスト", ["日本語 ", "テキスト"]),
    ],
)
def test_split_pieces(text, pieces):
    assert split_pieces(text) == pieces
    assert "".join(split_pieces(text)) == text


def request(text, max_tokens=256, rid="r1"):
    return EngineRequest(rid, "t", [Message("user", text)], SamplingParams(max_tokens=max_tokens))


def run(engine):
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_reply_streams_then_stops_with_usage():
    engine = EchoEngine()
    engine.add_request(request("a b c"))
    outputs = run(engine)
    assert [o.text for o in outputs] == ["a ", "b ", "c"]
    assert outputs[-1].finish_reason == "stop"
    assert (outputs[-1].usage.prompt_tokens, outputs[-1].usage.completion_tokens) == (3, 3)


def test_max_tokens_cuts_with_length():
    engine = EchoEngine()
    engine.add_request(request("a b c d", max_tokens=2))
    outputs = run(engine)
    assert "".join(o.text for o in outputs) == "a b "
    assert outputs[-1].finish_reason == "length"


def test_abort_frees_and_reports_cancelled():
    engine = EchoEngine()
    engine.add_request(request("a b c d"))
    engine.step()
    final = engine.abort_request("r1")
    assert final.finish_reason == "cancelled" and final.usage.completion_tokens == 1
    assert not engine.has_unfinished_requests()
    assert engine.abort_request("r1") is None


def test_prompt_longer_than_context_is_rejected():
    with pytest.raises(RequestRejected) as info:
        EchoEngine().add_request(request("w " * (CONTEXT_PIECES + 1)))
    assert info.value.failure.code == "prompt_too_long"


def test_starts_are_announced_once_before_the_first_piece():
    engine = EchoEngine()
    announced = []
    engine.start_listener = lambda ids: announced.append((list(ids), engine.has_unfinished_requests()))
    engine.add_request(request("a b", rid="r1"))
    engine.step()
    engine.add_request(request("c", rid="r2"))
    run(engine)
    assert announced == [(["r1"], True), (["r2"], True)]
