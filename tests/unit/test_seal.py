"""Sealed Kafka records: only a holder of the fleet secret can write one, for one topic, as itself."""

import msgspec
import pytest

from shared import wire
from shared.seal import Seal

SECRET = b"fleet secret"
BATCH = wire.TokenBatch("edge-0", "worker-a", [wire.Token("r1", 0, "hi")])


def test_a_sealed_message_opens_with_its_sender():
    data = Seal(SECRET, "worker-a").encode("tokens", BATCH)
    assert Seal(SECRET, "router-0").decode("tokens", data, wire.TokenBatch) == ("worker-a", BATCH)


@pytest.mark.parametrize(
    "data",
    [
        None, b"", b"\xc1", wire.encode(BATCH),  # null, empty, garbage, and a bare unsealed message
        Seal(b"another secret", "worker-a").encode("tokens", BATCH),
        Seal(SECRET, "worker-a").encode("control", BATCH),  # sealed for another topic
    ],
    ids=["null", "empty", "garbage", "unsealed", "wrong secret", "wrong topic"],
)
def test_anything_not_sealed_for_this_topic_by_the_fleet_is_refused(data):
    with pytest.raises(wire.WireError):
        Seal(SECRET, "router-0").decode("tokens", data, wire.TokenBatch)


def test_a_member_cannot_speak_for_another():
    # A worker (or a stolen secret's holder posing as one) sealing a batch in another worker's name.
    data = Seal(SECRET, "worker-b").encode("tokens", BATCH)
    with pytest.raises(wire.WireError, match="claims to be from 'worker-a'"):
        Seal(SECRET, "router-0").decode("tokens", data, wire.TokenBatch)
    chat = wire.ChatRequest("r", "edge-0", "c", "t", [wire.Message("user", "x")])
    with pytest.raises(wire.WireError, match="claims"):
        Seal(SECRET, "w").decode("requests", Seal(SECRET, "edge-1").encode("requests", chat), wire.ChatRequest)


def test_a_tampered_body_or_sender_is_refused():
    sealed = msgspec.msgpack.decode(Seal(SECRET, "worker-a").encode("tokens", BATCH))
    body = wire.encode(wire.TokenBatch("edge-0", "worker-a", [wire.Token("r1", 0, "forged")]))
    for forged in ([sealed[0], body, sealed[2]], ["worker-b", sealed[1], sealed[2]]):
        with pytest.raises(wire.WireError, match="bad seal"):
            Seal(SECRET, "router-0").open("tokens", msgspec.msgpack.encode(forged))


def test_no_secret_no_seal():
    with pytest.raises(ValueError, match="fleet secret"):
        Seal(b"", "edge-0")
