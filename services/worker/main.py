"""Starts one worker: loads its model into an engine, then serves requests from Kafka."""

from __future__ import annotations

import asyncio

from services.worker.config import WorkerConfig
from services.worker.generation import GenerationEngine
from services.worker.service import WorkerService
from shared.fleet_membership import is_alive, join_fleet, on_departure, publish_load
from shared.metrics import GossipCollector
from shared.redis_client import make_cluster
from shared.routing_map import RoutingMap
from shared.runtime import run_until_signalled, setup_logging


def build_engine(config: WorkerConfig) -> GenerationEngine:
    if config.model == "echo":
        from services.worker.echo import EchoEngine

        return EchoEngine(delay_ms=config.echo_delay_ms, crash_on=config.echo_crash_on)
    from services.worker.engine.llm_engine import build_llm_engine

    return build_llm_engine(config)


async def serve_worker(config: WorkerConfig, engine: GenerationEngine) -> None:
    redis = make_cluster(config.redis_startup_nodes())
    membership = await join_fleet(config, config.name, "worker", {}, engine.load())
    service = WorkerService(config, engine, RoutingMap(redis), is_alive=lambda wid: is_alive(membership, wid))
    service.registry.register(GossipCollector(membership))
    on_departure(membership, "edge", lambda edge_id, died: service.cancel_edge_unless_back(edge_id, membership))
    loading = asyncio.create_task(publish_load(membership, engine.load))
    try:
        await service.run()
    finally:
        loading.cancel()
        await membership.stop()
        await redis.aclose()


def main(config: WorkerConfig) -> None:
    setup_logging(config.log_level, config.name)
    engine = build_engine(config)
    run_until_signalled(serve_worker(config, engine))
