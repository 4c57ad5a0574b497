"""The edge's Prometheus metrics: what clients experience (time to first token, gaps, refusals)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.edge.connection import Delivered
from shared import wire
from shared.hop_timing import Hop, HopTimer

# Token latencies live between a few milliseconds and tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.connections = Gauge("drivetrain_edge_connections", "Open client connections", registry=registry)
        self.chats_in_flight = Gauge("drivetrain_edge_chats_in_flight", "Chats admitted and not ended", registry=registry)
        self.chats = Counter("drivetrain_edge_chats_total", "Chats admitted", ["tier"], registry=registry)
        self.refusals = Counter(
            "drivetrain_edge_refusals_total", "Frames or chats refused, by error code", ["code", "tier"], registry=registry
        )
        self.ttft = Histogram(
            "drivetrain_edge_ttft_seconds", "Admission to first token, as the edge sends it", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.itl = Histogram(
            "drivetrain_edge_itl_seconds", "Gap between consecutive tokens of a stream", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.tokens = Counter("drivetrain_edge_tokens_total", "Tokens sent to clients", registry=registry)
        self.endings = Counter(
            "drivetrain_edge_stream_endings_total", "Streams ended, by finish reason or error code", ["reason"], registry=registry
        )
        self.usage_records = Counter(
            "drivetrain_edge_usage_records_total",
            "Usage records of streams whose worker died after delivering tokens, by outcome: sent, lost",
            ["outcome"],
            registry=registry,
        )
        self.duplicates = Counter(
            "drivetrain_edge_duplicate_events_total", "Routed events dropped as already delivered (a router handover)", registry=registry
        )

        self.link_refusals = Counter(
            "drivetrain_edge_link_refusals_total",
            "Router links refused (no proof of the fleet secret, a frame that does not verify) and "
            "routed events dropped (malformed, or from a worker that does not run the stream)",
            registry=registry,
        )
        self.hops = HopTimer(registry, Hop.ADMISSION, Hop.LINK, Hop.SOCKET_WRITE)  # shared/hop_timing.py

    def observe(self, delivered: Delivered) -> None:
        if delivered.duplicate:
            self.duplicates.inc()
        chat, now = delivered.chat, time.monotonic()
        for event in delivered.sent:
            if isinstance(event, wire.Token):
                if chat.last_token_at is None:
                    self.ttft.observe(now - chat.opened_at)
                else:
                    self.itl.observe(now - chat.last_token_at)
                chat.last_token_at = now
                self.tokens.inc()
            elif isinstance(event, wire.Done):
                self.endings.labels(event.finish_reason).inc()
            elif isinstance(event, wire.Error):
                self.endings.labels(event.code).inc()
