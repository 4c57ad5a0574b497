"""The local infrastructure: `ensure_up` brings a real Kafka broker and Redis Cluster up.

Needs java (and mvn on the first run) and redis-server; `make test` installs them,
and their absence fails these tests with a message naming what is missing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from redis.asyncio.cluster import ClusterNode, RedisCluster

from shared.infra.command import ensure_up
from shared.infra.command import main as infra_main
from shared.infra.redis_cluster import status as redis_status
from shared.infra.settings import InfraSettings
from shared.infra.topics import describe_partitions, ensure_topics, plan_topics
from shared.settings import SettingsError, load
from shared.topics import TopicLayout


@pytest.fixture
async def admin(infra: InfraSettings) -> AsyncIterator[AIOKafkaAdminClient]:
    client = AIOKafkaAdminClient(bootstrap_servers=infra.kafka_bootstrap)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def scratch_topic(admin: AIOKafkaAdminClient) -> AsyncIterator[str]:
    """A throw-away topic, so tests never write into the project's own topics."""
    name = f"drivetrain.test.infra-{uuid.uuid4().hex[:8]}"
    await admin.create_topics([NewTopic(name, 2, 1)])
    try:
        yield name
    finally:
        await admin.delete_topics([name])


def test_status_says_all_up(infra: InfraSettings, capsys: pytest.CaptureFixture[str]) -> None:
    assert infra_main(["status"]) == 0
    out = capsys.readouterr().out
    assert "kafka  up" in out and infra.kafka_bootstrap in out
    assert "redis  up" in out


async def test_project_topics_have_the_layout_partition_counts(
    infra: InfraSettings, admin: AIOKafkaAdminClient
) -> None:
    wanted = infra.topics.partitions()
    assert len(wanted) == 6  # requests, tokens, control, dead-letter, usage, kv-events
    assert await describe_partitions(admin, list(wanted)) == wanted


async def test_ensure_topics_creates_then_grows_then_leaves_alone(
    admin: AIOKafkaAdminClient,
) -> None:
    name = f"drivetrain.test.grow-{uuid.uuid4().hex[:8]}"
    try:
        created = await ensure_topics(admin, {name: 1})
        assert created.create == {name: 1}
        grown = await ensure_topics(admin, {name: 3})
        assert grown.grow == {name: 3} and not grown.create
        again = await ensure_topics(admin, {name: 3})
        assert again.is_empty
        assert await describe_partitions(admin, [name]) == {name: 3}
    finally:
        await admin.delete_topics([name])


def test_redis_cluster_has_three_masters_with_linked_replicas(infra: InfraSettings) -> None:
    current = redis_status(infra)
    assert current.ready
    assert (current.masters, current.replicas, current.replicas_linked) == (3, 3, 3)
    assert all(node.cluster_state == "ok" for node in current.nodes)


async def test_redis_cluster_set_get_through_redis_py(infra: InfraSettings) -> None:
    nodes = [ClusterNode(host, port) for host, port in infra.redis_startup_nodes()]
    client = RedisCluster(startup_nodes=nodes, decode_responses=True)
    try:
        await asyncio.wait_for(client.initialize(), 10)
        assert len(client.get_primaries()) == 3 and len(client.get_replicas()) == 3
        # Keys in different slots land on different masters.
        values = {f"infra-test:{i}:{uuid.uuid4().hex}": str(i) for i in range(20)}
        for key, value in values.items():
            assert await client.set(key, value, ex=60)
        for key, value in values.items():
            assert await client.get(key) == value
        await client.delete(*values)
    finally:
        await client.aclose()


async def test_kafka_round_trip_with_idempotent_producer_and_manual_commit(
    infra: InfraSettings, scratch_topic: str
) -> None:
    bootstrap = infra.kafka_bootstrap
    sent = [f"message-{i}".encode() for i in range(50)]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for i, value in enumerate(sent):
            await producer.send(scratch_topic, value, key=str(i % 7).encode())
        await asyncio.wait_for(producer.flush(), 10)
    finally:
        await producer.stop()

    group = f"infra-test-{uuid.uuid4().hex[:8]}"
    consumer = AIOKafkaConsumer(
        scratch_topic, bootstrap_servers=bootstrap, group_id=group,
        enable_auto_commit=False, auto_offset_reset="earliest", fetch_max_wait_ms=50,
    )  # fmt: skip
    started = time.monotonic()
    await asyncio.wait_for(consumer.start(), 15)
    try:
        received: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(received) < len(sent) and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            received += [m.value for msgs in batches.values() for m in msgs]
        first_group_s = time.monotonic() - started
        assert sorted(received) == sorted(sent)
        await consumer.commit()
        partitions = [TopicPartition(scratch_topic, p) for p in range(2)]
        ends = await consumer.end_offsets(partitions)
        for tp in partitions:
            assert await consumer.committed(tp) == ends[tp]
    finally:
        await consumer.stop()
    # The coordinator was warmed by `up`, so a fresh group does not wait long.
    assert first_group_s < 10, f"first consumer group took {first_group_s:.1f} s"


def test_second_ensure_up_is_fast(infra: InfraSettings) -> None:
    started = time.monotonic()
    ensure_up(infra)
    assert time.monotonic() - started < 5.0


# --- pure parts, no services -------------------------------------------------------


def test_plan_topics_creates_grows_and_refuses_to_shrink() -> None:
    plan = plan_topics(
        existing={"a": 4, "b": 2, "c": 8},
        wanted={"a": 4, "b": 6, "c": 2, "d": 1},
    )
    assert plan.create == {"d": 1}
    assert plan.grow == {"b": 6}
    assert plan.cannot_shrink == {"c": (8, 2)}
    assert plan_topics({"a": 4}, {"a": 4}).is_empty


def test_settings_read_drivetrain_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "DRIVETRAIN_INFRA_DIR": str(tmp_path),
        "DRIVETRAIN_KAFKA_PORT": "19092",
        "DRIVETRAIN_KAFKA_READY_TIMEOUT_S": "12.5",
        "DRIVETRAIN_REDIS_PORTS": "8000-8005",
        "DRIVETRAIN_TOPICS_REQUESTS_PARTITIONS": "16",
        "DRIVETRAIN_TOPICS_PREFIX": "trial",
    }.items():
        monkeypatch.setenv(name, value)
    cfg = InfraSettings()
    assert cfg.infra_dir == tmp_path.resolve()
    assert cfg.kafka_bootstrap == "127.0.0.1:19092"
    assert cfg.kafka_ready_timeout_s == 12.5
    assert cfg.redis_startup_nodes()[0] == ("127.0.0.1", 8000) and len(cfg.redis_ports) == 6
    assert cfg.topics == TopicLayout(prefix="trial", requests_partitions=16)
    # The same settings as flags, which win over the environment.
    assert load(InfraSettings, ["--kafka-port", "19093", "--redis-ports", "9000,9001,9002,9003,9004,9005"]).kafka_port == 19093
    with pytest.raises(SettingsError, match="3 masters"):
        load(InfraSettings, ["--redis-ports", "8000,8001,8002"])
