"""Which requests-topic partitions each worker owns, as workers publish it in gossip.

Workers are one consumer group on the requests topic; each publishes its share of the
partitions among its member addresses (key `requests`: the partitions are where its work is
sent), and edges read them to send a request to the worker they chose. Gossip lags a
rebalance, so two workers may briefly claim one partition: a request sent there is served by
whoever owns it then, so this map steers placement only and never decides correctness.
"""

from __future__ import annotations

from collections.abc import Iterable

REQUESTS_ADDRESS = "requests"
MAX_PARTITION = 2**16  # far above any requests topic; bounds what a malformed entry can claim


def format_partitions(partitions: Iterable[int]) -> str:
    """Sorted ranges: {0, 1, 2, 5} -> "0-2,5"; no partitions -> ""."""
    ranges: list[str] = []
    run: list[int] = []
    for p in sorted(set(partitions)):
        if run and p != run[-1] + 1:
            ranges.append(_range(run))
            run = []
        run.append(p)
    if run:
        ranges.append(_range(run))
    return ",".join(ranges)


def parse_partitions(text: str) -> frozenset[int]:
    """The partitions of `format_partitions`' text; ValueError if it is not such text."""
    found: set[int] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        low, _, high = item.partition("-")
        first, last = int(low), int(high or low)
        if not 0 <= first <= last < MAX_PARTITION:
            raise ValueError(f"bad partition range {item!r}")
        found.update(range(first, last + 1))
    return frozenset(found)


def _range(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
