"""The Kafka broker restarts under streams in flight: every stream completes or ends with a clear
retryable error, no service needs a restart, and new chats work within seconds of its return.

The broker restarted is one of the test's own (same port, same data), so nothing else sharing the
machine's broker sees it go.
"""

from __future__ import annotations

import asyncio
import time

from shared.chat_client import ChatSocket
from shared.infra import kafka
from shared.infra.command import create_topics
from shared.topics import TopicLayout
from tests.conftest import start_fleet
from tests.fault.conftest import finish, intact, quiet, start_streams

OUTAGE_S = 5.0
RECOVERY_S = 15.0  # from the broker answering again to a new chat served


async def chat_served(url: str, text: str) -> bool:
    try:
        sock = await ChatSocket.open(url)
    except (OSError, TimeoutError):
        return False
    try:
        await sock.chat("n", text)
        result = await sock.collect("n", timeout=5)
        return result.final is not None and result.final["type"] == "done" and result.text == text
    except TimeoutError:
        return False
    finally:
        await sock.close()


async def test_streams_end_cleanly_and_chats_resume_after_a_broker_restart(own_broker, fleet_logs, monkeypatch):
    layout = TopicLayout(prefix=f"broker-{int(time.time())}", requests_partitions=4, tokens_partitions=4)
    create_topics(own_broker, layout)
    monkeypatch.setenv("DRIVETRAIN_KAFKA_BOOTSTRAP", own_broker.kafka_bootstrap)
    fleet = start_fleet(layout, fleet_logs, model="echo", edges=1, routers=1, workers=1, echo_delay_ms=20)
    try:
        url = fleet.spec.chat_url(0)
        sockets, _ = await start_streams(url, 5, words=300)  # 6 s each
        await asyncio.sleep(1.0)
        await asyncio.to_thread(kafka.stop_broker, own_broker, quiet)
        stopped_at = time.perf_counter()
        await asyncio.sleep(OUTAGE_S)
        await asyncio.to_thread(kafka.up, own_broker, quiet)
        back_at = time.perf_counter()
        # No hang: each stream has ended, cleanly, by the time the broker is back and a moment on.
        results = await finish(sockets, timeout=back_at - stopped_at + 30)
        text = " ".join(f"w{i}" for i in range(300))
        for result in results:
            final = result.final
            assert final is not None, result.frames[-1:]
            if final["type"] == "error":
                assert final["retryable"] is True, final
                assert text.startswith(result.text)
            else:
                assert intact(result, text), final
        # New chats work again within seconds, with the same processes.
        served = False
        while not served and time.perf_counter() - back_at < RECOVERY_S:
            served = await chat_served(url, "after the broker came back")
        assert served, f"no chat served within {RECOVERY_S} s of the broker's return"
        dead = [name for name, child in fleet.children.items() if child.process.poll() is not None]
        assert dead == [], f"{dead} did not survive the broker restart"
        assert all(await asyncio.gather(*(chat_served(url, f"again {i}") for i in range(3))))
    finally:
        await asyncio.to_thread(fleet.stop)
