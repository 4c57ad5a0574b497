"""The worker's Prometheus metrics: the engine's load and cache use, what it did, tokens produced, bad requests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.worker.engine.types import EngineLoad
from shared.hop_timing import Hop, HopTimer

# EngineLoad field -> (metric name, help); gauges are read as they are, counters only grow.
LOAD_GAUGES = {
    "running": ("drivetrain_worker_running_requests", "Requests the engine is computing"),
    "waiting": ("drivetrain_worker_waiting_requests", "Requests queued in the engine"),
    # The autoscaler's signal (compose/k8s/autoscaling): work queued, in tokens rather than requests.
    "waiting_tokens": ("drivetrain_worker_waiting_tokens", "Tokens still to compute of the requests queued in the engine"),
    "kv_usage": ("drivetrain_worker_kv_cache_usage_ratio", "Share of KV cache blocks in use"),
    "free_kv_blocks": ("drivetrain_worker_kv_free_blocks", "KV cache blocks free"),
    "prefix_hit_rate": ("drivetrain_worker_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache"),
}
LOAD_COUNTERS = {
    "steps": ("drivetrain_worker_engine_steps", "Engine steps run"),
    "graph_steps": ("drivetrain_worker_engine_graph_steps", "Engine steps whose model ran as one compiled or captured graph"),
    "preemptions": ("drivetrain_worker_preemptions", "Requests preempted for lack of KV blocks (recomputed later)"),
    "isolated_failures": ("drivetrain_worker_isolated_failures", "Batched steps that raised and were re-run request by request"),
}


class EngineCollector(Collector):
    """Reads the engine's load once per scrape."""

    def __init__(self, load: Callable[[], EngineLoad]) -> None:
        self._load = load

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load = self._load()
        for field, (name, help_text) in LOAD_GAUGES.items():
            yield GaugeMetricFamily(name, help_text, value=getattr(load, field))
        for field, (name, help_text) in LOAD_COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=getattr(load, field))


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, load: Callable[[], EngineLoad]) -> None:
        registry.register(EngineCollector(load))
        self.requests = Counter("drivetrain_worker_requests_total", "Requests taken from Kafka", registry=registry)
        self.tokens = Counter("drivetrain_worker_tokens_total", "Tokens generated and published", registry=registry)
        self.batches = Counter("drivetrain_worker_token_batches_total", "Token messages published (one per step per edge)", registry=registry)
        self.dead_letters = Counter("drivetrain_worker_dead_letters_total", "Malformed messages sent to the dead-letter topic", registry=registry)
        self.quarantined = Counter("drivetrain_worker_quarantined_total", "Requests not run because a worker died running them", registry=registry)
        self.usage_records = Counter(
            "drivetrain_worker_usage_records_total", "Usage records of ended streams, by outcome: sent, lost", ["outcome"], registry=registry
        )
        self.hops = HopTimer(registry, Hop.REQUEST_KAFKA, Hop.WORKER_START)  # shared/hop_timing.py
        # Disaggregated roles: what the KV link moved (prefill_role.py, kv_receiver.py).
        self.handoffs = Counter(
            "drivetrain_worker_handoffs_total", "Prefilled requests by outcome: handed_off, decoded_here, ended; received",
            ["outcome"], registry=registry,
        )  # fmt: skip
        self.kv_link_bytes = Counter(
            "drivetrain_worker_kv_link_bytes_total", "KV cache bytes over the KV link, by direction: sent, received", ["direction"], registry=registry
        )
        self.handoff_seconds = Histogram(
            "drivetrain_worker_handoff_seconds", "A landed handoff, from connecting to the decode worker to its commit",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=registry,
        )  # fmt: skip
