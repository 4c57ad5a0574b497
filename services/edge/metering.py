"""The edge's usage records: for streams whose worker died after tokens reached the client.

Only the edge knows such a stream ended, and how many tokens it delivered (its stream order's
next seq); the worker that knew the exact counts is gone. The prompt is the edge's own count,
kept from admission (a stream resumed here from another edge has none: 0). If the worker did
report the stream before it died, its record came first on the request's partition and the
aggregate keeps that one (shared/metering/ledger.py).
"""

from __future__ import annotations

import time

from cachetools import TTLCache

from shared import wire
from shared.codes import ErrorCode
from shared.metering.publisher import UsagePublisher
from shared.metering.records import UsageContext, usage_record

MAX_TRACKED = 200_000
TRACKED_TTL_S = 6 * 3600  # longer than any stream runs; a context nobody ended is forgotten


class EdgeMeter:
    def __init__(self, publisher: UsagePublisher, edge_id: str) -> None:
        self._publisher = publisher
        self._edge_id = edge_id
        self._contexts: TTLCache[str, UsageContext] = TTLCache(maxsize=MAX_TRACKED, ttl=TRACKED_TTL_S)

    def admitted(self, request_id: str, context: UsageContext) -> None:
        self._contexts[request_id] = context

    def forget(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)

    def worker_died(self, request_id: str, tenant: str, tier: str, worker_id: str, tokens_delivered: int) -> wire.UsageRecord | None:
        """The record of a stream its worker took down with it (to `publish`); taken now, before the
        stream's end makes the edge forget its context."""
        context = self._contexts.pop(request_id, None) or UsageContext(tenant, tier)
        return usage_record(
            request_id, context, self._edge_id, worker_id, time.time(),
            tokens_sent=tokens_delivered, error=ErrorCode.WORKER_LOST,
        )

    async def publish(self, record: wire.UsageRecord | None) -> None:
        await self._publisher.publish(record)
