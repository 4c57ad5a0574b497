"""Whose events a connection takes: once a worker has started a stream, only that worker adds to it."""

from services.edge.connection import Connection
from shared import wire
from shared.codes import ErrorCode, FinishReason


async def _sink(frame) -> None:
    pass


def chat_on_a_connection() -> Connection:
    conn = Connection("conn", "tenant", _sink)
    conn.open_chat("c1", "r1")
    return conn


def test_the_starting_worker_owns_the_stream_and_nobody_else_adds_to_it():
    conn = chat_on_a_connection()
    assert not conn.deliver(wire.Started("r1", wire.OUT_OF_BAND, "worker-a"), "worker-a").foreign
    forged = conn.deliver(wire.Token("r1", 0, "injected"), "worker-b")
    assert forged.foreign and forged.sent == []
    assert conn.deliver(wire.Started("r1", wire.OUT_OF_BAND, "worker-b"), "worker-b").foreign  # no takeover
    assert conn.deliver(wire.Done("r1", 0, FinishReason.STOP, wire.Usage(1, 0, 0)), "worker-b").foreign
    real = conn.deliver(wire.Token("r1", 0, "real"), "worker-a")
    assert not real.foreign and [e.text for e in real.sent] == ["real"]


def test_before_a_start_a_worker_may_end_a_stream_but_not_write_into_it():
    conn = chat_on_a_connection()
    assert conn.deliver(wire.Token("r1", 0, "early"), "worker-b").foreign
    # A start sealed by one worker in another's name never makes it the owner.
    assert conn.deliver(wire.Started("r1", wire.OUT_OF_BAND, "worker-a"), "worker-b").foreign
    quarantined = wire.Error.of("r1", ErrorCode.REQUEST_QUARANTINED, "a worker died running it")
    ended = conn.deliver(quarantined, "worker-b")
    assert not ended.foreign and ended.sent == [quarantined] and not conn.has_chat("c1")


def test_the_edge_own_events_need_no_worker():
    conn = chat_on_a_connection()
    conn.deliver(wire.Started("r1", wire.OUT_OF_BAND, "worker-a"), "worker-a")
    lost = wire.Error.of("r1", ErrorCode.WORKER_LOST, "gone")
    assert conn.deliver(lost).sent == [lost]


def test_a_moved_notice_ends_the_old_attachment_only():
    conn = chat_on_a_connection()
    conn.deliver(wire.Started("r1", wire.OUT_OF_BAND, "worker-a"), "worker-a")
    assert conn.deliver(wire.Moved("r1", wire.OUT_OF_BAND, "conn", 0), "worker-a").sent == []  # not newer
    moved = conn.deliver(wire.Moved("r1", wire.OUT_OF_BAND, "conn", 1), "worker-a")
    (error,) = moved.sent
    assert error.code == ErrorCode.STREAM_MOVED and not error.retryable
    assert not conn.has_chat("c1") and not moved.chat.order.finished  # the stream itself goes on
