"""Test-wide settings and helpers: Triton in the interpreter on machines without a GPU; a real
Kafka and Redis Cluster for integration and fault tests; fleets of real service processes; a tap
that reads what the services put on a topic.

Each test session works under its own topic prefix, so leftovers of earlier runs never reach it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Must be set before triton compiles any kernel; on a CPU the engine itself uses
# the PyTorch references, so this only affects the kernel-versus-reference tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

from services.launcher.fleet import Fleet  # noqa: E402
from services.launcher.spec import FleetSpec  # noqa: E402
from shared import wire  # noqa: E402
from shared.infra.command import drop_topics, ensure_up, fresh_topics  # noqa: E402
from shared.infra.settings import InfraSettings  # noqa: E402
from shared.membership.settings import MembershipSettings  # noqa: E402
from shared.seal import Seal  # noqa: E402
from shared.topics import TopicLayout  # noqa: E402

# Separate runs on one machine can set their own ports; every port of a test fleet follows this one.
TEST_PORT = int(os.environ.get("DRIVETRAIN_TEST_BASE_PORT", "18080"))
RESUME_GRACE_S = 2.0  # short, so tests of a dropped socket need not wait long
# Test fleets keep the local profile's fleet secret: with it a test reads sealed records (or forges them).
FLEET_SECRET = MembershipSettings().secret_bytes
FLEET_SEAL = Seal(FLEET_SECRET, "test")


@pytest.fixture(scope="session")
def infra() -> InfraSettings:
    return ensure_up()


@pytest.fixture(scope="session")
def topics(infra) -> Iterator[TopicLayout]:
    layout = fresh_topics("test")
    yield layout
    drop_topics(layout)


@pytest.fixture(scope="session")
def fleet_logs(tmp_path_factory) -> Path:
    path = Path(os.environ.get("DRIVETRAIN_TEST_LOGS") or tmp_path_factory.mktemp("fleet-logs"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def fleet_env(topics: TopicLayout) -> dict[str, str]:
    return {"DRIVETRAIN_TOPICS_PREFIX": topics.prefix, "DRIVETRAIN_RESUME_GRACE_S": str(RESUME_GRACE_S)}


async def eventually(check: Callable[[], bool], within_s: float = 10.0, what: str = "the condition") -> None:
    """Until `check()` holds; fails naming `what` if it does not within `within_s`."""
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not reached within {within_s} s"
        await asyncio.sleep(0.05)


async def gossip_until(fleet: Fleet, topics: TopicLayout, ready: Callable[[list[dict]], bool], what: str,
                       within_s: float = 30.0) -> None:  # fmt: skip
    """Until the first edge's gossip view (its member rows) satisfies `ready`."""
    from shared.membership import query_members

    config = MembershipSettings(cluster_name=topics.prefix)
    deadline = time.monotonic() + within_s
    while not ready(await query_members(("127.0.0.1", fleet.spec.base_gossip_port), config)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} never showed in gossip")
        await asyncio.sleep(0.2)


def start_fleet(topics: TopicLayout, log_dir: Path, **spec: object) -> Fleet:
    """A fleet on the test ports and its own topics, serving on return (stopped again if it fails)."""
    fleet_spec = FleetSpec.at(TEST_PORT, extra_env=fleet_env(topics), **spec)
    fleet = Fleet(fleet_spec, log_dir=log_dir, echo_logs=False)
    fleet.start(ready_timeout_s=120)
    return fleet


class KafkaTap:
    """Reads a topic from 'now' on, so a test can see what the services put on the wire."""

    def __init__(self, infra: InfraSettings, topic: str, partitions: int) -> None:
        from aiokafka import AIOKafkaConsumer

        self._topic = topic
        self._partitions = partitions
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=infra.kafka_bootstrap, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=20
        )

    async def __aenter__(self) -> KafkaTap:
        from aiokafka import TopicPartition

        await self._consumer.start()
        tps = [TopicPartition(self._topic, p) for p in range(self._partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_end(*tps)
        for tp in tps:
            await self._consumer.position(tp)  # resolve 'end' now, before the test acts
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def records(self, timeout: float) -> list[bytes]:
        batches = await self._consumer.getmany(timeout_ms=int(timeout * 1000))
        return [r.value for part in batches.values() for r in part]

    async def messages(self, kind: type, timeout: float) -> list:
        """The sealed records as messages (each checked against the fleet secret)."""
        return [FLEET_SEAL.decode(self._topic, value, kind)[1] for value in await self.records(timeout)]

    async def events_until(self, done: Callable[[wire.Event], bool], timeout: float) -> list[wire.Event]:
        """Token-path events seen until one satisfies `done` (TimeoutError if none does in time)."""
        events: list[wire.Event] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for batch in await self.messages(wire.TokenBatch, 0.2):
                for event in batch.events:
                    events.append(event)
                    if done(event):
                        return events
        raise TimeoutError(f"no matching event on {self._topic} in {timeout} s")
