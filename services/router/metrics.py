"""The router's Prometheus metrics: events routed, routing-map cache use, what could not be delivered."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from shared.hop_timing import Hop, HopTimer


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("drivetrain_router_events_total", "Token-path events routed", registry=registry)
        self.forwards = Counter("drivetrain_router_forwards_total", "Frames forwarded to edges", registry=registry)
        self.unroutable = Counter("drivetrain_router_unroutable_total", "Events with no route or no live edge", registry=registry)
        self.cache_hits = Counter("drivetrain_router_route_cache_hits_total", "Routes found in the local cache", registry=registry)
        self.cache_misses = Counter("drivetrain_router_route_cache_misses_total", "Routes fetched from the Redis Cluster", registry=registry)
        self.dead_letters = Counter("drivetrain_router_dead_letters_total", "Malformed token messages sent to the dead-letter topic", registry=registry)
        # The usage aggregate (metering.py).
        self.usage_records = Counter(
            "drivetrain_router_usage_records_total", "Usage records read, by outcome: counted, duplicate, dead_letter", ["outcome"], registry=registry
        )
        self.usage_restarts = Counter(
            "drivetrain_router_usage_restarts_total", "Times the usage aggregate failed unforeseen and started again from its last commit", registry=registry
        )
        self.usage_tokens = Counter(
            "drivetrain_router_usage_tokens_total", "Tokens counted into tenants' usage, by kind: prompt (computed), cached, completion",
            ["kind"], registry=registry,
        )
        self.hops = HopTimer(registry, Hop.TOKEN_KAFKA, Hop.ROUTE)  # shared/hop_timing.py
