"""Membership state transitions: SWIM precedence, suspicion and refutation, incarnations, the broadcast queue."""

import pytest

from shared.membership.awareness import Awareness
from shared.membership.broadcast import BroadcastQueue
from shared.membership.member import MemberState, Status, supersedes
from shared.membership.messages import (
    Alive,
    Dead,
    Left,
    StateRecord,
    Suspect,
    decode_update,
    encode,
)
from shared.membership.settings import MembershipSettings
from shared.membership.table import MemberTable
from shared.membership.timing import expected_confirmations

A, S, D, L = Status.ALIVE, Status.SUSPECT, Status.DEAD, Status.LEFT


@pytest.mark.parametrize(
    "new, new_inc, old, old_inc, wins",
    [
        (S, 1, A, 1, True),  # alive < suspect at one incarnation
        (D, 1, S, 1, True),
        (D, 1, A, 1, True),
        (L, 1, D, 1, True),  # the member's own goodbye outranks a verdict
        (A, 1, S, 1, False),  # alive cannot undo a suspicion at the same incarnation...
        (A, 2, S, 1, True),  # ...only a refutation with a higher one can
        (A, 1, D, 1, False),  # dead is final for its incarnation
        (S, 1, D, 1, False),
        (A, 2, D, 1, True),  # a rejoin
        (D, 1, A, 2, False),  # stale news loses
        (S, 1, S, 1, False),
        (A, 1, A, 1, False),
    ],
)
def test_precedence(new, new_inc, old, old_inc, wins):
    assert supersedes(new, new_inc, old, old_inc) is wins


def alive(member, inc=0, **changes):
    fields = {"role": "worker", "host": "10.0.0.9", "port": 7946, "addresses": {}, "load": {}, "pid": 1} | changes
    return Alive(member, inc, **fields)


def make_table(others=("b", "c", "d", "e", "f")):
    me = MemberState("me", "edge", "10.0.0.1", 7946)
    # suspicion_mult 4 wants two confirmations (mult - 2), so shrinking can be watched step by step.
    table = MemberTable(me, MembershipSettings(suspicion_mult=4), Awareness(8), BroadcastQueue())
    for member in others:
        assert table.apply_alive(alive(member), now=0.0)
    table.events.clear()
    return table


def test_newcomer_is_added_queued_for_gossip_and_reported():
    table = make_table(others=())
    assert table.apply_alive(alive("b", 3, load={"running": 2}), now=1.0)
    assert table.get("b").status is A and table.get("b").load == {"running": 2}
    assert decode_update(table.broadcasts.pending("b")) == alive("b", 3, load={"running": 2})
    [event] = table.events
    assert (event.member.id, event.old_status, event.new_status) == ("b", None, A)
    assert table.joined == ["b"]
    assert not table.apply_alive(alive("b", 3), now=2.0)  # same incarnation: nothing new


def test_suspect_then_same_incarnation_alive_is_ignored_then_refutation_wins():
    table = make_table()
    assert table.apply_suspect(Suspect("b", 0, "c"), now=1.0)
    assert table.get("b").status is S and "b" in table.suspicions
    assert not table.apply_alive(alive("b", 0), now=1.5)
    assert table.get("b").status is S
    assert table.apply_alive(alive("b", 1), now=2.0)
    assert table.get("b").status is A and "b" not in table.suspicions
    assert [(e.old_status, e.new_status) for e in table.events] == [(A, S), (S, A)]


def test_suspicion_expires_into_dead_and_dead_is_final_for_that_incarnation():
    table = make_table()
    table.apply_suspect(Suspect("b", 0, "c"), now=1.0)
    deadline = table.suspicions["b"].deadline
    table.expire_suspicions(deadline - 0.01)
    assert table.get("b").status is S
    table.expire_suspicions(deadline)
    assert table.get("b").status is D
    assert decode_update(table.broadcasts.pending("b")) == Dead("b", 0, "me")
    assert not table.apply_alive(alive("b", 0), now=deadline + 1)
    assert not table.apply_suspect(Suspect("b", 0, "c"), now=deadline + 1)
    assert table.apply_alive(alive("b", 1), now=deadline + 2)  # it came back
    assert table.get("b").status is A


def test_confirmations_from_distinct_members_shrink_suspicion_and_are_regossiped():
    table = make_table()
    table.apply_suspect(Suspect("b", 0, "c"), now=0.0)
    timer = table.suspicions["b"]
    unconfirmed = timer.deadline
    assert timer.expected == expected_confirmations(4, 6) == 2
    assert not table.apply_suspect(Suspect("b", 0, "c"), now=0.1)  # the same accuser again
    assert table.apply_suspect(Suspect("b", 0, "d"), now=0.1)
    assert decode_update(table.broadcasts.pending("b")) == Suspect("b", 0, "d")
    assert table.apply_suspect(Suspect("b", 0, "e"), now=0.2)
    assert timer.deadline == pytest.approx(timer.shortest) and timer.deadline < unconfirmed


