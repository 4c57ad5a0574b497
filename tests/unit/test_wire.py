"""Internal wire messages: round trips, and clear errors for anything malformed."""

import msgspec
import pytest

from shared import wire


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
