"""Makes the broker ready for the project: its topics (from `TopicLayout`), a group coordinator.

Idempotent: missing topics are created, a partition count that grew is increased,
existing topics are otherwise left alone (Kafka cannot remove partitions).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.errors import KafkaError

from shared.infra.errors import InfraError
from shared.topics import TOPIC_CONFIGS

UNKNOWN_TOPIC_OR_PARTITION = 3
TOPIC_ALREADY_EXISTS = 36
# Single local node: one copy of each partition is all there can be.
REPLICATION_FACTOR = 1


@dataclass(frozen=True)
class TopicPlan:
    """What has to change so that the broker's topics match the layout."""

    create: dict[str, int]  # topic -> partitions, for topics that do not exist
    grow: dict[str, int]  # topic -> new total, for topics with too few partitions
    cannot_shrink: dict[str, tuple[int, int]]  # topic -> (existing, wanted)

    @property
    def is_empty(self) -> bool:
        return not self.create and not self.grow


def plan_topics(existing: Mapping[str, int], wanted: Mapping[str, int]) -> TopicPlan:
    """Compare partition counts on the broker (`existing`) with the layout (`wanted`)."""
    create = {name: n for name, n in wanted.items() if name not in existing}
    grow = {name: n for name, n in wanted.items() if name in existing and existing[name] < n}
    cannot_shrink = {
        name: (existing[name], n)
        for name, n in wanted.items()
        if name in existing and existing[name] > n
    }
    return TopicPlan(create=create, grow=grow, cannot_shrink=cannot_shrink)


async def describe_partitions(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    """Partition counts of those of `names` that exist, ignoring the missing ones."""
    counts: dict[str, int] = {}
    for topic in await admin.describe_topics(names):
        if topic["error_code"] == UNKNOWN_TOPIC_OR_PARTITION:
            continue
        counts[topic["topic"]] = len(topic["partitions"])
    return counts


async def _all_leaders_elected(admin: AIOKafkaAdminClient, wanted: Mapping[str, int]) -> bool:
    for topic in await admin.describe_topics(list(wanted)):
        partitions = topic["partitions"]
        if topic["error_code"] or len(partitions) < wanted[topic["topic"]]:
            return False
        if any(p["error_code"] or p["leader"] < 0 for p in partitions):
            return False
    return True


async def ensure_topics(
    admin: AIOKafkaAdminClient, wanted: Mapping[str, int], timeout_s: float = 30.0
) -> TopicPlan:
    """Apply the plan, then wait until every partition has a leader.

    Waiting for leaders spares the first producer a LeaderNotAvailable retry.
    """
    existing = await describe_partitions(admin, list(wanted))
    plan = plan_topics(existing, wanted)
    if plan.create:
        response = await admin.create_topics(
            [NewTopic(name, n, REPLICATION_FACTOR, topic_configs=TOPIC_CONFIGS) for name, n in plan.create.items()]
        )
        for name, code, message in response.topic_errors:
            # Another `up` racing this one may have created it first: that is fine.
            if code not in (0, TOPIC_ALREADY_EXISTS):
                raise InfraError(f"could not create topic {name}: error {code} {message}")
    if plan.grow:
        await admin.create_partitions(
            {name: NewPartitions(total_count=n) for name, n in plan.grow.items()}
        )
    deadline = time.monotonic() + timeout_s
    while not await _all_leaders_elected(admin, wanted):
        if time.monotonic() > deadline:
            raise InfraError(f"topics {sorted(wanted)} have no leaders after {timeout_s:.0f} s")
        await asyncio.sleep(0.1)
    return plan


async def warm_group_coordinator(admin: AIOKafkaAdminClient, timeout_s: float = 30.0) -> None:
    """Wait until a group coordinator answers.

    The first FindCoordinator creates __consumer_offsets; doing it here means the
    first consumer group of a test or service does not pay for it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await admin.find_coordinator("drivetrain-infra-warmup")
            return
        except KafkaError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def prepare_broker(admin: AIOKafkaAdminClient, wanted: Mapping[str, int]) -> TopicPlan:
    """Topics as `wanted` says, every partition led, and the group coordinator up."""
    plan = await ensure_topics(admin, wanted)
    await warm_group_coordinator(admin)
    return plan
