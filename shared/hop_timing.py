"""Where a token's time goes: one histogram, labelled by hop, for each hop of the request and token path.

Each service observes the hops that end inside it, from timestamps that already travel: a
Kafka record's CreateTime, a token batch's `sent_at`, a router frame's `sent_at`. Hops that
cross processes compare clocks of two hosts (one clock on one machine; NTP keeps hosts within
about a millisecond). Observations are per chat, per Kafka record, per link frame or per
socket frame (one in SOCKET_WRITE_SAMPLE), never per token inside a batch, so the cost stays a
few microseconds per message.
"""

from __future__ import annotations

from enum import StrEnum

from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry, Histogram

METRIC = "drivetrain_token_path_hop_seconds"
# Hops on one machine take tens of microseconds to milliseconds; a stall, up to seconds.
HOP_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

SOCKET_WRITE_SAMPLE = 4  # socket writes come one per token: an edge observes one in this many


class Hop(StrEnum):
    """In path order; the service that observes a hop is the one where it ends."""

    ADMISSION = "admission"  # edge: chat frame received -> request handed to the producer (route written)
    REQUEST_KAFKA = "request_kafka"  # worker: request produced -> consumed
    WORKER_START = "worker_start"  # worker: request consumed -> its first token produced (one model step included)
    TOKEN_KAFKA = "token_kafka"  # router: token batch produced -> consumed
    ROUTE = "route"  # router: token batch consumed -> forwarded to its edge (routing map, link write)
    LINK = "link"  # edge: forwarded -> read off the link and queued on the client connections
    SOCKET_WRITE = "socket_write"  # edge: queued -> written on the client's socket


def hop_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        METRIC, "Time spent on each hop of the request and token path, per message", ["hop"],
        buckets=HOP_BUCKETS, registry=registry,
    )  # fmt: skip


class HopTimer:
    """The hops one service observes, bound once: a labelled observe looks its child up every time."""

    def __init__(self, registry: CollectorRegistry, *hops: Hop) -> None:
        histogram = hop_histogram(registry)
        self._children = {hop: histogram.labels(hop.value) for hop in hops}

    def observe(self, hop: Hop, seconds: float) -> None:
        # Two clocks can disagree by a little: a negative time is a zero, not a shrinking sum.
        self._children[hop].observe(max(0.0, seconds))


class EveryNth:
    """Observes one message in `n` of a hop that sees one per token: a histogram needs no more, and
    a per-frame observe was a few percent of a busy edge's CPU."""

    def __init__(self, timer: HopTimer, hop: Hop, n: int) -> None:
        self._timer = timer
        self._hop = hop
        self._n = n
        self._seen = 0

    def __call__(self, seconds: float) -> None:
        self._seen += 1
        if self._seen >= self._n:
            self._seen = 0
            self._timer.observe(self._hop, seconds)


def produced_at(record: ConsumerRecord) -> float:
    """When the record was produced, in unix seconds. CreateTime is whole milliseconds, truncated:
    the middle of its millisecond is the unbiased guess."""
    return (record.timestamp + 0.5) / 1000.0
