"""Wire <-> engine in one place: every engine word is a wire word, sampling out of range never
reaches an engine, and outputs become seq-numbered events with the codes' own retryability."""

import msgspec
import pytest

from services.worker.convert import engine_request, wire_events
from services.worker.engine import types as engine
from shared import wire
from shared.codes import ErrorCode, FinishReason


def chat(**sampling) -> wire.ChatRequest:
    return wire.ChatRequest("r1", "edge-0", "conn", "tenant", [wire.Message("user", "Hi")], **sampling)


def test_every_engine_word_is_a_wire_word():
    assert {r.value for r in engine.FinishReason} <= {r.value for r in FinishReason}
    assert {c.value for c in engine.FailureCode} <= {c.value for c in ErrorCode}
    assert not any(ErrorCode(c.value).retryable for c in engine.FailureCode)  # a failure alone is final


def test_a_chat_becomes_the_engines_request():
    request = engine_request(chat(max_tokens=5, temperature=0.0, top_p=0.5, seed=7))
    assert (request.request_id, request.tenant) == ("r1", "tenant")
    assert request.messages == (engine.Message("user", "Hi"),)
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed) == (5, 0.0, 0.5, 7)


@pytest.mark.parametrize(
    "sampling, field",
    [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)
def test_sampling_out_of_range_is_refused_on_the_wire_and_by_the_engines_type(sampling, field):
    # The wire schema refuses it when a worker decodes the record...
    with pytest.raises(wire.WireError):
        wire.decode(msgspec.msgpack.encode(chat(**sampling)), wire.ChatRequest)
    # ...and a message built around the schema cannot become an engine request either.
    with pytest.raises(ValueError, match=field):
        engine_request(chat(**sampling))


def test_outputs_become_seq_numbered_events():
    usage = engine.Usage(4, 0, 2)
    assert wire_events(engine.EngineOutput("r", "Hel"), 3) == [wire.Token("r", 3, "Hel")]
    done = wire_events(engine.EngineOutput("r", "lo", engine.FinishReason.LENGTH, usage), 4)
    assert done == [wire.Token("r", 4, "lo"), wire.Done("r", 5, FinishReason.LENGTH, wire.Usage(4, 0, 2))]
    failure = engine.Failure(engine.FailureCode.PROMPT_TOO_LONG, "too long")
    failed = wire_events(engine.EngineOutput("r", failure=failure), 0)
    assert failed == [wire.Error("r", 0, ErrorCode.PROMPT_TOO_LONG, "too long", False)]
    assert wire_events(engine.EngineOutput("r"), 9) == []
