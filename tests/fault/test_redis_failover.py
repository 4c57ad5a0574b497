"""Kill a Redis Cluster master mid-stream: in-flight streams end cleanly, new ones work after failover."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import redis

from shared.chat_client import ChatSocket
from shared.infra.command import ensure_up
from tests.fault.conftest import finish, intact, start_streams

FAILOVER_TIMEOUT_S = 20.0


def kill_a_master(infra) -> int:
    """SIGKILL one master; returns its port."""
    for port in infra.redis_ports:
        node = redis.Redis(host=infra.redis_host, port=port, socket_timeout=2)
        if node.info("replication")["role"] == "master":
            os.kill(node.info("server")["process_id"], signal.SIGKILL)
            return port
    raise AssertionError("no master found")


def wait_for_failover(infra, dead_port: int) -> float:
    started = time.monotonic()
    while time.monotonic() - started < FAILOVER_TIMEOUT_S:
        states = []
        for port in infra.redis_ports:
            if port == dead_port:
                continue
            try:
                states.append(redis.Redis(host=infra.redis_host, port=port, socket_timeout=1).cluster("info")["cluster_state"])
            except redis.RedisError:
                states.append("down")
        if all(state == "ok" for state in states):
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"the cluster did not fail over within {FAILOVER_TIMEOUT_S} s")


async def test_redis_master_loss(make_fleet, infra):
    fleet = make_fleet(edges=1, routers=1, workers=1, echo_delay_ms=20)
    sockets, _ = await start_streams(fleet.spec.chat_url(0), 10)
    dead_port = kill_a_master(infra)
    try:
        in_flight = await finish(sockets, timeout=60)
        # Each stream either completed intact or ended with a clear error: none hung.
        for result in in_flight:
            assert intact(result) or result.final["type"] == "error", result.final
        await asyncio.to_thread(wait_for_failover, infra, dead_port)
        after = await asyncio.gather(*(fresh_chat(fleet.spec.chat_url(0), i) for i in range(5)))
        assert all(after), "chats that start after the failover must work"
    finally:
        await asyncio.to_thread(ensure_up, infra)  # the old master comes back as a replica


async def fresh_chat(url: str, i: int) -> bool:
    text = f"after failover {i}"
    for _ in range(20):  # a route write can still meet the old master's slots for a moment
        sock = await ChatSocket.open(url)
        try:
            await sock.chat("c", text)
            result = await sock.collect("c", timeout=30)
        finally:
            await sock.close()
        if result.final["type"] == "done":
            return result.text == text
        assert result.final.get("retryable"), result.final
        await asyncio.sleep(0.5)
    return False
