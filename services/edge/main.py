"""Starts one edge: Kafka producer, Redis Cluster client, the client endpoint and the router link."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from services.edge.app import build_app
from services.edge.config import EdgeConfig
from services.edge.prompt_limit import prompt_limit_for
from services.edge.service import EdgeService
from shared.fleet_membership import (
    advertised_host,
    join_fleet,
    on_departure,
    publish_load,
)
from shared.kafka_clients import make_producer
from shared.metrics import GossipCollector
from shared.redis_client import make_cluster
from shared.runtime import run_until_signalled, setup_logging

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """Signals belong to the process runner, which shuts everything down in order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_edge(config: EdgeConfig) -> None:
    prompt_limit = prompt_limit_for(config.model, config.max_model_len)
    producer = make_producer(config.kafka_bootstrap, client_id=config.edge_id)
    redis = make_cluster(config.redis_startup_nodes())
    await producer.start()
    service = EdgeService(config, producer, redis, prompt_limit)
    internal = await asyncio.start_server(service.serve_router, config.internal_host, config.internal_port)
    server = _Server(
        uvicorn.Config(
            build_app(service),
            host=config.host,
            port=config.port,
            ws="websockets-sansio",
            ws_max_size=config.max_frame_bytes,
            ws_per_message_deflate=False,  # compression on user-chosen text invites attacks and costs CPU
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
    )
    addresses = {"internal": f"{advertised_host(config.internal_host)}:{config.internal_port}"}
    membership = await join_fleet(config, config.edge_id, "edge", addresses, service.load())
    on_departure(membership, "worker", service.fail_worker)
    service.registry.register(GossipCollector(membership))
    serving = asyncio.create_task(server.serve())
    watchdog = asyncio.create_task(service.run_watchdog())
    loading = asyncio.create_task(publish_load(membership, service.load))
    log.info(
        "edge %s ready: ws://%s:%d/v1/chat, routers at %s:%d",
        config.edge_id, config.host, config.port, config.internal_host, config.internal_port,
    )
    try:
        await asyncio.shield(serving)
    finally:
        watchdog.cancel()
        loading.cancel()
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        internal.close()
        await membership.stop()
        await service.aclose()
        await producer.stop()
        await redis.aclose()


def main(config: EdgeConfig) -> None:
    setup_logging(config.log_level, config.edge_id)
    run_until_signalled(serve_edge(config))
