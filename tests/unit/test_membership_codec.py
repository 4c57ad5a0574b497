"""Membership wire: signed packets round-trip; every kind of bad datagram is dropped, counted and never raised."""

import msgspec
import pytest

from shared.membership.codec import Codec, Drop, encode_any, encode_frame
from shared.membership.member import Status
from shared.membership.messages import (
    PROTOCOL_VERSION,
    Ack,
    Alive,
    Envelope,
    Gossip,
    MembersRequest,
    MembersResponse,
    Ping,
    Sync,
    decode_record,
    decode_update,
    encode,
)
from shared.membership.node import Node
from shared.membership.replay import ReplayGuard
from shared.membership.settings import MembershipSettings
from shared.membership.table import member_hash

CONFIG = MembershipSettings()
PEER = ("10.0.0.2", 7946)
NOW = 1_000.0


def make_node():
    return Node(CONFIG, "me", "edge", ("10.0.0.1", 7946), now=NOW)


def sealed(body, seq=1, ts=NOW, sender="peer", codec=None):
    return (codec or Codec(CONFIG.cluster_name, CONFIG.secret_bytes)).seal(sender, seq, ts, body)


def alive_blob(member="peer", inc=0):
    return encode(Alive(member, inc, "worker", PEER[0], PEER[1], {"internal": "10.0.0.2:9000"}, {"running": 3}, 7))


def test_good_packet_round_trips_and_is_acted_on():
    node = make_node()
    view = member_hash("me") ^ member_hash("peer")  # the sender counts the same two members active
    out = node.on_packet(sealed(Ping(5, "me", view, [alive_blob()])), PEER, NOW)
    assert node.member("peer").load == {"running": 3}
    [reply] = out
    assert reply.address == PEER
    envelope = Codec(CONFIG.cluster_name, CONFIG.secret_bytes).open(reply.data)
    assert isinstance(envelope, Envelope) and envelope.sender == "me"
    assert isinstance(envelope.body, Ack) and envelope.body.probe == 5
    assert not node.drops


def bodies(out):
    codec = Codec(CONFIG.cluster_name, CONFIG.secret_bytes)
    return [codec.open(o.data).body for o in out]


def test_ping_for_another_member_is_not_acked():
    node = make_node()
    out = node.on_packet(sealed(Ping(5, "someone-else", 0, [alive_blob()])), PEER, NOW)
    assert out == [] and node.member("peer") is not None


def test_a_stranger_talking_to_us_triggers_a_state_swap():
    node = make_node()
    out = bodies(node.on_packet(sealed(Ping(5, "me", 0, [])), PEER, NOW))
    assert sorted(type(b).__name__ for b in out) == ["Ack", "Sync"]
    assert all(b.request for b in out if isinstance(b, Sync))
    out = node.on_packet(sealed(Ping(6, "me", 0, []), seq=2), PEER, NOW + 0.01)
    assert [type(b) for b in bodies(out)] == [Ack]  # once per resync_interval, not per packet


def test_a_pinger_with_a_different_view_triggers_a_state_swap():
    node = make_node()
    node.on_packet(sealed(Gossip([alive_blob()])), PEER, NOW)
    same = member_hash("me") ^ member_hash("peer")
    assert [type(b) for b in bodies(node.on_packet(sealed(Ping(1, "me", same, []), seq=2), PEER, NOW))] == [Ack]
    out = bodies(node.on_packet(sealed(Ping(2, "me", same ^ 1, []), seq=3), PEER, NOW))
    assert sorted(type(b).__name__ for b in out) == ["Ack", "Sync"]


def payload_of(body, cluster=CONFIG.cluster_name):
    return encode(Envelope(cluster, "peer", 1, NOW, body))


