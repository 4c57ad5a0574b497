"""A worker commits only up to its oldest request that has not started."""

from aiokafka import TopicPartition

from services.worker.offset_tracker import OffsetTracker

P0, P1 = TopicPartition("t", 0), TopicPartition("t", 1)


def test_commits_stop_at_the_oldest_unstarted_request():
    tracker = OffsetTracker()
    for offset, rid in [(10, "a"), (11, "b"), (12, "c")]:
        tracker.add(P0, offset, rid)
    assert tracker.committable() == {}
    tracker.started("b")
    assert tracker.committable() == {}  # "a" still holds the partition back
    tracker.started("a")
    assert tracker.committable() == {P0: 12}
    assert tracker.committable() == {}  # nothing new
    tracker.started("c")
    assert tracker.committable() == {P0: 13}


def test_records_needing_no_start_commit_at_once_and_partitions_are_independent():
    tracker = OffsetTracker()
    tracker.add(P0, 0, None)  # e.g. dead-lettered
    tracker.add(P1, 5, "x")
    assert tracker.committable() == {P0: 1}
    tracker.started("x")
    assert tracker.committable() == {P1: 6}


def test_revoked_partitions_are_forgotten():
    tracker = OffsetTracker()
    tracker.add(P0, 3, "a")
    tracker.add(P0, 4, "b")
    tracker.started("b")
    assert tracker.forget_partitions({P0}) == ["a"]
    tracker.started("a")  # unknown now: ignored
    assert tracker.committable() == {}
