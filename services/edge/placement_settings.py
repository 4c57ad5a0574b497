"""The edge's placement settings: which policy picks each chat's worker, its load bound, and the
memory the KV-cache index and the conversation map may take (placement.py, placer.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from services.edge.placement import Policy
from shared.settings import Section


class PlacementSettings(Section):
    """How the edge places each chat on a worker (one of the requests partitions it owns)."""

    policy: Policy = Policy.BOUNDED_AFFINITY
    """round_robin | least_loaded | prefix_affinity (the worker holding most of the prompt's leading blocks, by the workers' KV-cache events; then the conversation's worker) | bounded_affinity (the same among the workers the load bound allows, else the least loaded)"""
    load_bound: Annotated[float, Field(ge=1.0, le=10.0)] = 1.25
    """bounded_affinity: no worker is given a chat that takes its load (running + waiting chats) above this times the fleet's mean"""
    index_blocks_per_worker: Annotated[int, Field(ge=1, le=10_000_000)] = 65536
    """most prefix-cache blocks remembered per worker from its KV-cache events (the oldest are forgotten first)"""
    conversations: Annotated[int, Field(ge=0, le=10_000_000)] = 100_000
    """most conversations whose last worker is remembered for conversation affinity (the least recent are forgotten first)"""