def bad_datagrams():
    codec = Codec(CONFIG.cluster_name, CONFIG.secret_bytes)
    good = sealed(Gossip([alive_blob()]))
    payload = payload_of(Gossip([]))
    return [
        ("unsigned", encode_frame(PROTOCOL_VERSION, payload, None), Drop.UNSIGNED),
        ("empty mac", encode_frame(PROTOCOL_VERSION, payload, b""), Drop.UNSIGNED),
        ("other secret", sealed(Gossip([]), codec=Codec(CONFIG.cluster_name, b"not-ours")), Drop.BAD_SIGNATURE),
        ("tampered", good.replace(b"running", b"runnimg"), Drop.BAD_SIGNATURE),
        ("truncated", good[: len(good) // 2], Drop.UNDECODABLE),
        ("garbage", b"\xc1\xff\x00garbage", Drop.UNDECODABLE),
        ("empty", b"", Drop.UNDECODABLE),
        ("not a frame", encode_any({"hello": 1}), Drop.UNDECODABLE),
        ("future version", encode_frame(PROTOCOL_VERSION + 1, payload, codec.mac(PROTOCOL_VERSION + 1, payload)),
         Drop.WRONG_VERSION),
        ("signed nonsense", encode_frame(PROTOCOL_VERSION, b"\x93\x01", codec.mac(PROTOCOL_VERSION, b"\x93\x01")),
         Drop.UNDECODABLE),
        ("other cluster", encode_frame(PROTOCOL_VERSION, payload_of(Gossip([]), "blue"),
                                       codec.mac(PROTOCOL_VERSION, payload_of(Gossip([]), "blue"))),
         Drop.UNKNOWN_CLUSTER),
        ("stale timestamp", sealed(Gossip([]), ts=NOW - CONFIG.replay_window - 1), Drop.REPLAYED),
        ("future timestamp", sealed(Gossip([]), ts=NOW + CONFIG.replay_window + 1), Drop.REPLAYED),
    ]


@pytest.mark.parametrize("name, data, reason", bad_datagrams(), ids=[d[0] for d in bad_datagrams()])
def test_bad_datagram_is_dropped_and_counted(name, data, reason):
    node = make_node()
    assert node.on_packet(data, PEER, NOW) == []
    assert node.drops == {reason: 1}
    assert node.member("peer") is None


def test_replayed_sequence_number_is_dropped():
    node = make_node()
    first = sealed(Gossip([alive_blob()]), seq=10)
    node.on_packet(first, PEER, NOW)
    node.on_packet(first, PEER, NOW + 0.1)
    node.on_packet(sealed(Gossip([]), seq=10), PEER, NOW + 0.1)  # a new packet reusing a number
    assert node.drops == {Drop.REPLAYED: 2}


def test_replay_window_accepts_reordering_but_not_repeats_or_ancient_numbers():
    guard = ReplayGuard(window_s=30.0)
    assert guard.accept("a", 100, 0.0, 0.0)
    assert guard.accept("a", 103, 0.0, 0.0)
    assert guard.accept("a", 101, 0.0, 0.0)  # overtaken, still fresh
    assert not guard.accept("a", 101, 0.0, 0.0)
    assert not guard.accept("a", 100, 0.0, 0.0)
    assert guard.accept("a", 500, 0.0, 0.0)
    assert not guard.accept("a", 400, 0.0, 0.0)  # fell out of the 64-number window
    assert guard.accept("b", 1, 0.0, 0.0)  # senders are independent
    guard.prune(now=61.0)
    assert len(guard) == 0


def test_one_bad_update_is_counted_and_the_rest_still_applied():
    node = make_node()
    broken = [b"\xc1", encode_any(["a", "x"]), encode_any(["s", "peer", -1, "x"])]
    node.on_packet(sealed(Gossip(broken + [alive_blob()])), PEER, NOW)
    assert node.drops == {Drop.BAD_UPDATE: 3}
    assert node.member("peer").status is Status.ALIVE


def test_datagrams_stay_under_the_size_limit_however_much_is_pending():
    node = make_node()
    blobs = [alive_blob(f"peer-{i:03d}") for i in range(200)]
    node.on_packet(sealed(Gossip(blobs[:100])), PEER, NOW)
    node.on_packet(sealed(Gossip(blobs[100:]), seq=2), PEER, NOW)
    assert node.pending_broadcasts() == 200
    out = node.on_packet(sealed(Ping(1, "me", 0, []), seq=3), PEER, NOW)
    assert CONFIG.max_packet_size - 100 < len(out[0].data) <= CONFIG.max_packet_size
    sync = node.on_packet(sealed(Sync(True, []), seq=4), PEER, NOW)
    assert len(sync) > 1 and all(len(o.data) <= CONFIG.max_packet_size for o in sync)
    codec = Codec(CONFIG.cluster_name, CONFIG.secret_bytes)
    states = [decode_record(b) for o in sync for b in codec.open(o.data).body.states]
    assert {r.member for r in states} == {"me"} | {f"peer-{i:03d}" for i in range(200)}


def test_members_request_is_answered_in_numbered_chunks():
    node = make_node()
    node.on_packet(sealed(Gossip([alive_blob(f"peer-{i}") for i in range(40)])), PEER, NOW)
    out = node.on_packet(sealed(MembersRequest(99), seq=2, sender="query-1"), PEER, NOW)
    codec = Codec(CONFIG.cluster_name, CONFIG.secret_bytes)
    bodies = [codec.open(o.data).body for o in out]
    assert all(isinstance(b, MembersResponse) and b.request_id == 99 for b in bodies)
    assert [b.index for b in bodies] == list(range(len(bodies))) and {b.total for b in bodies} == {len(bodies)}
    assert sum(len(b.states) for b in bodies) == 41


def test_updates_reject_out_of_range_fields():
    with pytest.raises(msgspec.ValidationError):
        decode_update(encode_any(["a", "x", 0, "worker", "h", 70000, {}, {}, 1]))
    with pytest.raises(msgspec.ValidationError):
        decode_update(encode_any(["a", "", 0, "worker", "h", 1, {}, {}, 1]))
