"""When a supervised child that died is started again: a pure policy, with the clock passed in.

Each death in a row doubles the wait (1 s, 2 s, 4 s ... at most 30 s), so a child that cannot
start does not spin; one that served a while before it died starts the count afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ChildState(StrEnum):
    STARTING = "starting"  # started, not yet answering /healthz with 200
    SERVING = "serving"
    WAITING = "waiting"  # died; restarts at `restart_at`
    DEAD = "dead"  # died, and is left dead (--no-restart)
    STOPPING = "stopping"


@dataclass(frozen=True)
class RestartPolicy:
    initial_s: float = 1.0
    max_s: float = 30.0
    factor: float = 2.0
    stable_s: float = 60.0  # a child that lived this long has its count of deaths reset
    restart: bool = True

    def delay(self, deaths_in_a_row: int) -> float:
        return min(self.max_s, self.initial_s * self.factor ** max(0, deaths_in_a_row - 1))


@dataclass
class ChildLife:
    """One supervised child's state across its restarts."""

    state: ChildState = ChildState.STARTING
    started_at: float = 0.0
    deaths_in_a_row: int = 0
    restart_at: float | None = None
    generation: int = 0  # how many times it was started

    def started(self, now: float) -> None:
        self.state, self.started_at, self.restart_at = ChildState.STARTING, now, None
        self.generation += 1

    def serving(self) -> None:
        self.state = ChildState.SERVING

    def died(self, now: float, policy: RestartPolicy) -> float | None:
        """Record a death; the delay before its restart, or None if it stays dead."""
        self.deaths_in_a_row = 1 if now - self.started_at >= policy.stable_s else self.deaths_in_a_row + 1
        if not policy.restart:
            self.state = ChildState.DEAD
            return None
        delay = policy.delay(self.deaths_in_a_row)
        self.state, self.restart_at = ChildState.WAITING, now + delay
        return delay

    def due(self, now: float) -> bool:
        return self.state is ChildState.WAITING and self.restart_at is not None and now >= self.restart_at
