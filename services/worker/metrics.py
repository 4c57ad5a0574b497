"""The worker's Prometheus metrics: engine load and cache use, tokens produced, bad requests."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

LOAD_GAUGES = {
    "running": ("drivetrain_worker_running_requests", "Requests the engine is computing"),
    "waiting": ("drivetrain_worker_waiting_requests", "Requests queued in the engine"),
    "kv_usage": ("drivetrain_worker_kv_cache_usage_ratio", "Share of KV cache blocks in use"),
    "free_kv_blocks": ("drivetrain_worker_kv_free_blocks", "KV cache blocks free"),
    "prefix_hit_rate": ("drivetrain_worker_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache"),
}


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, load: Callable[[], dict[str, int | float]]) -> None:
        for key, (name, help_text) in LOAD_GAUGES.items():
            Gauge(name, help_text, registry=registry).set_function(lambda key=key: load().get(key, 0))
        self.requests = Counter("drivetrain_worker_requests_total", "Requests taken from Kafka", registry=registry)
        self.tokens = Counter("drivetrain_worker_tokens_total", "Tokens generated and published", registry=registry)
        self.batches = Counter("drivetrain_worker_token_batches_total", "Token messages published (one per step per edge)", registry=registry)
        self.dead_letters = Counter("drivetrain_worker_dead_letters_total", "Malformed messages sent to the dead-letter topic", registry=registry)
        self.quarantined = Counter("drivetrain_worker_quarantined_total", "Requests not run because a worker died running them", registry=registry)
