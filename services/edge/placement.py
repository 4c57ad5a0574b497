"""Placement policies: which worker gets a chat, from each worker's load, the prompt blocks it holds
and the conversation it served. Pure: candidates in, one candidate out; table-tested.

`bounded_affinity` is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam):
the cache-aware choice, but only among workers whose load after taking the chat stays within
`c` times the fleet's mean (rounded up to a whole chat); where none does, the least loaded. So a hot document's thousand
questions fill its warm worker up to the bound and then spill over to the next best, instead
of starving that worker's other tenants. `prefix_affinity` is the same choice with no bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from shared.rendezvous import rendezvous


class Policy(StrEnum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AFFINITY = "prefix_affinity"
    BOUNDED_AFFINITY = "bounded_affinity"


@dataclass(frozen=True)
class Candidate:
    worker: str
    load: float  # requests running and waiting on it
    cached_blocks: int = 0  # leading blocks of the prompt it holds in its prefix cache
    affine: bool = False  # it served this conversation's earlier turns


def load_cap(candidates: Sequence[Candidate], c: float) -> int:
    """The most load a worker may have once it takes one more chat: c times the mean, that chat counted,
    rounded up to a whole chat (as the paper's capacity is), so a nearly idle fleet keeps some slack."""
    return math.ceil(c * (sum(x.load for x in candidates) + 1) / len(candidates) - 1e-9)


def within_bound(candidates: Sequence[Candidate], c: float) -> list[Candidate]:
    """The workers that may take one more chat; where none may, the least loaded (never an empty list)."""
    cap = load_cap(candidates, c)
    allowed = [x for x in candidates if x.load + 1 <= cap]
    if allowed:
        return allowed
    least = min(x.load for x in candidates)
    return [x for x in candidates if x.load == least]


def choose(
    policy: Policy, candidates: Sequence[Candidate], key: str, c: float = 1.25, turn: int = 0
) -> Candidate | None:
    """The candidate for a chat; None when there is none. `key` breaks ties (the conversation, the
    prompt's first block or the request id), `turn` counts chats for round robin."""
    if not candidates:
        return None
    if policy is Policy.ROUND_ROBIN:
        return sorted(candidates, key=lambda x: x.worker)[turn % len(candidates)]
    if policy is Policy.LEAST_LOADED:
        return min(candidates, key=lambda x: (x.load, -rendezvous(key, x.worker)))
    if policy is Policy.BOUNDED_AFFINITY:
        candidates = within_bound(candidates, c)
    return max(candidates, key=lambda x: (x.cached_blocks, x.affine, rendezvous(key, x.worker)))
