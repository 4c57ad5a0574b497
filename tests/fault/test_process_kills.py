"""Kill real processes mid-stream: clients get a clean error fast or an intact stream, never a hang."""

from __future__ import annotations

import asyncio
import time

from shared import wire
from shared.chat_client import ChatSocket
from tests.conftest import KafkaTap
from tests.fault.conftest import assert_worker_loss, finish, intact, start_streams


async def test_worker_killed_mid_stream_fails_its_streams_within_two_seconds(make_fleet):
    fleet = make_fleet(edges=1, routers=1, workers=2, echo_delay_ms=20)
    sockets, _ = await start_streams(fleet.spec.chat_url(0), 20)
    await asyncio.sleep(0.5)  # every stream is under way
    fleet.kill("worker-0")
    killed_at = time.perf_counter()
    results = await finish(sockets)
    assert_worker_loss(results, killed_at)


async def test_router_killed_mid_stream_loses_nothing(make_fleet):
    fleet = make_fleet(edges=1, routers=2, workers=1, echo_delay_ms=20)
    sockets, _ = await start_streams(fleet.spec.chat_url(0), 20)
    await asyncio.sleep(0.5)
    fleet.kill("router-0")
    results = await finish(sockets, timeout=60)
    assert all(intact(r) for r in results), [r.final for r in results if not intact(r)]


async def test_edge_killed_its_requests_are_cancelled_on_the_workers(make_fleet, infra, topics):
    fleet = make_fleet(edges=2, routers=1, workers=1, echo_delay_ms=20)
    async with KafkaTap(infra, topics.tokens, topics.tokens_partitions) as tap:
        sockets, accepted = await start_streams(fleet.spec.chat_url(1), 5, words=2000)
        ours = {a["request_id"] for a in accepted}
        await asyncio.sleep(0.5)
        fleet.kill("edge-1")
        cancelled: dict[str, wire.Done] = {}

        def all_cancelled(event: wire.Event) -> bool:
            if isinstance(event, wire.Done) and event.request_id in ours:
                cancelled[event.request_id] = event
            return set(cancelled) == ours

        await tap.events_until(all_cancelled, timeout=15)
    await asyncio.gather(*(sock.close() for sock in sockets), return_exceptions=True)
    assert all(d.finish_reason == "cancelled" and d.usage.completion_tokens < 2000 for d in cancelled.values())


async def test_poison_request_is_quarantined_not_rerun(make_fleet, infra, topics):
    poison = "POISON PILL"
    fleet = make_fleet(edges=1, routers=1, workers=2, echo_delay_ms=20, worker_args=("--echo.crash-on", poison))
    async with KafkaTap(infra, topics.tokens, topics.tokens_partitions) as tap:
        sock = await ChatSocket.open(fleet.spec.chat_url(0))
        try:
            await sock.chat("p", poison)
            request_id = (await sock.next_frame("p"))["request_id"]
            result = await sock.collect("p", timeout=30)
            assert result.final["type"] == "error" and result.final["code"] == "request_quarantined"
            assert result.final["retryable"] is False and not result.tokens
            await asyncio.sleep(8)  # past the Kafka rebalance that hands its partition on
            alive = [name for name, child in fleet.children.items() if name.startswith("worker") and child.process.poll() is None]
            assert len(alive) == 1, "the request must take down one worker, not roll through the fleet"
            await sock.chat("ok", "still serving")
            assert (await sock.collect("ok", timeout=20)).text == "still serving"
        finally:
            await sock.close()
        tokens = [e for batch in await tap.messages(wire.TokenBatch, 1.0) for e in batch.events]
    assert not [e for e in tokens if e.request_id == request_id and isinstance(e, wire.Token)]
