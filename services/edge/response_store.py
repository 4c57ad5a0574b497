"""Finished /v1/responses answers, kept in the Redis Cluster so a later request on any edge can continue
the conversation with `previous_response_id`.

One key per tenant and response, so a tenant can only ever read its own: another tenant's id names a key
that does not exist. Each record holds the whole conversation up to its answer (one read continues it)
and expires after a TTL. The client sets `decode_responses`, so records are JSON text.
"""

from __future__ import annotations

import asyncio
import logging
import re

import msgspec
from redis.asyncio.cluster import RedisCluster

log = logging.getLogger(__name__)

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")  # what the edge hands out: anything else was never stored
MAX_IN_FLIGHT = 64  # redis-py's cluster client fails at once when a node's pool is full: queue here instead


class StoredTurn(msgspec.Struct, frozen=True, array_like=True):
    role: str
    content: str


class StoredResponse(msgspec.Struct, frozen=True):
    tenant: str  # checked again on read, beside the key that already names it
    turns: list[StoredTurn]  # input items and answers, oldest first; never the instructions (OpenAI carries none over)


def response_key(tenant: str, response_id: str) -> str:
    return f"response:{tenant}:{response_id}"


_decoder = msgspec.json.Decoder(StoredResponse)


class ResponseStore:
    """Redis errors propagate: the caller answers them (a lookup that fails is a retryable refusal)."""

    def __init__(self, redis: RedisCluster, ttl_s: float) -> None:
        self._redis = redis
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def load(self, tenant: str, response_id: str) -> list[StoredTurn] | None:
        """The conversation up to that response, or None when this tenant has no such response (any more)."""
        if not RESPONSE_ID.match(response_id):
            return None
        async with self._in_flight:
            raw = await self._redis.get(response_key(tenant, response_id))
        if raw is None:
            return None
        try:
            stored = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # not ours to trust: read as absent
            log.warning("stored response %s is unreadable: %r", response_id, exc)
            return None
        return stored.turns if stored.tenant == tenant else None

    async def save(self, tenant: str, response_id: str, turns: list[StoredTurn]) -> None:
        record = msgspec.json.encode(StoredResponse(tenant, turns)).decode()
        async with self._in_flight:
            await self._redis.set(response_key(tenant, response_id), record, px=self._ttl_ms)
