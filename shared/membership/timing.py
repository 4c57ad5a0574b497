"""The protocol's timing math as pure functions: suspicion timeouts, retransmit limits, scaling."""

from __future__ import annotations

import math


def node_scale(num_members: int) -> float:
    """log10 of the cluster size, never below 1, so small clusters still get a usable timeout."""
    return max(1.0, math.log10(max(1, num_members)))


def suspicion_timeout(suspicion_mult: int, num_members: int, probe_interval: float) -> float:
    """The shortest a suspicion may last: long enough for a refutation to reach everyone."""
    return suspicion_mult * node_scale(num_members) * probe_interval


def suspicion_bounds(
    suspicion_mult: int, max_timeout_mult: int, num_members: int, probe_interval: float
) -> tuple[float, float]:
    """(min, max) seconds of a suspicion: fully confirmed and unconfirmed."""
    shortest = suspicion_timeout(suspicion_mult, num_members, probe_interval)
    return shortest, max_timeout_mult * shortest


def expected_confirmations(suspicion_mult: int, num_members: int) -> int:
    """K, the independent confirmations that shrink a suspicion to its minimum.

    Too few other members could ever confirm in a tiny cluster, so there K is 0 and the
    minimum applies at once.
    """
    wanted = suspicion_mult - 2
    return 0 if num_members - 2 < wanted else max(0, wanted)


def confirmed_timeout(shortest: float, longest: float, confirmations: int, expected: int) -> float:
    """Lifeguard's shrinking timeout: max(min, max - (max - min) * log(C + 1) / log(K + 1))."""
    if expected < 1:
        return shortest
    fraction = math.log(confirmations + 1) / math.log(expected + 1)
    return max(shortest, longest - (longest - shortest) * fraction)


def retransmit_limit(retransmit_mult: int, num_members: int) -> int:
    """How many times an update is piggybacked: mult * ceil(log10(N + 1))."""
    return retransmit_mult * math.ceil(math.log10(num_members + 1))


def push_pull_interval(base: float, num_members: int) -> float:
    """Full-state exchanges slow down past 32 members, where each one costs many datagrams."""
    if num_members <= 32:
        return base
    return base * (math.ceil(math.log2(num_members) - math.log2(32)) + 1)


def scaled(duration: float, health_score: int) -> float:
    """A timeout stretched by local health: score 0 is healthy, each point adds one more base duration."""
    return duration * (health_score + 1)
