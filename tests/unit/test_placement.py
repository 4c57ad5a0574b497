"""Placement policies and the edge's placer: the load bound, affinity, and a rebalance of the requests topic."""

from __future__ import annotations

import math
import random

import pytest

from services.edge.kv_index import KVIndex
from services.edge.placement import Candidate, Policy, choose, load_cap, within_bound
from services.edge.placer import InFlight, Placer, worker_views
from shared import wire
from shared.membership import MemberView, Status
from shared.models.cache_salt import CacheSharing
from shared.partition_owners import (
    REQUESTS_ADDRESS,
    format_partitions,
    parse_partitions,
)

C = 1.25


def member(worker_id: str, partitions: str | None, running: int = 0, role: str = "worker") -> MemberView:
    addresses = {} if partitions is None else {REQUESTS_ADDRESS: partitions}
    return MemberView(
        worker_id, role, ("127.0.0.1", 1), addresses, {"running": running, "waiting": 0}, Status.ALIVE, 1, 1
    )


@pytest.mark.parametrize(
    ("loads", "allowed"),
    [
        ([0, 0, 0, 0], {"w0", "w1", "w2", "w3"}),  # cap ceil(1.25 * 1 / 4) = 1
        ([10, 10, 10, 10], {"w0", "w1", "w2", "w3"}),  # cap ceil(1.25 * 41 / 4) = 13
        ([20, 10, 10, 0], {"w1", "w2", "w3"}),  # cap 13: not the one at 20
        ([13, 12, 12, 3], {"w1", "w2", "w3"}),  # cap 13: a 14th chat would take the one at 13 over it
        ([16, 16, 16, 0], {"w3"}),  # cap ceil(1.25 * 49 / 4) = 16 allows only the one at 0
        ([5, 0, 0, 0], {"w1", "w2", "w3"}),  # cap ceil(1.875) = 2
        ([1, 0], {"w0", "w1"}),  # cap ceil(1.25 * 2 / 2) = 2: a nearly idle fleet keeps slack
        ([8, 8], {"w0", "w1"}),
    ],
)
def test_within_bound(loads, allowed):
    candidates = [Candidate(f"w{i}", load) for i, load in enumerate(loads)]
    assert {x.worker for x in within_bound(candidates, C)} == allowed
    assert all(x.load + 1 <= load_cap(candidates, C) for x in within_bound(candidates, C))


def test_where_no_worker_is_under_the_bound_the_least_loaded_take_it():
    # Not reachable from real loads (the least loaded is always under c >= 1 times the mean); a guard.
    candidates = [Candidate("a", 3), Candidate("b", 2)]
    assert [x.worker for x in within_bound(candidates, 0.5)] == ["b"]


def test_each_policy_picks_as_documented():
    candidates = [Candidate("a", 5, cached_blocks=3), Candidate("b", 1), Candidate("c", 2, affine=True)]
    assert choose(Policy.LEAST_LOADED, candidates, "k").worker == "b"
    assert choose(Policy.PREFIX_AFFINITY, candidates, "k").worker == "a"  # most blocks, load ignored
    assert [choose(Policy.ROUND_ROBIN, candidates, "k", turn=t).worker for t in range(4)] == ["a", "b", "c", "a"]
    # Bounded: cap = 1.25 * 9 / 3 = 3.75, so a (5) may not; of b and c, c served the conversation.
    assert choose(Policy.BOUNDED_AFFINITY, candidates, "k", C).worker == "c"
    assert choose(Policy.BOUNDED_AFFINITY, [], "k") is None


def test_a_hot_prefix_never_takes_a_worker_over_the_bound():
    """1,000 questions on one document, all warm on one worker: it fills to the bound, the rest spill."""
    rng = random.Random(7)
    loads = {f"w{i}": 0 for i in range(8)}
    warm = "w3"
    worst = 0.0
    for _ in range(1000):
        candidates = [Candidate(w, load, cached_blocks=20 if w == warm else 0) for w, load in loads.items()]
        chosen = choose(Policy.BOUNDED_AFFINITY, candidates, "doc", C).worker
        loads[chosen] += 1
        mean = sum(loads.values()) / len(loads)
        assert loads[chosen] <= math.ceil(C * mean)  # the bound, rounded up to a whole chat
        worst = max(worst, loads[chosen] / mean) if mean >= 20 else worst
        if rng.random() < 0.5:  # chats finish meanwhile
            busy = [w for w, load in loads.items() if load]
            loads[rng.choice(busy)] -= 1
    assert worst <= C + 1 / 20
    unbounded = {f"w{i}": 0 for i in range(8)}
    for _ in range(100):
        candidates = [Candidate(w, load, cached_blocks=20 if w == warm else 0) for w, load in unbounded.items()]
        unbounded[choose(Policy.PREFIX_AFFINITY, candidates, "doc").worker] += 1
    assert unbounded[warm] == 100  # what the bound prevents


def placer(policy: Policy = Policy.BOUNDED_AFFINITY, tokens=None) -> Placer:
    return Placer(policy, C, CacheSharing(), tokens, KVIndex())


USER = [wire.Message("user", "hi")]


