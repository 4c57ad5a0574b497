"""The services' Redis Cluster client: discovered at start, so the first request does not wait for it."""

from __future__ import annotations

import logging
import socket
import time

from shared.redis_client import discover, make_cluster
from shared.service_settings import RedisSettings


async def test_a_discovered_client_sends_its_first_command_without_learning_the_cluster(infra, monkeypatch):
    redis = make_cluster(RedisSettings(nodes=f"{infra.redis_host}:{infra.redis_ports[0]}"))
    try:
        assert redis.get_nodes() == []  # redis-py learns the nodes at the first command
        await discover(redis)
        assert len(redis.get_nodes()) == len(infra.redis_ports)  # every master and replica
        learnt = 0
        manager = type(redis.nodes_manager)
        learn = manager.initialize

        async def counting(self, *args, **kwargs):
            nonlocal learnt
            learnt += 1
            return await learn(self, *args, **kwargs)

        monkeypatch.setattr(manager, "initialize", counting)
        await redis.set("discover-test", "1")
        assert await redis.get("discover-test") == "1"
        assert learnt == 0
    finally:
        await redis.aclose()


async def test_a_cluster_that_does_not_answer_leaves_discovery_to_the_first_command(caplog):
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    redis = make_cluster(RedisSettings(nodes=f"127.0.0.1:{port}"))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shared.redis_client"):
        await discover(redis)  # returns: a service starts all the same
    assert time.monotonic() - started < 6
    assert "did not answer at start" in caplog.text
    assert redis.get_nodes() == []
    await redis.aclose()
