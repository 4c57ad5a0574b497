"""The edge's region metrics: where chats were placed, relays that failed, peers' loads as known here."""

from __future__ import annotations

from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge


class RelayFailure(StrEnum):
    CONNECT = "connect"  # the peer's edge could not be reached: the chat stayed here
    BROKEN = "broken"  # the relay's socket broke with chats in flight: each got a retryable error
    BAD_FRAME = "bad_frame"  # the peer sent a frame that is not one of the protocol's: dropped


class RegionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.placements = Counter(
            "drivetrain_edge_region_placements_total",
            "Chats placed, by the region chosen for them (this one, or the peer they were relayed to)",
            ["region"],
            registry=registry,
        )
        self.relay_errors = Counter(
            "drivetrain_edge_region_relay_errors_total",
            "Relays to a peer region that failed: connect (the chat stayed here), broken (its chats ended "
            "with a retryable error), bad_frame (a frame from the peer that was dropped)",
            ["reason"],
            registry=registry,
        )
        self.summaries_skipped = Counter(
            "drivetrain_edge_region_summaries_skipped_total",
            "Records on the region summary topic skipped: not a sealed capacity summary of this wire version",
            registry=registry,
        )
        self.peer_load = Gauge(
            "drivetrain_edge_region_peer_load",
            "Each peer region's load from its latest fresh summary; -1 when none is fresh",
            ["region"],
            registry=registry,
        )
        self.load = Gauge(
            "drivetrain_edge_region_load", "This region's load as this edge publishes it; -1 while it knows no worker", registry=registry
        )
        self.relayed = Gauge("drivetrain_edge_region_relayed_chats", "Chats in flight relayed to a peer region", registry=registry)
