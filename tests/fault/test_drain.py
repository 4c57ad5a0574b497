"""SIGTERM drains: a worker or an edge finishes what it holds, takes nothing new and hands back what
has not started; what the drain timeout overtakes ends with a retryable error, never a hang."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from websockets.exceptions import InvalidStatus

from shared import wire
from shared.chat_client import ChatSocket
from tests.conftest import KafkaTap
from tests.fault.conftest import finish, intact, start_streams

MARGIN_S = 3.0  # a loaded 2-core machine: Kafka, gossip and the event loops all take their turn


def health(url: str) -> tuple[int, dict] | None:
    """/healthz as (status, body); None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return None


async def wait_for_health(url: str, status: str, timeout: float = 5.0) -> tuple[int, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = await asyncio.to_thread(health, url)
        if answer is not None and answer[1]["status"] == status:
            return answer
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never said {status!r} (last: {answer})")


async def exits_within(process, timeout: float) -> float:
    """Seconds until the process exited; fails if it outlives `timeout`."""
    started = time.perf_counter()
    while process.poll() is None:
        assert time.perf_counter() - started < timeout, f"still running {timeout} s after SIGTERM"
        await asyncio.sleep(0.1)
    return time.perf_counter() - started


def waiting_requests(health_url: str) -> float:
    with urllib.request.urlopen(health_url.replace("/healthz", "/metrics"), timeout=1) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("drivetrain_worker_waiting_requests "):
                return float(line.split()[1])
    raise AssertionError("no drivetrain_worker_waiting_requests")


async def starts_seen(tap: KafkaTap, into: dict[str, list[str]]) -> None:
    """Record every start on the token path: request id -> the workers that started it, in order."""
    while True:
        for batch in await tap.messages(wire.TokenBatch, 0.2):
            for event in batch.events:
                if isinstance(event, wire.Started):
                    into.setdefault(event.request_id, []).append(event.worker_id)


async def test_sigterm_on_a_worker_finishes_its_streams_and_hands_back_the_queued(make_fleet, infra, topics, monkeypatch):
    # Four requests run at once on each worker; the rest wait, not started, as behind a full batch
    # (three times the seats: admission, which would refuse most of them, is set to let them queue).
    monkeypatch.setenv("DRIVETRAIN_TENANCY_FULL_LOAD", "10")
    fleet = make_fleet(edges=1, routers=1, workers=2, echo_delay_ms=20, worker_args=("--echo.max-running", "4"))
    draining = fleet.children["worker-0"]
    starts: dict[str, list[str]] = {}
    async with KafkaTap(infra, topics.tokens, topics.tokens_partitions) as tap:
        watching = asyncio.create_task(starts_seen(tap, starts))
        try:
            sockets, accepted = await start_streams(fleet.spec.chat_url(0), 24)
            await asyncio.sleep(1.0)  # the first four on each worker are under way
            running_there = {rid for rid, workers in starts.items() if workers == [draining.spec.member_id]}
            queued_there = await asyncio.to_thread(waiting_requests, draining.spec.health_url)
            draining.process.send_signal(signal.SIGTERM)
            status, body = await wait_for_health(draining.spec.health_url, "draining", timeout=2.0)
            assert status == 503 and body["role"] == "worker"
            results = await finish(sockets, timeout=90)
            # 150 steps of 20 ms: the default drain timeout (20 s) leaves them time to finish.
            await exits_within(draining.process, 20.0 + MARGIN_S)
            await asyncio.sleep(1.0)
        finally:
            if watching.done():
                watching.result()  # a tap that failed says why
            watching.cancel()
    assert running_there and queued_there > 0, "worker-0 should have had streams running and requests waiting"
    # Every stream finished, those it was running included; what waited there ran on worker-1.
    assert all(intact(r) for r in results), [r.final for r in results if not intact(r)]
    ours = {a["request_id"] for a in accepted}
    assert set(starts) == ours
    assert all(starts[rid] == [draining.spec.member_id] for rid in running_there), "nothing it started runs twice"
    elsewhere = {fleet.children["worker-1"].spec.member_id}
    assert all(set(starts[rid]) == elsewhere for rid in ours - running_there)


async def test_the_drain_timeout_ends_the_rest_retryable_and_the_worker_exits(make_fleet):
    drain_s = 2.0
    fleet = make_fleet(edges=1, routers=1, workers=1, echo_delay_ms=20, worker_args=("--drain-timeout-s", str(drain_s)))
    worker = fleet.children["worker-0"]
    long_text = " ".join(f"w{i}" for i in range(2000))  # 40 s at 20 ms a step
    sockets, _ = await start_streams(fleet.spec.chat_url(0), 5, words=2000)
    await asyncio.sleep(1.0)
    worker.process.send_signal(signal.SIGTERM)
    signalled_at = time.perf_counter()
    status, body = await wait_for_health(worker.spec.health_url, "draining", timeout=2.0)
    assert status == 503
    results = await finish(sockets, timeout=30)
    for result in results:
        final = result.final
        assert final["type"] == "error" and final["code"] == "worker_draining" and final["retryable"] is True, final
        ended = result.arrivals[-1] - signalled_at
        assert drain_s - 0.5 <= ended <= drain_s + MARGIN_S, f"ended {ended:.2f} s after SIGTERM"
        assert result.tokens and long_text.startswith(result.text)  # a clean prefix, nothing grafted on
        assert [f["seq"] for f in result.tokens] == list(range(len(result.tokens)))
    await exits_within(worker.process, drain_s + 10.0)


async def test_sigterm_on_an_edge_lets_streams_finish_then_goes_away(make_fleet, monkeypatch):
    drain_s = 6.0
    monkeypatch.setenv("DRIVETRAIN_DRAIN_TIMEOUT_S", str(drain_s))
    fleet = make_fleet(edges=1, routers=1, workers=1, echo_delay_ms=20)
    edge, url = fleet.children["edge-0"], fleet.spec.chat_url(0)
    short, _ = await start_streams(url, 5)  # 3 s each
    (long,), _ = await start_streams(url, 1, words=2000)  # 40 s: outlasts the drain
    await asyncio.sleep(0.5)
    edge.process.send_signal(signal.SIGTERM)
    signalled_at = time.perf_counter()
    status, _ = await wait_for_health(edge.spec.health_url, "draining", timeout=2.0)
    assert status == 503
    # Nothing new: not a socket, not a chat on a socket it holds.
    with pytest.raises(InvalidStatus) as refused:
        await ChatSocket.open(url)
    assert refused.value.response.status_code == 503
    await long.chat("new", "not now")
    refusal = await long.next_frame("new", timeout=5)
    assert refusal["type"] == "error" and refusal["code"] == "edge_draining" and refusal["retryable"] is True
    results = await finish(short, timeout=30)
    assert all(intact(r) for r in results), [r.final for r in results if not intact(r)]
    cut = await long.collect("c", timeout=drain_s + MARGIN_S + 5)
    assert cut.final is None and cut.frames[-1]["type"] == "closed" and long.close_code == 1001
    assert drain_s - 0.5 <= cut.arrivals[-1] - signalled_at <= drain_s + MARGIN_S
    assert cut.tokens  # it streamed until the socket went away
    await long.close()
    await exits_within(edge.process, 10.0)


async def test_the_launchers_stop_drains_the_fleet(make_fleet):
    fleet = make_fleet(edges=1, routers=1, workers=1, echo_delay_ms=20)
    sockets, _ = await start_streams(fleet.spec.chat_url(0), 5)
    await asyncio.sleep(0.5)
    stopping = asyncio.create_task(asyncio.to_thread(fleet.stop))
    results = await finish(sockets, timeout=30)
    await asyncio.wait_for(stopping, 60)
    assert all(intact(r) for r in results), [r.final for r in results if not intact(r)]
