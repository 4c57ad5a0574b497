"""The fleet simulator's clock: a heap of timed callbacks run in time order, in virtual seconds.

Ties run in the order they were scheduled, so a run is a pure function of its inputs and seed."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self._stopped = False

    def at(self, when: float, callback: Callable[[Any], None], arg: Any = None) -> None:
        """Run callback(arg) at virtual time `when` (never before now)."""
        self._seq += 1
        heapq.heappush(self._queue, (max(when, self.now), self._seq, callback, arg))

    def after(self, delay: float, callback: Callable[[Any], None], arg: Any = None) -> None:
        self.at(self.now + delay, callback, arg)

    def stop(self) -> None:
        """End run() after the event being handled: what is still queued stays unrun."""
        self._stopped = True

    def run(self, until: float = float("inf")) -> float:
        """Handle events in time order until none is left, stop() is called, or the next is past `until`."""
        queue, pop = self._queue, heapq.heappop
        while queue and not self._stopped:
            if queue[0][0] > until:
                self.now = until
                break
            self.now, _, callback, arg = pop(queue)
            callback(arg)
        return self.now
