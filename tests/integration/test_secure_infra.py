"""The secure infrastructure (`drivetrain infra up --secure`): a fleet logged in per role serves a
chat; no login, or another role's login, is refused by Kafka and by Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.launcher.fleet import Fleet
from shared.chat_client import ChatSocket
from shared.infra import command, credentials
from shared.infra.credentials import InfraSecrets
from shared.infra.permissions import SERVICE_ROLES, Role
from shared.infra.settings import InfraSettings
from shared.topics import TopicLayout
from tests.conftest import start_fleet

COMPONENTS = command.COMPONENTS


@pytest.fixture(scope="module")
def secure() -> Iterator[tuple[InfraSettings, InfraSecrets]]:
    """The secure infrastructure, up; started here (and purged again) unless it already ran."""
    cfg = InfraSettings(secure=True)
    was_up, _ = command.status_lines(cfg, COMPONENTS)
    command.up(cfg, COMPONENTS, report=lambda _: None)
    yield cfg, credentials.require(cfg)
    if not was_up:
        command.down(cfg, COMPONENTS, purge=True, report=lambda _: None)


@pytest.fixture(scope="module")
def secure_topics(secure) -> TopicLayout:
    cfg, _ = secure
    layout = TopicLayout(prefix=f"secure-{uuid.uuid4().hex[:8]}", requests_partitions=2, tokens_partitions=2)
    command.create_topics(cfg, layout)  # as admin, granting each role its share
    return layout


@pytest.fixture(scope="module")
def secure_fleet(secure, secure_topics, fleet_logs) -> Iterator[Fleet]:
    cfg, found = secure
    role_env = {str(role): credentials.role_env(cfg, found, role) for role in SERVICE_ROLES}
    fleet = start_fleet(secure_topics, fleet_logs, edges=1, routers=1, workers=1, model="echo", role_env=role_env)
    yield fleet
    fleet.stop()


def kafka_login(found: InfraSecrets, role: Role) -> dict[str, str]:
    return {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": str(role),
        "sasl_plain_password": found.kafka[role],
    }


def redis_node(cfg: InfraSettings, **login: str) -> redis.Redis:
    # No retries: a refusal is the answer, not a reason to try again with backoff.
    return redis.Redis(host=cfg.redis_host, port=cfg.redis_ports[0], socket_timeout=2, retry=Retry(NoBackoff(), 0), **login)


async def test_a_fleet_logged_in_per_role_serves_a_chat(secure_fleet):
    sock = await ChatSocket.open(secure_fleet.spec.chat_url(0))
    try:
        await sock.chat("c1", "secure hello world")
        result = await sock.collect("c1")
    finally:
        await sock.close()
    assert result.text == "secure hello world"
    assert result.final["type"] == "done", result.final


async def test_kafka_refuses_a_client_without_credentials(secure, secure_topics):
    cfg, found = secure
    for login in ({}, {**kafka_login(found, Role.EDGE), "sasl_plain_password": "wrong"}):
        producer = AIOKafkaProducer(bootstrap_servers=cfg.kafka_bootstrap, request_timeout_ms=3000, **login)
        try:
            with pytest.raises(KafkaConnectionError):
                await producer.start()
        finally:
            await producer.stop()


async def test_edge_credentials_cannot_read_the_tokens_topic(secure, secure_topics):
    cfg, found = secure

    async def start_reader(role: Role) -> None:
        consumer = AIOKafkaConsumer(
            secure_topics.tokens, bootstrap_servers=cfg.kafka_bootstrap, group_id=None, **kafka_login(found, role)
        )
        try:
            await consumer.start()
        finally:
            await consumer.stop()

    await start_reader(Role.ROUTER)  # the role that reads tokens may
    with pytest.raises(TopicAuthorizationFailedError):
        await start_reader(Role.EDGE)


async def test_edge_credentials_cannot_write_the_tokens_topic(secure, secure_topics):
    cfg, found = secure
    producer = AIOKafkaProducer(bootstrap_servers=cfg.kafka_bootstrap, **kafka_login(found, Role.EDGE))
    await producer.start()
    try:
        await producer.send_and_wait(secure_topics.requests, b"allowed", key=b"k")
        with pytest.raises(TopicAuthorizationFailedError):
            await producer.send_and_wait(secure_topics.tokens, b"forged", key=b"k")
    finally:
        await producer.stop()


def test_redis_refuses_a_client_without_credentials(secure):
    cfg, found = secure
    with pytest.raises(redis.AuthenticationError):
        redis_node(cfg).ping()
    with pytest.raises(redis.AuthenticationError):
        redis_node(cfg, username=str(Role.WORKER), password="wrong").ping()


def test_each_redis_user_is_limited_to_its_own_commands_and_keys(secure):
    cfg, found = secure
    worker = redis_node(cfg, username=str(Role.WORKER), password=found.redis[Role.WORKER])
    assert worker.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.flushall()
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.hset("route:{some-request}", "edge", "forged")  # routes are the edge's to write
    router = redis_node(cfg, username=str(Role.ROUTER), password=found.redis[Role.ROUTER])
    with pytest.raises(redis.exceptions.NoPermissionError):
        router.get("claim:{some-request}")  # a router writes claims; workers read them
