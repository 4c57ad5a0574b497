"""The client protocol's parser: every bad frame gets its own clear code."""

import json

import pytest

from services.edge.protocol import (
    CancelFrame,
    ChatFrame,
    ProtocolError,
    encode_frame,
    event_frame,
    parse_client_frame,
)
from shared import wire


def chat(**fields):
    return json.dumps({"type": "chat", "id": "c1", "messages": [{"role": "user", "content": "Hi"}], **fields})


def error_of(text):
    with pytest.raises(ProtocolError) as info:
        parse_client_frame(text)
    return info.value


def test_minimal_chat_gets_defaults():
    frame = parse_client_frame(chat())
    assert isinstance(frame, ChatFrame)
    assert (frame.max_tokens, frame.temperature, frame.top_p, frame.seed) == (256, 0.7, 1.0, None)


def test_full_chat_and_cancel():
    frame = parse_client_frame(chat(max_tokens=5, temperature=0, top_p=0.5, seed=3, conversation=None))
    assert (frame.max_tokens, frame.temperature, frame.top_p, frame.seed) == (5, 0, 0.5, 3)
    assert parse_client_frame('{"type":"cancel","id":"c9"}') == CancelFrame("cancel", "c9")


@pytest.mark.parametrize(
    "text, code, chat_id",
    [
        ("{not json", "invalid_json", None),
        ("[1, 2]", "invalid_message", None),
        ('{"type":"shout","id":"c1"}', "unknown_type", "c1"),
        ('{"id":"c1"}', "unknown_type", "c1"),
        ('{"type":"chat","id":"c1"}', "invalid_message", "c1"),
        ('{"type":"chat","messages":[{"role":"user","content":"x"}]}', "invalid_message", None),
        (chat(messages=[]), "invalid_message", "c1"),
        (chat(messages=[{"role": "robot", "content": "x"}]), "invalid_message", "c1"),
        (chat(max_tokens=0), "invalid_message", "c1"),
        (chat(temperature=-0.1), "invalid_message", "c1"),
        (chat(top_p=0), "invalid_message", "c1"),
        (chat(top_p=1.5), "invalid_message", "c1"),
        (chat(colour="blue"), "invalid_message", "c1"),
        # An id no chat could have is not echoed: the error would mirror whatever was sent.
        ('{"type":"chat","id":"","messages":[{"role":"user","content":"x"}]}', "invalid_message", None),
        (chat(id="x" * 129), "invalid_message", None),
        (chat(id="x" * 128, max_tokens=0), "invalid_message", "x" * 128),
        ('{"type":"chat","id":7,"messages":[{"role":"user","content":"x"}]}', "invalid_message", None),
    ],
)
def test_bad_frames(text, code, chat_id):
    error = error_of(text)
    assert error.code == code
    assert error.chat_id == chat_id
    assert error.message


def test_an_error_frame_stays_small_whatever_the_frame_it_answers():
    """A 100 kB id, type or role comes back as a bounded error, not as itself."""
    huge = "y" * 100_000
    huge_role = chat(messages=[{"role": huge, "content": "x"}])
    for frame in (chat(id=huge), json.dumps({"type": huge, "id": "c1"}), huge_role):
        error = error_of(frame)
        assert len(encode_frame(error.frame())) < 1_200, error.message[:80]
    assert error_of(json.dumps({"type": huge, "id": "c1"})).message.endswith("expected one of: chat, cancel, resume")


def test_unknown_field_is_named():
    assert "colour" in error_of(chat(colour="blue")).message


def sent(event):
    """The JSON a client receives for a token-path event."""
    return json.loads(encode_frame(event_frame("c1", event)))


def test_event_frames():
    assert sent(wire.Token("r", 3, "Hel")) == {"type": "token", "id": "c1", "seq": 3, "text": "Hel"}
    done = sent(wire.Done("r", 4, "stop", wire.Usage(5, 2, 4)))
    assert done == {
        "type": "done",
        "id": "c1",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 5, "cached_tokens": 2, "completion_tokens": 4},
    }
    error = sent(wire.Error("r", 0, "worker_lost", "gone", True))
    assert error == {"type": "error", "id": "c1", "code": "worker_lost", "message": "gone", "retryable": True}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [900, 1000, 5000, 200_000])