def test_suspected_member_refutes_with_a_higher_incarnation_and_loses_health():
    table = make_table()
    table.me.incarnation = 4
    assert not table.apply_suspect(Suspect("me", 3, "b"), now=1.0)  # about an old incarnation
    assert table.apply_suspect(Suspect("me", 4, "b"), now=1.0)
    assert table.me.incarnation == 5 and table.me.status is A
    assert decode_update(table.broadcasts.pending("me")).incarnation == 5
    assert table.awareness.score == 1 and table.refutations == 1
    assert table.apply(Dead("me", 7, "c"), now=2.0)  # even a death notice is refuted
    assert table.me.incarnation == 8 and table.me.status is A


def test_alive_about_ourselves_from_an_earlier_life_is_overruled():
    table = make_table()
    assert table.apply_alive(alive("me", 9, pid=77), now=1.0)
    assert table.me.incarnation == 10
    assert not table.apply_alive(table.self_alive(), now=1.0)  # our own news echoed back


def test_left_outranks_dead_and_leaving_member_does_not_refute():
    table = make_table()
    table.apply(Dead("b", 0, "c"), now=1.0)
    assert table.apply(Left("b", 0), now=1.1)
    assert table.get("b").status is L
    assert not table.apply(Dead("b", 0, "d"), now=1.2)
    table.leave(now=2.0)
    assert table.me.status is L and table.num_active() == 4  # c, d, e, f
    assert not table.apply_suspect(Suspect("me", 0, "c"), now=2.1)
    assert table.me.status is L


def test_push_pull_dead_record_only_makes_us_suspect():
    table = make_table()
    record = StateRecord("b", 0, D, "worker", "10.0.0.9", 7946, {}, {}, 1)
    assert table.merge_record(record, "c", now=1.0)
    assert table.get("b").status is S


def test_stale_accusation_gets_a_correction_from_a_member_that_knows_better():
    table = make_table()
    table.apply_alive(alive("b", 3), now=1.0)
    assert not table.apply_suspect(Suspect("b", 2, "c"), now=1.1)
    assert decode_update(table.correction(Suspect("b", 2, "c"))) == alive("b", 3)
    assert table.correction(Suspect("b", 3, "c")) is None


def test_num_active_tracks_status_changes():
    table = make_table()
    assert table.num_active() == 6
    table.apply(Dead("b", 0, "c"), now=1.0)
    table.apply_suspect(Suspect("c", 0, "d"), now=1.0)
    assert table.num_active() == 5
    table.apply_alive(alive("b", 1), now=2.0)
    assert table.num_active() == 6


def test_gone_members_are_pruned_after_retention():
    table = make_table()
    table.apply(Dead("b", 0, "c"), now=1.0)
    table.prune(now=1.0 + table.config.dead_retention - 0.1)
    assert table.get("b") is not None
    table.prune(now=1.0 + table.config.dead_retention + 0.1)
    assert table.get("b") is None


def test_broadcast_queue_sends_fewest_sent_first_and_retires_at_the_limit():
    queue = BroadcastQueue()
    queue.queue("a", b"A" * 10)
    queue.queue("b", b"B" * 10)
    assert queue.take(budget=12, limit=2) == [b"B" * 10]  # newest first among equals
    assert queue.take(budget=12, limit=2) == [b"A" * 10]  # then the one sent fewer times
    assert queue.take(budget=100, limit=2) == [b"B" * 10, b"A" * 10]
    assert len(queue) == 0


def test_broadcast_queue_keeps_only_the_newest_update_per_member():
    queue = BroadcastQueue()
    queue.queue("a", encode(Suspect("a", 1, "x")))
    queue.queue("a", encode(alive("a", 2)))
    assert [decode_update(b) for b in queue.take(budget=1000, limit=3)] == [alive("a", 2)]
    assert len(queue) == 1


def test_an_open_suspicion_is_gossiped_again_so_a_missed_refutation_comes_back():
    table = make_table()
    table.apply_suspect(Suspect("b", 0, "c"), now=0.0)
    table.broadcasts.take(budget=10_000, limit=1)  # the first round of gossip is over
    timer = table.suspicions["b"]
    table.expire_suspicions(timer.shortest - 0.01)
    assert table.broadcasts.pending("b") is None
    table.expire_suspicions(timer.shortest)
    assert decode_update(table.broadcasts.pending("b")) == Suspect("b", 0, "c")  # still c's accusation
    assert timer.regossip_at == pytest.approx(2 * timer.shortest)
    assert table.get("b").status is S
