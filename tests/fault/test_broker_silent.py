"""The broker stops answering but keeps its connections open (a frozen host, a partition that drops
packets): a chat admitted meanwhile, or a cancel, is answered with a retryable `unavailable` within
the edge's `admit_timeout_s`, not a socket held until the edge's drain gives up on it, and chats are
served again once the broker answers. A record a consumer dead-letters meanwhile is skipped within
`PARK_WITHIN_S`, not a consuming loop held for good.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from aiokafka import ConsumerRecord

from services.edge.settings import EdgeSettings
from shared.chat_client import ChatSocket
from shared.infra import kafka
from shared.infra.command import create_topics
from shared.kafka_clients import PARK_WITHIN_S, DeadLetters, make_producer
from shared.service_settings import KafkaSettings
from shared.topics import TopicLayout
from tests.conftest import start_fleet
from tests.fault.conftest import freeze

ADMIT_TIMEOUT_S = EdgeSettings.model_fields["admit_timeout_s"].default
SLACK_S = 3.0  # the refusal's trip back, on a loaded machine


async def test_a_chat_is_refused_in_time_while_the_broker_is_silent(own_broker, fleet_logs, monkeypatch):
    layout = TopicLayout(prefix=f"silent-{int(time.time())}", requests_partitions=2, tokens_partitions=2)
    create_topics(own_broker, layout)
    monkeypatch.setenv("DRIVETRAIN_KAFKA_BOOTSTRAP", own_broker.kafka_bootstrap)
    fleet = start_fleet(layout, fleet_logs, model="echo", edges=1, routers=1, workers=1, echo_delay_ms=20)
    broker = kafka.broker_pid(own_broker)
    assert broker is not None
    sock = await ChatSocket.open(fleet.spec.chat_url(0))
    try:
        await sock.chat("long", " ".join(f"w{i}" for i in range(300)))  # 6 s of tokens
        assert (await sock.next_frame("long"))["type"] == "accepted"
        assert (await sock.next_frame("long"))["type"] == "token"
        freeze(broker)
        sent = time.monotonic()
        await sock.send({"type": "cancel", "id": "long"})
        await sock.chat("silent", "nobody takes this")
        # A socket's frames are taken one after the other: the cancel's answer, then the chat's.
        cancel = await sock.collect("long", timeout=ADMIT_TIMEOUT_S + SLACK_S)  # tokens sent before, then this
        assert unavailable(cancel.final)
        result = await sock.collect("silent", timeout=ADMIT_TIMEOUT_S + SLACK_S)
        assert [frame["type"] for frame in result.frames] == ["accepted", "error"], result.frames
        assert unavailable(result.final)
        assert time.monotonic() - sent < 2 * ADMIT_TIMEOUT_S + SLACK_S

        os.kill(broker, signal.SIGCONT)
        await sock.chat("back", "the broker answers again")
        served = await sock.collect("back", timeout=30)
        assert served.final is not None and served.final["type"] == "done", served.frames[-1:]
        assert served.text == "the broker answers again"
    finally:
        os.kill(broker, signal.SIGCONT)  # stopped or not, so the teardown can stop it
        await sock.close()
        await asyncio.to_thread(fleet.stop)


async def test_a_record_is_skipped_in_time_when_the_broker_is_silent_to_its_dead_letter(own_broker):
    layout = TopicLayout(prefix=f"silent-park-{int(time.time())}")
    create_topics(own_broker, layout)
    producer = make_producer(KafkaSettings(bootstrap=own_broker.kafka_bootstrap), client_id="parker")
    await producer.start()
    letters = DeadLetters(producer, layout.dead_letter, "parker")
    poison = ConsumerRecord(layout.requests, 0, 7, 0, 0, None, b"\xff not a request", None, 0, 16, ())
    broker = kafka.broker_pid(own_broker)
    assert broker is not None
    try:
        await letters.park(poison, "garbage")  # a broker that answers takes it
        freeze(broker)
        started = time.monotonic()
        await letters.park(poison, "garbage")
        assert time.monotonic() - started < PARK_WITHIN_S + SLACK_S
    finally:
        os.kill(broker, signal.SIGCONT)
        await producer.stop()


def unavailable(final: dict | None) -> bool:
    return final is not None and (final["type"], final["code"], final["retryable"]) == ("error", "unavailable", True)
