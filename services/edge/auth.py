"""API keys -> tenants, checked once at the WebSocket handshake."""

from __future__ import annotations

from collections.abc import Mapping


def parse_api_keys(spec: str) -> dict[str, str]:
    """`key:tenant,key:tenant` -> {key: tenant}; a malformed entry is a config error."""
    keys: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, tenant = entry.partition(":")
        if not sep or not key or not tenant:
            raise ValueError(f"api key entry {entry!r} is not key:tenant")
        keys[key] = tenant
    return keys


def presented_key(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer KEY`, or `?api_key=KEY` for browsers, which cannot set headers."""
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return query.get("api_key") or None


def authenticate(keys: Mapping[str, str], headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """The tenant of the presented key, or None when it is missing or unknown."""
    key = presented_key(headers, query)
    return keys.get(key) if key else None
