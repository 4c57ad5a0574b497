"""Starts one worker: loads its model into an engine, then serves requests from Kafka."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

from services.worker.decoder_choice import KV_ADDRESS, decoders_of
from services.worker.engine.types import GenerationEngine
from services.worker.service import WorkerService
from services.worker.settings import WorkerSettings
from shared.fleet_membership import is_alive, join_fleet, on_departure, publish_load
from shared.health import Health, Lifecycle
from shared.metrics import GossipCollector
from shared.partition_owners import REQUESTS_ADDRESS, format_partitions
from shared.redis_client import discover, make_cluster
from shared.routing_map import RoutingMap
from shared.runtime import run_until_signalled, settle_heap, setup_logging

# What the fleet hears of a worker's load (edges place requests by it and admit by it).
GOSSIPED_LOAD = ("running", "waiting", "kv_usage", "free_kv_blocks", "max_running", "waiting_tokens", "kv_tokens")
DRAIN_BACKSTOP_MARGIN_S = 10.0  # past the drain timeout: leaving the group and gossip, flushing the producer


def build_engine(settings: WorkerSettings) -> GenerationEngine:
    spec = settings.spec()
    if spec.is_echo:
        from services.worker.echo import EchoEngine

        echo = settings.echo
        return EchoEngine(echo.delay_ms, echo.crash_on, context=spec.max_model_len, max_running=echo.max_running)
    from services.worker.engine.llm_engine import build_llm_engine

    return build_llm_engine(spec, settings.engine, settings.device)


def gossiped_load(engine: GenerationEngine) -> dict[str, int | float]:
    load = dataclasses.asdict(engine.load())
    return {key: load[key] for key in GOSSIPED_LOAD}


async def serve_worker(settings: WorkerSettings, engine: GenerationEngine, health: Health, stopping: asyncio.Event) -> None:
    redis = make_cluster(settings.redis)
    await discover(redis)
    membership = await join_fleet(settings, settings.name, "worker", {}, gossiped_load(engine))
    addresses: dict[str, str] = {}

    def publish(name: str, value: str) -> None:
        addresses[name] = value
        membership.set_addresses(addresses)

    service = WorkerService(
        settings, engine, RoutingMap(redis), lambda wid: is_alive(membership, wid), health,
        on_assignment=lambda partitions: publish(REQUESTS_ADDRESS, format_partitions(partitions)),
        decoders=lambda in_flight: decoders_of(membership.alive("worker"), in_flight),
        advertise_kv=lambda address: publish(KV_ADDRESS, address),
    )  # fmt: skip
    service.registry.register(GossipCollector(membership))
    on_departure(membership, "edge", lambda edge_id, died: service.cancel_edge_unless_back(edge_id, membership))
    loading = asyncio.create_task(publish_load(membership, lambda: gossiped_load(engine)))
    try:
        await service.run(stopping)
    finally:
        loading.cancel()
        # Last, after the drain: while its streams run, edges and workers must still see it alive.
        await membership.stop()
        await redis.aclose()


def main(settings: WorkerSettings) -> None:
    setup_logging(settings.log_level, settings.name)
    health = Health("worker", settings.name)
    if settings.role != "unified" and settings.spec().is_echo:
        raise SystemExit(f"drivetrain worker: a {settings.role} worker hands KV caches on, and the echo model has none")
    engine = build_engine(settings)
    settle_heap()
    try:
        run_until_signalled(
            lambda stopping: serve_worker(settings, engine, health, stopping),
            on_signal=lambda: health.set(Lifecycle.DRAINING),
            backstop_s=settings.drain_timeout_s + DRAIN_BACKSTOP_MARGIN_S,
            loop_factory=settings.event_loop.factory(),
        )
    finally:
        # Back to the collector for the interpreter's last pass: frozen objects are never
        # finalised, and native bindings (Triton's) would report them as leaked at every stop.
        gc.unfreeze()