def test_a_conversation_keeps_its_worker_while_the_load_bound_allows():
    p = placer()
    p.members = lambda: [member(f"w{i}", str(i), running=20) for i in range(3)]
    first, _ = p.place("r0", "t", USER, "conv-1", now=0.0)
    kept = 1
    while (worker := p.place(f"r{kept}", "t", USER, "conv-1", now=0.0)[0]) == first:
        kept += 1
    # Each chat placed here adds to the load of its worker (gossip has not seen them yet): 20 + kept
    # chats, kept while 20 + j + 1 <= ceil(1.25 * (60 + j + 1) / 3) for the j-th, that is for 10 chats.
    assert kept == 10
    # Ten seconds on, gossip includes those chats: the conversation stays on the worker of its last turn.
    loads = {first: 30, worker: 21}
    p.members = lambda: [member(f"w{i}", str(i), running=loads.get(f"w{i}", 20)) for i in range(3)]
    assert p.place("later", "t", USER, "conv-1", now=10.0)[0] == worker
    # Another tenant's conversation of the same name is not this one: no affinity, a hash decides.
    others = {p.place(f"o{i}", f"tenant-{i}", USER, "conv-1", now=10.0)[0] for i in range(12)}
    assert len(others) > 1


def test_placement_survives_a_rebalance_of_the_requests_topic():
    p = placer()
    before = [member("w0", "0-3"), member("w1", "4-7")]
    p.members = lambda: before
    worker, partition = p.place("r0", "t", USER, "conv", now=0.0)
    assert partition in (range(0, 4) if worker == "w0" else range(4, 8))
    # A rebalance in progress: the workers published that they own nothing yet; the key's partition.
    p.members = lambda: [member("w0", ""), member("w1", "")]
    assert p.place("r1", "t", USER, "conv", now=0.0) is None
    # w0 left and w1 took all: the conversation follows its partitions to w1.
    p.members = lambda: [member("w1", "0-7")]
    assert p.place("r2", "t", USER, "conv", now=0.0)[0] == "w1"
    # A worker back with a share, and a member gossiping an unreadable assignment: it is left out.
    p.members = lambda: [member("w1", "0-3"), member("w2", "4-7"), member("w3", "x-y"), member("e", "0", role="edge")]
    placed = {p.place(f"s{i}", "t", USER, None, now=0.0) for i in range(40)}
    assert {w for w, _ in placed} == {"w1", "w2"}
    assert all(part in (range(0, 4) if w == "w1" else range(4, 8)) for w, part in placed)


def test_in_flight_counts_until_the_end_is_seen_or_it_expires():
    flights = InFlight(ttl_s=10.0)
    flights.add("a", "w0", 0.0)
    flights.add("b", "w0", 5.0)
    assert flights.count("w0") == 2
    flights.finish("a")
    flights.finish("a")  # seen twice (an edge's own error, then the worker's): counted once
    assert flights.count("w0") == 1
    flights.add("c", "w1", 16.0)  # b placed 11 s ago: no longer counted
    assert (flights.count("w0"), flights.count("w1")) == (0, 1)


def test_the_end_of_a_chat_unloads_its_worker():
    p = placer(Policy.LEAST_LOADED)
    p.members = lambda: [member("w0", "0"), member("w1", "1")]
    first, _ = p.place("r0", "t", USER, None, now=0.0)
    second, _ = p.place("r1", "t", USER, None, now=0.0)
    assert first != second
    p.settled(wire.Done("r0", 3, "stop", wire.Usage(1, 0, 1)))
    assert p.place("r2", "t", USER, None, now=0.0)[0] == first


def test_worker_views_read_partitions_and_load():
    views = worker_views([member("w0", "0-2,5", running=3), member("w1", None), member("w2", "oops")])
    assert list(views) == ["w0"]
    assert views["w0"].partitions == (0, 1, 2, 5) and views["w0"].load == 3.0


@pytest.mark.parametrize(
    ("partitions", "text"), [(set(), ""), ({3}, "3"), ({0, 1, 2, 5}, "0-2,5"), ({7, 9, 8, 1}, "1,7-9")]
)
def test_partition_assignments_round_trip(partitions, text):
    assert format_partitions(partitions) == text
    assert parse_partitions(text) == frozenset(partitions)


@pytest.mark.parametrize("bad", ["a", "3-1", "-1", "0-70000", "1,,x"])
def test_a_malformed_assignment_is_refused(bad):
    with pytest.raises(ValueError):
        parse_partitions(bad)


def test_a_half_published_rebalance_falls_back_to_the_key_partition():
    """w1 says it has 4-7 now, w0's news of 0-3 has not arrived: placing on w1 alone would send it
    every chat. Nor may a stale claim (w1 still "0-7" beside w0's "0-3") be trusted."""
    p = placer()
    p.members = lambda: [member("w0", ""), member("w1", "4-7")]
    assert p.place("r0", "t", USER, None, now=0.0) is None
    p.members = lambda: [member("w0", "0-3"), member("w1", "0-7")]
    assert p.place("r1", "t", USER, None, now=0.0) is None
    p.members = lambda: [member("w0", "0-3"), member("w1", "4-7")]
    assert p.place("r2", "t", USER, None, now=0.0) is not None
