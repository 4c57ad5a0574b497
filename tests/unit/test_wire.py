"""Internal wire messages: round trips, clear errors for anything malformed, and readable by any msgpack reader."""

import msgpack
import msgspec
import pytest

from shared import wire
from shared.codes import ErrorCode, FinishReason


def test_round_trips():
    request = wire.ChatRequest("r1", "edge-0", "c", "dev", [wire.Message("user", "hi")], seed=4)
    assert wire.decode(wire.encode(request), wire.ChatRequest) == request
    batch = wire.TokenBatch("edge-0", "w", [wire.Token("r1", 0, "a"), wire.Done("r1", 1, "stop", wire.Usage(1, 0, 1))])
    assert wire.decode(wire.encode(batch), wire.TokenBatch) == batch


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1garbage",
        msgspec.msgpack.encode({"type": "chat"}),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "cancel", "request_ids": ["x"]}),
    ],
)
def test_malformed_payloads_raise_wire_error(payload):
    with pytest.raises(wire.WireError):
        wire.decode(payload, wire.ChatRequest)


def test_future_version_is_refused():
    data = wire.encode(wire.Cancel(["r"], v=99))
    with pytest.raises(wire.WireError, match="version"):
        wire.decode(data, wire.Cancel)


@pytest.mark.parametrize("payload", [None, b"", "a str", 42])
def test_a_null_empty_or_foreign_record_is_a_wire_error(payload):
    # A Kafka record's value may be None (a tombstone) or empty: neither may crash a consumer.
    with pytest.raises(wire.WireError):
        wire.decode(payload, wire.TokenBatch)


def test_unknown_words_are_refused_by_the_schema():
    good = wire.TokenBatch("e", "w", [wire.Error.of("r", ErrorCode.WORKER_LOST, "gone")])
    assert wire.decode(wire.encode(good), wire.TokenBatch) == good
    with pytest.raises(wire.WireError):  # an error code no part of the system knows
        wire.decode(wire.encode(good).replace(b"worker_lost", b"worker_lose"), wire.TokenBatch)
    done = wire.encode(wire.TokenBatch("e", "w", [wire.Done("r", 0, FinishReason.STOP, wire.Usage(1, 0, 0))]))
    with pytest.raises(wire.WireError):
        wire.decode(done.replace(b"stop", b"stap"), wire.TokenBatch)


def test_the_reference_msgpack_reader_decodes_every_message():
    """Any msgpack reader, in any language, can consume our topics: the plain `msgpack` package
    reads each message to the same fields, tags and versions, with no help from our types."""
    request = wire.ChatRequest("r1", "edge-0", "c", "dev", [wire.Message("user", "hi")], max_tokens=5, seed=4)
    decoded = msgpack.unpackb(wire.encode(request))
    assert decoded["type"] == "chat" and decoded["v"] == wire.WIRE_VERSION
    assert decoded["messages"] == [{"role": "user", "content": "hi"}] and decoded["max_tokens"] == 5
    batch = wire.TokenBatch("edge-0", "w", [
        wire.Started("r1", wire.OUT_OF_BAND, "w"),
        wire.Token("r1", 0, "Hel"),
        wire.Done("r1", 1, FinishReason.STOP, wire.Usage(3, 0, 1)),
        wire.Error.of("r2", ErrorCode.WORKER_LOST, "gone"),
    ], epochs={"r1": 2})
    tokens = msgpack.unpackb(wire.encode(batch))
    assert tokens["type"] == "tokens" and tokens["epochs"] == {"r1": 2}
    assert tokens["events"] == [
        ["started", "r1", -1, "w"],
        ["token", "r1", 0, "Hel"],
        ["done", "r1", 1, "stop", [3, 0, 1]],
        ["error", "r2", -1, "worker_lost", "gone", True],
    ]
    for message in (wire.Cancel(["r1"], 3), wire.Resume("r1", 1, "edge-1", "c2", 7)):
        assert msgpack.unpackb(wire.encode(message))["v"] == wire.WIRE_VERSION
