"""Whom a prefill worker offers a request to: the least loaded decode workers first, among those
about as free the one the prompt's first block points at (the same one for the same prefix), and
a member whose gossip does not parse is left out rather than trusted."""

from __future__ import annotations

from services.worker.decoder_choice import (
    KV_ADDRESS,
    LOAD_SLACK,
    Decoder,
    decoder_order,
    decoders_of,
)
from shared.membership.member import MemberView, Status


def member(member_id: str, kv: str | None, load: dict, role: str = "worker") -> MemberView:
    addresses = {KV_ADDRESS: kv} if kv is not None else {}
    return MemberView(member_id, role, ("127.0.0.1", 7946), addresses, load, Status.ALIVE, 1, 1)


def test_only_parseable_decode_workers_count_and_in_flight_handoffs_add_to_their_load() -> None:
    members = [
        member("d1", "127.0.0.1:9300", {"running": 3, "waiting": 1}),
        member("d2", "host-b:9301", {"running": 0}),
        member("prefill", None, {"running": 9}),  # no KV link: not a decode worker
        member("bad-address", "nowhere", {"running": 0}),
        member("bad-load", "127.0.0.1:9302", {"running": "many"}),
        member("nan-load", "127.0.0.1:9303", {"running": float("nan")}),
        member("an-edge", "127.0.0.1:9304", {}, role="edge"),
    ]
    decoders = decoders_of(members, {"d2": 2})
    assert decoders == [Decoder("d1", ("127.0.0.1", 9300), 4.0), Decoder("d2", ("host-b", 9301), 2.0)]


def test_the_least_loaded_come_first_and_a_prefix_picks_the_same_one_among_equals() -> None:
    equals = [Decoder(f"d{i}", ("h", 9300 + i), 1.0) for i in range(4)]
    busy = Decoder("busy", ("h", 9400), 1.0 + LOAD_SLACK + 1)
    busier = Decoder("busier", ("h", 9401), 1.0 + LOAD_SLACK + 5)
    order = decoder_order([busier, *equals, busy], [1, 2, 3])
    assert order[-2:] == [busy, busier] and set(order[:4]) == set(equals)
    assert decoder_order([*reversed(equals), busy, busier], [1, 2, 3]) == order  # the input's order does not matter
    firsts = {decoder_order(equals, [n, n + 1])[0].worker_id for n in range(40)}
    assert len(firsts) > 1  # different prefixes spread over the equals
    assert decoder_order([], [1]) == []
