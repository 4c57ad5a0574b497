"""Puts one request's token-path events back in seq order, exactly once.

Routers deliver at least once and may hand a partition over mid-stream, so an event
can arrive twice or early. Events below the next expected seq are duplicates and
dropped; events above it wait until the gap closes. An out-of-band error ends the stream on
arrival, whatever is still missing.
"""

from __future__ import annotations

from shared import wire


class StreamOrder:
    def __init__(self) -> None:
        self.next_seq = 0
        self.finished = False
        self.num_duplicates = 0
        self._early: dict[int, wire.Event] = {}

    def push(self, event: wire.Event) -> list[wire.Event]:
        """The events now ready to send, in order (empty when `event` is early or a duplicate)."""
        if event.seq == wire.OUT_OF_BAND and not self.finished:
            self.finished = True
            self._early.clear()
            return [event]
        if self.finished or event.seq < self.next_seq or event.seq in self._early:
            self.num_duplicates += 1
            return []
        self._early[event.seq] = event
        ready: list[wire.Event] = []
        while self.next_seq in self._early:
            ready_event = self._early.pop(self.next_seq)
            ready.append(ready_event)
            self.next_seq += 1
            if not isinstance(ready_event, wire.Token):
                self.finished = True
                self._early.clear()
                break
        return ready
