"""Who may open a chat socket: the checks of a WebSocket handshake, in order, with no I/O.

A client address that keeps getting refused (a bad key, a foreign origin) is told to
slow down before any of its handshakes cost a key lookup, so a flood of bad ones cannot
crowd out good ones. `admission` is the seam for what depends on the tenant (its
connection cap, once tenancy has one); it runs last, on an authenticated tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.edge.auth import Credential, TenantOf, authenticate
from services.edge.origins import OriginPolicy
from shared.codes import ErrorCode
from shared.rate_limits import KeyedBuckets, Rate

# (tenant, client address) -> None to admit, or the refusal.
Admission = Callable[[str, str], "Refusal | None"]


@dataclass(frozen=True)
class Refusal:
    """A handshake refused with an HTTP status, before any frame."""

    status: int
    code: ErrorCode
    reason: str
    headers: dict[str, str] = field(default_factory=dict)


def admit_all(tenant: str, client: str) -> Refusal | None:
    return None


SLOW_DOWN = Refusal(429, ErrorCode.TOO_MANY_HANDSHAKES, "too many refused handshakes; slow down", {"Retry-After": "1"})
BAD_ORIGIN = Refusal(403, ErrorCode.ORIGIN_NOT_ALLOWED, "this origin may not open a chat socket")
SWEEP_EVERY_S = 10.0  # forgetting refilled buckets walks them all: not on every handshake
BAD_KEY = Refusal(401, ErrorCode.INVALID_API_KEY, "missing or unknown API key", {"WWW-Authenticate": "Bearer"})


class HandshakeGate:
    def __init__(
        self,
        tenant_of: TenantOf,
        origins: OriginPolicy,
        refused_rate: Rate,
        admission: Admission = admit_all,
    ) -> None:
        self._tenant_of = tenant_of
        self._origins = origins
        self._refused = KeyedBuckets(refused_rate)
        self._admission = admission
        self._swept_at = float("-inf")

    def admit(
        self, client: str, headers: Mapping[str, str], query: Mapping[str, str], secure: bool, now: float
    ) -> Credential | Refusal:
        """Who an admitted handshake is, or why it is refused."""
        if now - self._swept_at > SWEEP_EVERY_S:
            self._refused.sweep(now)
            self._swept_at = now
        if not self._refused.allows(client, now):
            return SLOW_DOWN
        if not self._origins.allows(headers.get("origin"), headers.get("host"), secure):
            self._refused.charge(client, now)
            return BAD_ORIGIN
        credential = authenticate(self._tenant_of, headers, query)
        if credential is None:
            self._refused.charge(client, now)
            return BAD_KEY
        return self._admission(credential.tenant, client) or credential
