"""How one engine step's events for one edge become Kafka messages: one per (edge, shard).

A request's events always share a shard, so they stay in order on one partition, while one
busy edge's traffic still spreads over several routers. Each message carries the route
epochs of its own resumed requests only.
"""

from __future__ import annotations

import zlib
from collections import defaultdict

from shared import wire


def shard_of(request_id: str, num_shards: int) -> int:
    return zlib.crc32(request_id.encode()) % num_shards


def token_batches(
    edge_id: str,
    worker_id: str,
    events: list[wire.Event],
    epochs: dict[str, int],
    num_shards: int,
    sent_at: float,
) -> list[tuple[bytes, wire.TokenBatch]]:
    """(Kafka key, message) per shard that has events, the events in their given order."""
    shards: dict[int, list[wire.Event]] = defaultdict(list)
    for event in events:
        shards[shard_of(event.request_id, num_shards)].append(event)
    batches = []
    for shard, part in shards.items():
        ids = {event.request_id for event in part}
        part_epochs = {request_id: epoch for request_id, epoch in epochs.items() if request_id in ids}
        batch = wire.TokenBatch(edge_id, worker_id, part, sent_at=sent_at, epochs=part_epochs)
        batches.append((f"{edge_id}#{shard}".encode(), batch))
    return batches
