"""The router's frozen config (flags, DRIVETRAIN_* environment, profile)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from shared.config import CommonConfig, doc, parse_address


@dataclass(frozen=True)
class RouterConfig(CommonConfig):
    """drivetrain router: takes token batches from Kafka and forwards each event to its edge."""

    router_id: str = doc("unique name of this router (default: host-pid)", "")
    edges: str = doc("static edge addresses, edge-id=host:port[,...]; membership finds the rest", "")
    route_cache_size: int = doc("routes kept in the local cache", 100_000)

    @property
    def name(self) -> str:
        return self.router_id or f"router-{socket.gethostname()}-{os.getpid()}"

    def edge_addresses(self) -> dict[str, tuple[str, int]]:
        peers = {}
        for entry in filter(None, (part.strip() for part in self.edges.split(","))):
            edge_id, sep, address = entry.partition("=")
            if not sep:
                raise ValueError(f"edge entry {entry!r} is not edge-id=host:port")
            peers[edge_id] = parse_address(address)
        return peers
