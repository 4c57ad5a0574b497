"""Tenancy on a live fleet (two edges, echo workers that run few chats at a slow pace): a full
fleet refuses free before enterprise; over-rate chats get `rate_limited` with retry_after_ms on
the socket and 429 + Retry-After over HTTP; stream and connection caps hold across both edges,
and a stream's slot comes back however it ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from websockets.exceptions import InvalidStatus

from services.edge.tenants import Limits, TenantBook
from services.edge.tenants_command import write_atomically
from services.launcher.fleet import Fleet
from shared.chat_client import ChatSocket
from tests.conftest import RESUME_GRACE_S, start_fleet

MAX_RUNNING = 10  # per worker: free is refused from 7 chats in flight, pro from 8
LONG = " ".join(f"w{i}" for i in range(200))  # 200 steps of 100 ms: runs until cancelled
GOSSIP_S = 8.0  # a worker's new load reaches the edges within about this (published every second)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("admission") / "tenants.toml"
    book, keys = TenantBook(), {}
    for tenant, tier, limits in [
        ("big", "enterprise", Limits()),
        ("mid", "pro", Limits()),
        ("small", "free", Limits()),
        ("rated", "enterprise", Limits(requests_per_min=12)),  # a bucket of 2 (rate_burst_s 10), one per 5 s
        ("streams", "enterprise", Limits(concurrent_streams=2)),
        ("conns", "enterprise", Limits(connections=2)),
        ("short", "enterprise", Limits(max_prompt_tokens=20)),
    ]:
        book, keys[tenant] = book.add(tenant, tier, limits)
    write_atomically(path, book.dumps())
    return path, keys


@pytest.fixture(scope="module")
def fleet(topics, fleet_logs, tenants) -> Iterator[Fleet]:
    path, _ = tenants
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRIVETRAIN_TENANTS_FILE", str(path))
        fleet = start_fleet(
            topics, fleet_logs, edges=2, routers=1, workers=1, model="echo", echo_delay_ms=100,
            worker_args=("--echo.max-running", str(MAX_RUNNING)),
        )  # fmt: skip
    yield fleet
    fleet.stop()


async def first_frame(sock: ChatSocket, chat_id: str, text: str = "hi") -> dict:
    await sock.chat(chat_id, text)
    return await sock.next_frame(chat_id, timeout=15)


async def eventually_accepted(url: str, key: str, within_s: float) -> dict:
    """Starts chats until one is accepted (ends it again); the last refusal if none is."""
    deadline, n = time.monotonic() + within_s, 0
    sock = await ChatSocket.open(url, api_key=key)
    try:
        while True:
            n += 1
            frame = await first_frame(sock, f"probe-{n}")
            if frame["type"] == "accepted" or time.monotonic() > deadline:
                if frame["type"] == "accepted":
                    await sock.collect(f"probe-{n}")
                return frame
            await asyncio.sleep(0.3)
    finally:
        await sock.close()


async def test_a_prompt_over_the_tenants_own_limit_is_refused(fleet, tenants):
    _, keys = tenants
    sock = await ChatSocket.open(fleet.spec.chat_url(0), api_key=keys["short"])
    try:
        refused = await first_frame(sock, "long", " ".join(["word"] * 40))
        assert (refused["type"], refused["code"], refused["retryable"]) == ("error", "prompt_too_long", False)
        assert "at most 20" in refused["message"]
        await sock.chat("ok", "short one")
        assert (await sock.collect("ok")).final["type"] == "done"
    finally:
        await sock.close()


async def test_over_its_rate_a_tenant_is_refused_with_when_to_retry_on_both_apis(fleet, tenants):
    _, keys = tenants
    sockets = [await ChatSocket.open(fleet.spec.chat_url(i), api_key=keys["rated"]) for i in (0, 1)]
    try:
        frames = [await first_frame(sockets[i % 2], f"r{i}") for i in range(3)]  # over both edges
        assert [f["type"] for f in frames[:2]] == ["accepted"] * 2
        refused = frames[2]
        assert (refused["type"], refused["code"], refused["retryable"]) == ("error", "rate_limited", True)
        assert 0 < refused["retry_after_ms"] <= 5_000  # one request refills in 5 s
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{fleet.spec.base_port}/v1", timeout=15) as http:
            response = await http.post(
                "/chat/completions",
                headers={"Authorization": f"Bearer {keys['rated']}"},
                json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            )
    finally:
        for sock in sockets:
            await sock.close()
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(response.headers["retry-after"]) <= 5


async def test_the_stream_cap_holds_across_edges_and_every_ending_gives_a_slot_back(fleet, tenants):
    _, keys = tenants
    key = keys["streams"]
    a = await ChatSocket.open(fleet.spec.chat_url(0), api_key=key)
    b = await ChatSocket.open(fleet.spec.chat_url(1), api_key=key)
    try:
        assert (await first_frame(a, "a1", LONG))["type"] == "accepted"
        assert (await first_frame(b, "b1", LONG))["type"] == "accepted"
        refused = await first_frame(a, "a2", LONG)
        assert (refused["code"], refused["retryable"]) == ("too_many_streams", True)
        # Cancelled: its slot comes back.
        await a.send({"type": "cancel", "id": "a1"})
        assert (await a.collect("a1")).final["finish_reason"] == "cancelled"
        assert (await eventually_accepted(fleet.spec.chat_url(1), key, 5.0))["type"] == "accepted"
        # Done: its slot comes back too (the probe above ended with done).
        assert (await first_frame(a, "a3", LONG))["type"] == "accepted"
        assert (await first_frame(a, "a4", LONG))["code"] == "too_many_streams"
        # A socket dropped and not resumed: after the resume grace, its stream's slot is free.
        await b.close()
        started = time.monotonic()
        assert (await eventually_accepted(fleet.spec.chat_url(0), key, RESUME_GRACE_S + 8))["type"] == "accepted"
        assert time.monotonic() - started >= RESUME_GRACE_S * 0.8  # not before the grace ran out
        # Ended here, not a resume grace after the socket closes: the next tests fill the fleet's seats.
        await a.send({"type": "cancel", "id": "a3"})
        assert (await a.collect("a3")).final["finish_reason"] == "cancelled"
    finally:
        await a.close()
        await b.close()


async def refused_status(url: str, key: str) -> tuple[int | None, ChatSocket | None]:
    try:
        return None, await ChatSocket.open(url, api_key=key)
    except InvalidStatus as exc:
        assert exc.response.headers.get("Retry-After") == "1"
        return exc.response.status_code, None


async def test_the_connection_cap_refuses_the_handshake_with_429_on_any_edge(fleet, tenants):
    _, keys = tenants
    key = keys["conns"]
    first = await ChatSocket.open(fleet.spec.chat_url(0), api_key=key)
    second = await ChatSocket.open(fleet.spec.chat_url(1), api_key=key)
    try:
        assert (await refused_status(fleet.spec.chat_url(0), key))[0] == 429
        assert (await refused_status(fleet.spec.chat_url(1), key))[0] == 429
        await first.close()
        status, third = None, None
        for _ in range(20):  # the slot is given back as the edge sees the socket close
            status, third = await refused_status(fleet.spec.chat_url(1), key)
            if third is not None:
                break
            await asyncio.sleep(0.1)
        assert third is not None, status
        await third.close()
    finally:
        await first.close()
        await second.close()


async def test_a_full_fleet_refuses_free_first_while_enterprise_keeps_its_reserve(fleet, tenants):
    _, keys = tenants
    filler = await ChatSocket.open(fleet.spec.chat_url(0), api_key=keys["big"])
    try:
        for i in range(8):  # 8 of 10 seats: free (limit 0.7) and pro (0.8) are refused, enterprise is not
            assert (await first_frame(filler, f"fill-{i}", LONG))["type"] == "accepted"
        url = fleet.spec.chat_url(1)  # the other edge, which learns the load from gossip only
        refused = await eventually_refused(url, keys["small"], GOSSIP_S)
        assert (refused["code"], refused["retryable"], refused["retry_after_ms"]) == ("overloaded", True, 1000)
        assert (await eventually_refused(url, keys["mid"], 2.0))["code"] == "overloaded"
        sock = await ChatSocket.open(url, api_key=keys["big"])
        try:
            await sock.chat("vip", "enterprise still gets in")
            result = await sock.collect("vip", timeout=30)
            assert result.final["type"] == "done", result.final  # the refusal, when there is one, says why
            assert result.text == "enterprise still gets in"
        finally:
            await sock.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{fleet.spec.base_port + 1}/v1", timeout=15) as http:
            response = await http.post(
                "/chat/completions",
                headers={"Authorization": f"Bearer {keys['small']}"},
                json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert response.status_code == 429 and response.json()["error"]["code"] == "overloaded"
        assert response.headers["retry-after"] == "1"
    finally:
        for i in range(8):
            await filler.send({"type": "cancel", "id": f"fill-{i}"})
        await filler.close()
    # Once the fleet empties, free is admitted again.
    assert (await eventually_accepted(fleet.spec.chat_url(1), keys["small"], GOSSIP_S + 5))["type"] == "accepted"


async def eventually_refused(url: str, key: str, within_s: float) -> dict:
    deadline, n = time.monotonic() + within_s, 0
    sock = await ChatSocket.open(url, api_key=key)
    try:
        while True:
            n += 1
            frame = await first_frame(sock, f"try-{n}")
            if frame["type"] == "error" or time.monotonic() > deadline:
                return frame
            await sock.collect(f"try-{n}")
            await asyncio.sleep(0.3)
    finally:
        await sock.close()
