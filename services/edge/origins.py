"""Which web pages may open a chat socket: the browser's `Origin` header against an allow-list.

A browser sends `Origin` on every WebSocket handshake, and a page on any site could
otherwise open one with a key in `?api_key=`. Clients that are not browsers send none.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class OriginPolicy:
    allowed: frozenset[str]  # normalised origins, "scheme://host[:port]"
    any_origin: bool = False

    @classmethod
    def parse(cls, spec: str) -> OriginPolicy:
        """`https://a.example,http://localhost:3000`, or `*` for every origin; a malformed entry is a config error."""
        entries = [part.strip() for part in spec.split(",") if part.strip()]
        if "*" in entries:
            return cls(frozenset(), any_origin=True)
        normalised = set()
        for entry in entries:
            origin = normalise(entry)
            if origin is None:
                raise ValueError(f"allowed origin {entry!r} is not scheme://host[:port]")
            normalised.add(origin)
        return cls(frozenset(normalised))

    def allows(self, origin: str | None, host: str | None, secure: bool = False) -> bool:
        """No `Origin` (not a browser), the page's own origin (the chat page this edge serves), or one listed."""
        if origin is None or self.any_origin:
            return True
        wanted = normalise(origin)
        if wanted is None:
            return False
        own = normalise(f"{'https' if secure else 'http'}://{host}") if host else None
        return wanted == own or wanted in self.allowed


_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def normalise(origin: str) -> str | None:
    """`scheme://host:port` in lower case with the default port made explicit; None if it is not an origin."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/") or parts.query:
        return None
    return f"{scheme}://{parts.hostname.lower()}:{port or _DEFAULT_PORTS[scheme]}"
