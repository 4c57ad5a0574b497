"""The fleet is asked to stop, with its Kafka broker serving or gone for good (`drivetrain infra
down` before the fleet, a lost broker host, possibly before it acknowledged the last chats'
requests): every service stops within its time, exits 0 and closes what it holds (Kafka and
Redis clients, gossip socket) before its stop backstop, with nothing left over for the garbage
collector to report."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from shared.infra import kafka
from shared.infra.command import create_topics
from shared.topics import TopicLayout
from tests.conftest import start_fleet
from tests.fault.conftest import freeze, quiet, start_streams

# What a service's log shows when it exits with a client, socket or task never closed: aiokafka's,
# redis-py's and asyncio's own reports (some logged always, the rest as ResourceWarnings); when its
# shutdown overran its backstop and was cut short (shared/runtime.py); and any error's traceback.
UNCLEAN = ("Unclosed", "unclosed", "Task was destroyed but it is pending", "without finishing the drain", "Traceback")


@pytest.mark.parametrize("broker", ["serving", "gone", "gone mid-admission"])
async def test_every_service_stops_cleanly_and_closes_its_clients(broker: str, own_broker, tmp_path: Path, monkeypatch):
    layout = TopicLayout(prefix=f"gone-{int(time.time())}", requests_partitions=2, tokens_partitions=2)
    create_topics(own_broker, layout)
    monkeypatch.setenv("DRIVETRAIN_KAFKA_BOOTSTRAP", own_broker.kafka_bootstrap)
    monkeypatch.setenv("PYTHONWARNINGS", "always::ResourceWarning")
    logs = tmp_path / "logs"
    logs.mkdir()
    fleet = start_fleet(layout, logs, model="echo", edges=1, routers=1, workers=1)  # its logs, to read here
    children = list(fleet.children.values())
    pid = kafka.broker_pid(own_broker)
    assert pid is not None
    try:
        if broker == "gone mid-admission":
            freeze(pid)  # the chats' requests reach it, and are never acknowledged
        sockets, _ = await start_streams(fleet.spec.chat_url(0), 2, words=20)
        for sock in sockets:
            await sock.close()
        if broker == "gone":
            await asyncio.to_thread(kafka.stop_broker, own_broker, quiet)
        elif broker == "gone mid-admission":
            os.kill(pid, signal.SIGKILL)
        if broker != "serving":
            await asyncio.sleep(3.0)  # every client has seen its connections drop and begun to retry
    finally:
        await asyncio.to_thread(fleet.stop)
    exits = {child.name: child.process.returncode for child in children}
    assert exits == {child.name: 0 for child in children}, exits
    for log in logs.iterdir():
        text = log.read_text(errors="replace")
        left = [line for line in text.splitlines() if any(sign in line for sign in UNCLEAN)]
        assert left == [], f"{log.name}: {left}"
