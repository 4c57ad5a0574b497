"""What a tenant may start on this edge: admission by tier against the fleet's load, the
tenant's limits (prompt length, rate, concurrent streams, connections), and giving slots back.

The edge service asks `admit_chat` before it writes anything for a chat and `end_stream`
wherever a stream ends; the WebSocket endpoint asks `admit_socket` at the handshake.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from redis.asyncio.cluster import RedisCluster

from services.edge.admission import admit, tier_limits
from services.edge.handshake import Refusal
from services.edge.protocol import ProtocolError
from services.edge.rate_limiter import RateLimiter
from services.edge.tenancy_settings import TenancySettings
from services.edge.tenant_directory import TenantDirectory
from services.edge.tenant_leases import Leases
from services.edge.tenants import Limits
from shared.codes import ErrorCode
from shared.redis_client import REDIS_UNAVAILABLE

log = logging.getLogger(__name__)

class FleetLoad(Protocol):
    def load(self) -> float | None:
        """The fleet's load (1.0: full), None when unknown."""

    def admitted(self, request_id: str, prompt_tokens: int) -> None:
        """A chat was admitted: its load counts before the workers report it."""

    def ended(self, request_id: str) -> None:
        """The chat ended: it loads nobody any more."""


class NoFleet:
    """No gossip to judge by (tests, a fleet without admission): every tier is admitted."""

    def load(self) -> float | None:
        return None

    def admitted(self, request_id: str, prompt_tokens: int) -> None:
        pass

    def ended(self, request_id: str) -> None:
        pass


class TenantGate:
    def __init__(
        self,
        settings: TenancySettings,
        redis: RedisCluster,
        tenants: TenantDirectory,
        fleet_load: FleetLoad = NoFleet(),
    ) -> None:
        self.settings = settings
        self._tenants = tenants
        self._fleet_load = fleet_load
        self.rates = RateLimiter(redis, settings.rate_burst_s)
        self.streams = Leases(redis, "streams", settings.lease_s)
        self.connections = Leases(redis, "connections", settings.lease_s)

    def limits(self, tenant: str) -> Limits:
        known = self._tenants.book.tenants.get(tenant)
        return known.limits if known is not None else Limits()

    async def admit_chat(self, tenant: str, chat_id: str, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        """Raises ProtocolError when refused; on return the chat holds its stream slot, which
        `end_stream` gives back. Refusals that cost nothing shared come first, and a chat refused
        by its rate gives its stream slot back, so no refusal is charged against the tenant."""
        limits = self.limits(tenant)
        if limits.max_prompt_tokens and prompt_tokens > limits.max_prompt_tokens:
            reason = f"prompt is {prompt_tokens} tokens; this tenant may send at most {limits.max_prompt_tokens}"
            raise ProtocolError(ErrorCode.PROMPT_TOO_LONG, reason, chat_id)
        tier = self._tenants.tier_of(tenant)
        limit_of = tier_limits(self._tenants.book.tiers, self.settings.full_load)
        overloaded = admit(tier, self._fleet_load.load(), limit_of, self.settings.overloaded_retry_after_ms)
        if overloaded is not None:
            raise ProtocolError(ErrorCode.OVERLOADED, overloaded.message, chat_id, overloaded.retry_after_ms)
        try:
            if not await self.streams.acquire(tenant, request_id, limits.concurrent_streams):
                cap = limits.concurrent_streams
                raise ProtocolError(ErrorCode.TOO_MANY_STREAMS, f"this tenant may have {cap} streams at once", chat_id)
            wait_ms = await self.rates.take(tenant, limits, prompt_tokens + max_tokens)
        except REDIS_UNAVAILABLE as exc:
            await self.streams.release(request_id)
            log.warning("could not check the limits of tenant %s: %r", tenant, exc)
            raise ProtocolError(
                ErrorCode.UNAVAILABLE, "the service could not take this chat now; retry", chat_id
            ) from exc
        if wait_ms is not None:
            await self.streams.release(request_id)
            message = f"this tenant is over its rate (requests_per_min {limits.requests_per_min}, tokens_per_min {limits.tokens_per_min})"
            raise ProtocolError(ErrorCode.RATE_LIMITED, message, chat_id, wait_ms)
        self._fleet_load.admitted(request_id, prompt_tokens)

    async def end_stream(self, request_id: str) -> None:
        self._fleet_load.ended(request_id)
        await self.streams.release(request_id)

    async def adopt_stream(self, tenant: str, request_id: str) -> None:
        """A stream resumed here keeps the slot it holds; an edge that cannot say so leaves it to expire."""
        if self.limits(tenant).concurrent_streams:
            try:
                await self.streams.adopt(tenant, request_id)
            except REDIS_UNAVAILABLE as exc:
                log.debug("stream %s not adopted: %r", request_id, exc)

    async def admit_socket(self, tenant: str, conn_id: str) -> Refusal | None:
        """None when the socket may open (it then holds a connection slot until `end_socket`)."""
        cap = self.limits(tenant).connections
        try:
            if await self.connections.acquire(tenant, conn_id, cap):
                return None
        except REDIS_UNAVAILABLE as exc:
            log.warning("could not count the connections of tenant %s: %r", tenant, exc)
            return Refusal(503, ErrorCode.UNAVAILABLE, "cannot open a socket now; retry", {"Retry-After": "1"})
        reason = f"this tenant may hold {cap} connections at once"
        return Refusal(429, ErrorCode.TOO_MANY_CONNECTIONS, reason, {"Retry-After": "1"})

    async def end_socket(self, conn_id: str) -> None:
        await self.connections.release(conn_id)

    async def renew_forever(self) -> None:
        """Renew this edge's slots until cancelled; a failed round is logged, the next one tries again."""
        while True:
            await asyncio.sleep(self.settings.lease_refresh_s)
            await asyncio.gather(self.streams.renew(), self.connections.renew())
