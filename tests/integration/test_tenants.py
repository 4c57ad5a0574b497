"""Tenants from the tenants file on a live edge: its keys work and nothing else does, a revoked
key's live socket is closed within seconds, and an edit that does not parse changes nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus

from services.edge.tenants import TenantBook
from services.edge.tenants_command import write_atomically
from services.launcher.fleet import Fleet
from shared import wire
from shared.chat_client import ChatSocket
from tests.conftest import KafkaTap, start_fleet

REVOKE_WITHIN_S = 3.0  # the edge looks at the file every second


@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    book, acme = TenantBook().add("acme", "pro")
    book, beta = book.add("beta", "free")
    write_atomically(path, book.dumps())
    return path, {"acme": acme, "beta": beta, "book": book}


@pytest.fixture(scope="module")
def fleet(topics, fleet_logs, tenants) -> Iterator[Fleet]:
    path, _ = tenants
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRIVETRAIN_TENANTS_FILE", str(path))
        fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=1, model="echo", echo_delay_ms=5)
    yield fleet
    fleet.stop()


async def test_a_chat_carries_its_tiers_weight_and_its_priority_to_the_worker(fleet, tenants, infra, topics):
    _, keys = tenants
    async with KafkaTap(infra, topics.requests, topics.requests_partitions) as tap:
        sock = await ChatSocket.open(fleet.spec.chat_url(0), api_key=keys["acme"])
        try:
            await sock.send({"type": "chat", "id": "p", "priority": -3, "messages": [{"role": "user", "content": "hi"}]})
            assert (await sock.collect("p")).final["type"] == "done"
        finally:
            await sock.close()
        requests = [r for r in await tap.messages(wire.ChatRequest, 5.0) if r.tenant == "acme"]
    assert [(r.weight, r.priority) for r in requests] == [(2.0, -3)]  # acme is "pro": weight 2


async def refused_with(url: str, key: str) -> int | None:
    try:
        sock = await ChatSocket.open(url, api_key=key)
    except InvalidStatus as exc:
        return exc.response.status_code
    await sock.close()
    return None


async def test_the_files_keys_work_and_nothing_else(fleet, tenants):
    _, keys = tenants
    url = fleet.spec.chat_url(0)
    sock = await ChatSocket.open(url, api_key=keys["acme"])
    try:
        await sock.chat("c", "hello tenant")
        assert (await sock.collect("c")).text == "hello tenant"
    finally:
        await sock.close()
    assert await refused_with(url, "dev-key") == 401  # the file replaces the settings' keys
    assert await refused_with(url, "sha256:" + "0" * 64) == 401


async def test_a_broken_edit_changes_nothing_and_a_revoked_key_loses_its_socket(fleet, tenants):
    path, keys = tenants
    url = fleet.spec.chat_url(0)
    path.write_text(path.read_text() + "\n[tenants.broken\n")
    await asyncio.sleep(1.5)  # past one look at the file
    assert await refused_with(url, keys["beta"]) is None  # the last good book still holds

    live = await ChatSocket.open(url, api_key=keys["acme"])
    try:
        write_atomically(path, keys["book"].revoke("acme").dumps())
        revoked_at = time.monotonic()
        while live.close_code is None and time.monotonic() - revoked_at < REVOKE_WITHIN_S + 2:
            await asyncio.sleep(0.1)
        assert live.close_code == 1008, live.close_code
        assert time.monotonic() - revoked_at <= REVOKE_WITHIN_S
    finally:
        await live.close()
    assert await refused_with(url, keys["acme"]) == 401
    assert await refused_with(url, keys["beta"]) is None  # the others are untouched
