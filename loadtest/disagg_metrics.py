"""The disaggregation benchmark's view of the workers' own counters: handoffs by outcome, KV link
bytes by direction and the handoff-time histogram, scraped before and after a phase so their
difference is that phase's. What the KV of a prompt should weigh is computed from the model's shape.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field

from pipeline_hops import HopCounts
from prometheus_client.parser import text_string_to_metric_families

from shared.models.shapes import ModelConfig

HANDOFFS = "drivetrain_worker_handoffs"  # the parser drops a counter's _total from the family name
KV_BYTES = "drivetrain_worker_kv_link_bytes"
HANDOFF_SECONDS = "drivetrain_worker_handoff_seconds"
REQUESTS = "drivetrain_worker_requests"  # taken from Kafka: where the edge placed each chat
SCRAPE_TIMEOUT_S = 5.0
FLOAT32_BYTES = 4  # the CPU's default KV dtype (engine.dtype auto)


@dataclass
class WorkerCounters:
    """The KV link's counters summed over the workers scraped."""

    handoffs: dict[str, float] = field(default_factory=dict)  # outcome -> count
    kv_bytes: dict[str, float] = field(default_factory=dict)  # direction -> bytes
    seconds: HopCounts = field(default_factory=HopCounts)
    requests_by_worker: list[float] = field(default_factory=list)  # in the order of the ports scraped

    def minus(self, earlier: WorkerCounters) -> WorkerCounters:
        return WorkerCounters(
            {k: v - earlier.handoffs.get(k, 0.0) for k, v in self.handoffs.items()},
            {k: v - earlier.kv_bytes.get(k, 0.0) for k, v in self.kv_bytes.items()},
            self.seconds.minus(earlier.seconds),
            [now - before for now, before in zip(self.requests_by_worker, earlier.requests_by_worker)],
        )


def parse(text: str, into: WorkerCounters) -> None:
    into.requests_by_worker.append(0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == REQUESTS and sample.name.endswith("_total"):
                into.requests_by_worker[-1] += sample.value
            elif family.name == HANDOFFS and sample.name.endswith("_total"):
                outcome = sample.labels["outcome"]
                into.handoffs[outcome] = into.handoffs.get(outcome, 0.0) + sample.value
            elif family.name == KV_BYTES and sample.name.endswith("_total"):
                direction = sample.labels["direction"]
                into.kv_bytes[direction] = into.kv_bytes.get(direction, 0.0) + sample.value
            elif family.name == HANDOFF_SECONDS and sample.name == HANDOFF_SECONDS + "_bucket":
                le = float(sample.labels["le"])
                into.seconds.buckets[le] = into.seconds.buckets.get(le, 0.0) + sample.value
            elif family.name == HANDOFF_SECONDS and sample.name == HANDOFF_SECONDS + "_sum":
                into.seconds.sum += sample.value


def scrape(ports: list[int]) -> WorkerCounters:
    counters = WorkerCounters()
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
            parse(response.read().decode(), counters)
    return counters


def handoff_figures(phase: WorkerCounters) -> dict[str, float | dict[str, int]]:
    """Per landed handoff: bytes the prefill side sent and the decode side received, and the time
    from connecting to the commit (mean from the histogram's sum, quantiles from its buckets)."""
    landed = phase.handoffs.get("handed_off", 0.0)
    seconds = phase.seconds
    per = (lambda total: total / landed) if landed > 0 else (lambda total: math.nan)
    return {
        "outcomes": {k: int(v) for k, v in sorted(phase.handoffs.items())},
        "handoffs": int(landed),
        "bytes_sent": int(phase.kv_bytes.get("sent", 0.0)),
        "bytes_received": int(phase.kv_bytes.get("received", 0.0)),
        "bytes_per_handoff": per(phase.kv_bytes.get("sent", 0.0)),
        "seconds_mean": seconds.sum / seconds.count if seconds.count > 0 else math.nan,
        "seconds_p50": seconds.quantile(0.5),
        "seconds_p99": seconds.quantile(0.99),
        "timed_handoffs": int(seconds.count),
    }


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype_bytes: int = FLOAT32_BYTES) -> int:
    """K and V of every layer for one block: layers x 2 x block_size x kv_heads x head_dim x dtype."""
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * dtype_bytes


def expected_prompt_bytes(prompt_tokens: int, config: ModelConfig, block_size: int) -> int:
    """What a handoff of a prompt no decode worker's prefix cache holds moves: all its blocks, the last partial one too."""
    return -(-prompt_tokens // block_size) * kv_bytes_per_block(config, block_size)