def test_deep_nesting_is_invalid_json_or_message_never_a_recursion_error(depth):
    assert error_of(nested(depth)).code in ("invalid_json", "invalid_message")
    in_a_field = chat()[:-1] + ', "conversation": ' + nested(depth) + "}"
    assert error_of(in_a_field).code in ("invalid_json", "invalid_message")


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 10**30},
        {"max_tokens": 2**31},
        {"seed": 2**70},
        {"seed": 2**63},
        {"seed": -(2**63) - 1},
    ],
)
def test_integers_the_wire_cannot_carry_are_invalid_messages(fields):
    error = error_of(chat(**fields))
    assert (error.code, error.chat_id) == ("invalid_message", "c1")


@pytest.mark.parametrize("fields", [{"max_tokens": 2**31 - 1}, {"seed": 2**63 - 1}, {"seed": -(2**63)}])
def test_integers_at_the_edge_of_their_range_reach_the_wire(fields):
    frame = parse_client_frame(chat(**fields))
    request = wire.ChatRequest("r", "e", "c", "t", [wire.Message("user", "Hi")], max_tokens=frame.max_tokens, seed=frame.seed)
    assert wire.decode(wire.encode(request), wire.ChatRequest) == request


@pytest.mark.parametrize("last_seq", [2**64, 2**31, -2])
def test_resume_point_outside_any_stream_is_invalid(last_seq):
    text = json.dumps({"type": "resume", "id": "c1", "request_id": "r", "resume_token": "t", "last_seq": last_seq})
    error = error_of(text)
    assert (error.code, error.chat_id) == ("invalid_message", "c1")


def test_sampling_controls_travel_to_the_wire_and_through_it():
    frame = parse_client_frame(chat(
        top_k=5, stop=["END"], stop_token_ids=[2], ignore_eos=True, min_tokens=3, frequency_penalty=0.5,
        presence_penalty=-1, repetition_penalty=1.2, logit_bias={"42": 100, "7": -100},
    ))  # fmt: skip
    controls = frame.controls()
    assert controls.logit_bias == {42: 100.0, 7: -100.0} and controls.stop == ["END"] and controls.min_tokens == 3
    request = wire.ChatRequest("r", "e", "c", "t", [wire.Message("user", "Hi")], controls=controls)
    assert wire.decode(wire.encode(request), wire.ChatRequest).controls == controls
    assert parse_client_frame(chat()).controls() == wire.Controls()


@pytest.mark.parametrize(
    "fields",
    [{"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repetition_penalty": 0}, {"logit_bias": {"x": 1}},
     {"logit_bias": {"1": 101}}, {"stop": [""]}, {"stop": ["a"] * 17}, {"top_k": -1}, {"min_tokens": -1},
     {"stop_token_ids": [-1]}, {"ignore_eos": "yes"}],
)  # fmt: skip
def test_sampling_controls_out_of_range_are_invalid_messages(fields):
    error = error_of(chat(**fields))
    assert (error.code, error.chat_id) == ("invalid_message", "c1")


def test_logprobs_are_asked_for_on_the_chat_and_come_back_on_its_tokens():
    assert parse_client_frame(chat(logprobs=3)).controls().logprobs == 3
    assert error_of(chat(logprobs=21)).code == "invalid_message"
    event = wire.LoggedToken("r", 0, "Hi", [wire.Logprob("Hi", -0.25, [("Hi", -0.25), ("Ho", -1.5)])])
    batch = wire.TokenBatch("e", "w", [event])
    (decoded,) = wire.decode(wire.encode(batch), wire.TokenBatch).events
    frame = json.loads(encode_frame(event_frame("c1", decoded)))
    assert frame["logprobs"] == [{"token": "Hi", "logprob": -0.25, "top_logprobs": [["Hi", -0.25], ["Ho", -1.5]]}]
    assert "logprobs" not in json.loads(encode_frame(event_frame("c1", wire.Token("r", 1, "x"))))  # v1 frames unchanged
