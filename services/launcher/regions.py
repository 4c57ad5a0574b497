"""`drivetrain up --regions N`: N local regions on one machine, each a whole fleet of its own.

Region k (r1, r2, ...) has its own topics (PREFIX-rk.*, so its own consumer groups and gossip
cluster: the cluster is named by the prefix), its own edges, workers and routers on ports
REGION_PORT_STEP apart, and every other region as a peer, reached at that region's first edge
with `added_delay_ms` added each way. They share the one local Redis Cluster (request ids never
collide; tenants' limits are then one over both, docs/operations.md#regions) and one summary topic.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.edge.region_settings import RegionSettings
from services.launcher.fleet import Fleet
from services.launcher.spec import FleetSpec
from shared.infra import kafka
from shared.infra.command import create_topics, drop_topics
from shared.infra.process import run_sync
from shared.infra.settings import InfraSettings
from shared.infra.topics import ensure_topics
from shared.topics import TopicLayout

REGION_PORT_STEP = 500  # region k's ports are region 1's + (k - 1) * this: 8080, 8580, ...; clear of 9092 and 7000-7005
ADDED_DELAY_MS = 35.0  # one way, between local regions: a round trip of 70 ms, as between nearby cloud regions
SUMMARY_TOPIC = RegionSettings.model_fields["summary_topic"].default


@dataclass(frozen=True)
class LocalRegion:
    name: str
    topics: TopicLayout
    spec: FleetSpec = field(repr=False)


def region_name(k: int) -> str:
    return f"r{k}"


def local_regions(
    count: int,
    base_port: int,
    prefix: str = "drivetrain",
    summary_topic: str = SUMMARY_TOPIC,
    added_delay_ms: float = ADDED_DELAY_MS,
    extra_env: dict[str, str] | None = None,
    region_env: dict[str, dict[str, str]] | None = None,
    partitions: int | None = None,
    **fleet: object,
) -> list[LocalRegion]:
    """Each region's fleet, peers configured both ways; `region_env` adds (or overrides) per region."""
    names = [region_name(k) for k in range(1, count + 1)]
    bases = {name: base_port + i * REGION_PORT_STEP for i, name in enumerate(names)}
    urls = {name: FleetSpec.at(base).chat_url(0) for name, base in bases.items()}
    regions = []
    for name in names:
        peers = [{"name": other, "edge_url": urls[other], "rtt_ms": 2 * added_delay_ms} for other in names if other != name]
        sizes = {"requests_partitions": partitions, "tokens_partitions": partitions} if partitions else {}
        topics = TopicLayout(prefix=f"{prefix}-{name}", **sizes)
        env = {
            **(extra_env or {}),
            "DRIVETRAIN_TOPICS_PREFIX": topics.prefix,
            "DRIVETRAIN_REGIONS_NAME": name,
            "DRIVETRAIN_REGIONS_PEERS": json.dumps(peers),
            "DRIVETRAIN_REGIONS_SUMMARY_TOPIC": summary_topic,
            "DRIVETRAIN_REGIONS_ADDED_DELAY_MS": str(added_delay_ms),
            **(region_env or {}).get(name, {}),
        }
        regions.append(LocalRegion(name, topics, FleetSpec.at(bases[name], extra_env=env, **fleet)))
    return regions


def create_region_topics(infra: InfraSettings, regions: list[LocalRegion], summary_topic: str = SUMMARY_TOPIC) -> None:
    """Every region's topics and the one summary topic (a single partition: one order for all)."""
    for region in regions:
        create_topics(infra, region.topics)

    async def create() -> None:
        async with kafka.open_admin(infra) as admin:
            await ensure_topics(admin, {summary_topic: 1})

    run_sync(create)


def drop_region_topics(infra: InfraSettings, regions: list[LocalRegion], summary_topic: str) -> None:
    """What `create_region_topics` made, deleted again (tests leave the local broker as they found it)."""
    for region in regions:
        drop_topics(region.topics)

    async def drop() -> None:
        async with kafka.open_admin(infra) as admin:
            await admin.delete_topics([summary_topic])

    run_sync(drop)


class RegionFleets:
    """Several regions' fleets started, supervised and stopped as one (`Fleet`'s start, supervise, stop)."""

    def __init__(self, regions: list[LocalRegion], fleets: list[Fleet]) -> None:
        self.regions = regions
        self.fleets = fleets

    def start(self, ready_timeout_s: float = 120.0) -> None:
        """Every region at once; if one fails, every region is stopped again."""
        try:
            with ThreadPoolExecutor(len(self.fleets)) as pool:
                list(pool.map(lambda fleet: fleet.start(ready_timeout_s), self.fleets))
        except BaseException:
            self.stop()
            raise

    def supervise(self) -> None:
        for fleet in self.fleets:
            fleet.supervise()

    def stop(self) -> None:
        """All at once: each drains as one fleet does, and a region's drain does not wait for another's."""
        with ThreadPoolExecutor(len(self.fleets)) as pool:
            list(pool.map(Fleet.stop, self.fleets))


def region_fleets(regions: list[LocalRegion], log_dir: Path | None, **options: Any) -> RegionFleets:
    """One Fleet per region, its children's log lines labelled with the region (and in a folder of its own)."""
    fleets = []
    for region in regions:
        region_logs = log_dir / region.name if log_dir else None
        if region_logs:
            region_logs.mkdir(parents=True, exist_ok=True)
        fleets.append(Fleet(region.spec, log_dir=region_logs, label=f"{region.name}/", **options))
    return RegionFleets(regions, fleets)
