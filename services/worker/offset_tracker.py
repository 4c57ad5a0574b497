"""Which request offsets a worker may commit: only those whose request has started.

Kafka commits a position per partition, so a worker may only commit up to its
oldest request that has not started yet. If the worker dies, everything from there
on is delivered again to another worker; what had started is recognised there by
its claim and never run twice.
"""

from __future__ import annotations

from aiokafka import TopicPartition


class OffsetTracker:
    def __init__(self) -> None:
        self._pending: dict[TopicPartition, dict[int, str | None]] = {}  # offset -> request id, None once started
        self._where: dict[str, tuple[TopicPartition, int]] = {}
        self._committed: dict[TopicPartition, int] = {}

    def add(self, tp: TopicPartition, offset: int, request_id: str | None) -> None:
        """A record taken from Kafka; `request_id` None means nothing to wait for (done with it)."""
        self._pending.setdefault(tp, {})[offset] = request_id
        if request_id is not None:
            self._where[request_id] = (tp, offset)

    def started(self, request_id: str) -> None:
        where = self._where.pop(request_id, None)
        if where is not None:
            tp, offset = where
            self._pending[tp][offset] = None

    def forget_partitions(self, partitions: set[TopicPartition]) -> list[str]:
        """Partitions taken away by a rebalance: their new owner re-reads what we did not
        commit. Returns the requests of theirs that had not started, to drop here."""
        unstarted: list[str] = []
        for tp in partitions:
            for request_id in filter(None, self._pending.pop(tp, {}).values()):
                self._where.pop(request_id, None)
                unstarted.append(request_id)
            self._committed.pop(tp, None)
        return unstarted

    def committable(self) -> dict[TopicPartition, int]:
        """Per partition, the next offset to commit, where it moved since the last call."""
        moves: dict[TopicPartition, int] = {}
        for tp, pending in self._pending.items():
            position = None
            for offset in sorted(pending):
                if pending[offset] is not None:
                    break
                position = offset + 1
                del pending[offset]
            if position is not None and position > self._committed.get(tp, -1):
                moves[tp] = self._committed[tp] = position
        return moves
