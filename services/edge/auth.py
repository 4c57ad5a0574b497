"""API keys -> tenants, checked once at the WebSocket handshake."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from services.edge.tenants import Tenant, hash_key

TenantOf = Callable[[str], Tenant | None]  # an API key -> its tenant


def parse_api_keys(spec: str) -> dict[str, str]:
    """`key:tenant,key:tenant` -> {key: tenant}; a malformed entry is a config error."""
    return parse_pairs(spec, "key:tenant")


def parse_pairs(spec: str, shape: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        left, sep, right = entry.partition(":")
        if not sep or not left or not right:
            raise ValueError(f"entry {entry!r} is not {shape}")
        pairs[left] = right
    return pairs


DEFAULT_TIER = "standard"


def parse_tiers(spec: str) -> dict[str, str]:
    """`tenant:tier,...` -> {tenant: tier}; tenants not named are in DEFAULT_TIER."""
    return parse_pairs(spec, "tenant:tier")


def presented_key(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer KEY`, or `?api_key=KEY` for browsers, which cannot set headers."""
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return query.get("api_key") or None


@dataclass(frozen=True)
class Credential:
    """Who a client proved to be, and with which key (by hash): a revoked key's sockets are closed."""

    tenant: str
    key_hash: str


def authenticate(tenant_of: TenantOf, headers: Mapping[str, str], query: Mapping[str, str]) -> Credential | None:
    """The tenant of the presented key, or None when it is missing or unknown."""
    key = presented_key(headers, query)
    tenant = tenant_of(key) if key else None
    return Credential(tenant.id, hash_key(key)) if tenant is not None else None
