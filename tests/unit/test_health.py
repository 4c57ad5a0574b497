"""/healthz is 200 only while a service serves; the status endpoint of workers and routers serves
it beside /metrics, on a real socket, and nothing at all on port 0."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from shared.health import Health, Lifecycle
from shared.status_server import status_endpoint


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_draining_and_stopped_are_final():
    health = Health("worker", "w1")
    assert health.state is Lifecycle.STARTING and not health.serving
    health.set(Lifecycle.SERVING)
    assert health.serving
    health.set(Lifecycle.DRAINING)
    health.set(Lifecycle.SERVING)  # a late rebalance must not undo a drain
    assert health.state is Lifecycle.DRAINING
    assert health.body() == {"status": "draining", "role": "worker", "id": "w1", "pid": os.getpid()}


async def test_status_endpoint_serves_health_and_metrics():
    registry, health, port = CollectorRegistry(), Health("router", "r1"), free_port()
    Counter("drivetrain_test_things_total", "Things", registry=registry).inc(3)
    async with status_endpoint(registry, health, "127.0.0.1", port):
        url = f"http://127.0.0.1:{port}"
        status, body = await _get(f"{url}/healthz")
        assert status == 503 and json.loads(body)["status"] == "starting"
        health.set(Lifecycle.SERVING)
        status, body = await _get(f"{url}/healthz")
        assert status == 200 and json.loads(body)["id"] == "r1"
        health.set(Lifecycle.DRAINING)
        assert (await _get(f"{url}/healthz"))[0] == 503
        status, body = await _get(f"{url}/metrics")
        assert status == 200 and b"drivetrain_test_things_total 3.0" in body
        assert (await _get(f"{url}/nothing"))[0] == 404
    with pytest.raises(urllib.error.URLError):  # gone with the block
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)


async def test_port_zero_serves_nothing():
    async with status_endpoint(CollectorRegistry(), Health("worker", "w"), "127.0.0.1", 0):
        pass


async def _get(url: str) -> tuple[int, bytes]:
    return await asyncio.to_thread(get, url)
