"""Local health awareness (Lifeguard LHM): a member that misses acks distrusts itself and slows down."""

from __future__ import annotations

from shared.membership.timing import scaled


class Awareness:
    """A health score in [0, max_multiplier - 1]; 0 means healthy, higher stretches timeouts."""

    def __init__(self, max_multiplier: int) -> None:
        self.max_multiplier = max_multiplier
        self.score = 0

    def apply_delta(self, delta: int) -> None:
        self.score = min(self.max_multiplier - 1, max(0, self.score + delta))

    def scale(self, duration: float) -> float:
        return scaled(duration, self.score)
