"""The router's settings (flags, DRIVETRAIN_* environment, profile; see shared/settings.py)."""

from __future__ import annotations

import os
import socket

from shared.addresses import parse_address
from shared.service_settings import MetricsSettings, ServiceSettings


class RouterSettings(ServiceSettings):
    """drivetrain router: takes token batches from Kafka and forwards each event to its edge."""

    router_id: str = ""
    """unique name of this router; empty: router-HOST-PID"""
    edges: str = ""
    """static edge addresses, edge-id=host:port[,...], for edges gossip does not (yet) know"""
    route_cache_size: int = 100_000
    """routes kept in the local cache; size it above the streams in flight on this router's partitions"""
    metrics: MetricsSettings = MetricsSettings()

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
