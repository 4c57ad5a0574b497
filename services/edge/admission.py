"""Admission by tier against the fleet's load: pure functions of (tier, load, reserves).

A worker's load is the larger of its seats taken (running + waiting over the requests it runs
at once) and its KV pool taken (counting the prompts still waiting for it). The fleet's load
is the same over all its workers. Each tier may use the fleet up to `full_load` less the
reserves of the tiers above it (Tier.reserve is kept "for this tier and those above it"):
with the default tiers and full_load 1.0, `free` is refused from 0.7, `pro` from 0.8 and
`enterprise` only when the fleet is full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.edge.tenants import Tier


@dataclass(frozen=True)
class WorkerLoad:
    """What one worker gossips of its load; 0 in a capacity field means it does not say."""

    running: int = 0
    waiting: int = 0
    max_running: int = 0  # requests it runs at once
    kv_usage: float = 0.0  # share of its KV pool in use
    waiting_tokens: int = 0  # prompt tokens of the requests waiting for it
    kv_tokens: int = 0  # its KV pool, in tokens


def fleet_load(workers: Sequence[WorkerLoad], admitted_since: int = 0, admitted_tokens: int = 0) -> float | None:
    """The fleet's load (1.0: full), or None when no worker is known (nothing to judge by).

    `admitted_since` chats with `admitted_tokens` prompt tokens were admitted after the workers
    last reported, which their figures cannot show yet; without them a burst between two reports
    would all be let in, and then every tier refused until the next report.
    """
    if not workers:
        return None
    seats = sum(w.max_running for w in workers)
    taken = admitted_since + sum(w.running + w.waiting for w in workers if w.max_running)
    by_seats = taken / seats if seats else 0.0
    by_kv = sum(w.kv_usage + (w.waiting_tokens / w.kv_tokens if w.kv_tokens else 0.0) for w in workers) / len(workers)
    kv_tokens = sum(w.kv_tokens for w in workers)
    by_kv += admitted_tokens / kv_tokens if kv_tokens else 0.0
    return max(by_seats, by_kv)


def tier_limits(tiers: Mapping[str, Tier], full_load: float) -> dict[str, float]:
    """Per tier, the fleet load from which it is refused: full_load less the reserves above it.

    Tiers rank by weight; tiers of equal weight keep no reserve against each other.
    """
    limits = {}
    for name, tier in tiers.items():
        reserved_above = sum(other.reserve for other in tiers.values() if other.weight > tier.weight)
        limits[name] = full_load * max(0.0, 1.0 - reserved_above)
    return limits


@dataclass(frozen=True)
class Overloaded:
    """A chat refused because the fleet is too full for its tier."""

    tier: str
    load: float
    limit: float
    retry_after_ms: int

    @property
    def message(self) -> str:
        return f"the fleet is too busy for tier {self.tier} (load {self.load:.2f}, its limit {self.limit:.2f}); retry later"


def admit(tier: str, load: float | None, limits: Mapping[str, float], retry_after_ms: int) -> Overloaded | None:
    """None to admit, or the refusal. An unknown load admits: the chat waits for a worker
    (and `no_worker` ends it if none comes), as it would without admission. A tier the
    limits do not know is held to the lowest limit."""
    if load is None:
        return None
    limit = limits.get(tier, min(limits.values(), default=0.0))
    if load < limit:
        return None
    return Overloaded(tier, load, limit, retry_after_ms)
