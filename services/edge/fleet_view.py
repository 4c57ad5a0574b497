"""The fleet's load as this edge's gossip membership reports it, for admission.

Gossiped loads are input from other processes: a field missing or of the wrong kind reads
as 0 (the worker then says nothing of that capacity), never as an error.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from services.edge.admission import WorkerLoad, fleet_load
from shared.membership import Membership


def worker_load(gossiped: Mapping[str, object]) -> WorkerLoad:
    def number(key: str, kind: type) -> int | float:
        value = gossiped.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return kind(0)
        return kind(value)

    return WorkerLoad(
        running=number("running", int),
        waiting=number("waiting", int),
        max_running=number("max_running", int),
        kv_usage=number("kv_usage", float),
        waiting_tokens=number("waiting_tokens", int),
        kv_tokens=number("kv_tokens", int),
    )


# A worker's gossiped load includes what reached it up to about this long ago (it publishes every
# second; gossip takes a moment more): chats this edge admitted since are added to it.
REPORT_LAG_S = 2.0


class FleetView:
    """`load()` is None until `watch` binds a membership (and while it knows no live worker)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, report_lag_s: float = REPORT_LAG_S) -> None:
        self._membership: Membership | None = None
        self._clock = clock
        self._lag_s = report_lag_s
        # Recent chats still in flight: when admitted, and their prompt tokens.
        self._admitted: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def watch(self, membership: Membership) -> None:
        self._membership = membership

    def admitted(self, request_id: str, prompt_tokens: int) -> None:
        self._admitted[request_id] = (self._clock(), prompt_tokens)

    def ended(self, request_id: str) -> None:
        """A chat that ended before the workers reported it adds nothing to their load any more."""
        self._admitted.pop(request_id, None)

    def load(self) -> float | None:
        if self._membership is None:
            return None
        horizon = self._clock() - self._lag_s
        while self._admitted and next(iter(self._admitted.values()))[0] < horizon:
            self._admitted.popitem(last=False)
        workers = [worker_load(m.load) for m in self._membership.alive("worker")]
        tokens = sum(n for _, n in self._admitted.values())
        return fleet_load(workers, admitted_since=len(self._admitted), admitted_tokens=tokens)
