"""The pipeline benchmark's per-hop breakdown, read from the fleet's own hop histograms.

Every service exports `drivetrain_token_path_hop_seconds{hop=...}` (shared/hop_timing.py).
The benchmark scrapes each one before and after a run; the difference is that run's
observations, and its mean and quantiles (interpolated inside a bucket, as Prometheus'
`histogram_quantile` does) say where each millisecond went.
"""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from shared.hop_timing import METRIC, Hop

SCRAPE_TIMEOUT_S = 5.0
TOKEN_PATH = (Hop.TOKEN_KAFKA, Hop.ROUTE, Hop.LINK, Hop.SOCKET_WRITE)  # worker's produce to the client's socket


@dataclass
class HopCounts:
    """One hop's histogram: cumulative counts per upper bound, and the sum of what it observed."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0

    @property
    def count(self) -> float:
        return self.buckets.get(math.inf, 0.0)

    def minus(self, earlier: HopCounts) -> HopCounts:
        return HopCounts({le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()}, self.sum - earlier.sum)

    def quantile(self, q: float) -> float:
        """Seconds, linear inside the bucket that holds the q-th observation; nan when empty."""
        if self.count <= 0:
            return math.nan
        rank, lower, below = q * self.count, 0.0, 0.0
        for le, cumulative in sorted(self.buckets.items()):
            if cumulative >= rank:
                if math.isinf(le):
                    return lower  # beyond the last bound: all that can be said
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, cumulative
        return lower


Snapshot = dict[str, HopCounts]  # hop -> its histogram, summed over the services scraped


def parse(text: str) -> Snapshot:
    hops: Snapshot = defaultdict(HopCounts)
    for family in text_string_to_metric_families(text):
        if family.name != METRIC:
            continue
        for sample in family.samples:
            counts = hops[sample.labels["hop"]]
            if sample.name == METRIC + "_bucket":
                le = float(sample.labels["le"])
                counts.buckets[le] = counts.buckets.get(le, 0.0) + sample.value
            elif sample.name == METRIC + "_sum":
                counts.sum += sample.value
    return dict(hops)


def scrape(urls: list[str]) -> Snapshot:
    total: Snapshot = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            for hop, counts in parse(response.read().decode()).items():
                into = total.setdefault(hop, HopCounts())
                for le, n in counts.buckets.items():
                    into.buckets[le] = into.buckets.get(le, 0.0) + n
                into.sum += counts.sum
    return total


def breakdown(before: Snapshot, after: Snapshot) -> dict[str, dict[str, float]]:
    """Per hop, in path order: messages observed, mean, p50 and p99 in ms, for what happened in between."""
    rows = {}
    for hop in Hop:
        if hop.value not in after:
            continue
        run = after[hop.value].minus(before.get(hop.value, HopCounts()))
        if run.count <= 0:
            continue
        rows[hop.value] = {
            "count": int(run.count),
            "mean_ms": round(run.sum / run.count * 1000, 3),
            "p50_ms": round(run.quantile(0.5) * 1000, 3),
            "p99_ms": round(run.quantile(0.99) * 1000, 3),
        }
    return rows


def token_path(rows: dict[str, dict[str, float]]) -> dict[str, float]:
    """The token path's hops added up: the mean is the path's; summed p50s and p99s only bound it."""
    hops = [rows[hop.value] for hop in TOKEN_PATH if hop.value in rows]
    return {
        "mean_ms": round(sum(h["mean_ms"] for h in hops), 3),
        "p50_sum_ms": round(sum(h["p50_ms"] for h in hops), 3),
        "p99_sum_ms": round(sum(h["p99_ms"] for h in hops), 3),
    }
