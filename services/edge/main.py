"""Starts one edge: Kafka producer, Redis Cluster client, the client endpoint and the router link."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import uvicorn

from services.edge.app import build_app
from services.edge.fleet_view import FleetView
from services.edge.kv_events import consume_kv_events
from services.edge.read_timeouts import ReadTimeouts, timed_protocol
from services.edge.service import EdgeService
from services.edge.settings import EdgeSettings
from shared.addresses import advertised_host
from shared.fleet_membership import join_fleet, on_departure, publish_load
from shared.health import Health, Lifecycle
from shared.kafka_clients import DeadLetters, make_consumer, make_producer
from shared.kafka_shutdown import stop_client
from shared.metrics import GossipCollector
from shared.models.prompt_length import prompt_limit, prompt_tokens
from shared.redis_client import discover, make_cluster
from shared.runtime import run_until_signalled, setup_logging
from shared.seal import Seal
from shared.status_server import QuietServer

log = logging.getLogger(__name__)

DRAIN_BACKSTOP_MARGIN_S = 10.0  # past the drain timeout: closing sockets, leaving gossip


async def serve_edge(settings: EdgeSettings, health: Health, stopping: asyncio.Event) -> None:
    tokens = prompt_tokens(settings.spec())  # one tokenizer for counting and for placement
    limit = prompt_limit(settings.spec(), tokens)
    producer = make_producer(settings.kafka, client_id=settings.edge_id)
    redis = make_cluster(settings.redis)
    await producer.start()
    await discover(redis)
    fleet = FleetView()  # workers' load from gossip, for admission, once the edge has joined
    service = EdgeService(settings, producer, redis, limit, health=health, fleet_load=fleet, prompt_tokens=tokens)
    # Every edge reads every worker's KV-cache events: no group, from now on.
    kv_consumer = make_consumer(
        settings.kafka, settings.topics.kv_events, client_id=settings.edge_id, group_id=None, auto_offset_reset="latest"
    )
    await kv_consumer.start()
    dead_letters = DeadLetters(producer, settings.topics.dead_letter, settings.edge_id)
    seal = Seal(settings.fleet_secret, settings.edge_id)
    internal = settings.internal
    link = await asyncio.start_server(service.router_links.serve, internal.host, internal.port)
    server = QuietServer(
        uvicorn.Config(
            build_app(service),
            host=settings.host,
            port=settings.port,
            http=timed_protocol(ReadTimeouts(settings.clients.header_timeout_s, settings.clients.body_timeout_s)),
            timeout_keep_alive=settings.clients.idle_timeout_s,
            ws="websockets-sansio",
            ws_max_size=settings.max_frame_bytes,
            ws_per_message_deflate=False,  # compression on user-chosen text invites attacks and costs CPU
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
    )
    addresses = {"internal": f"{advertised_host(internal.host)}:{internal.port}"}
    membership = await join_fleet(settings, settings.edge_id, "edge", addresses, dataclasses.asdict(service.load()))
    fleet.watch(membership)
    on_departure(membership, "worker", service.worker_gone)
    service.placer.members = lambda: membership.alive("worker")
    on_departure(membership, "worker", lambda worker_id, _died: service.placer.forget_worker(worker_id))
    service.registry.register(GossipCollector(membership))
    serving = asyncio.create_task(server.serve())
    watchdog = asyncio.create_task(service.run_watchdog())
    tenants = asyncio.create_task(service.watch_tenants())
    loading = asyncio.create_task(publish_load(membership, lambda: dataclasses.asdict(service.load())))
    renewing = asyncio.create_task(service.tenancy.renew_forever())
    kv_events = asyncio.create_task(consume_kv_events(kv_consumer, seal, service.placer.index, dead_letters))
    # Regions: this region's load out to its peers, theirs in (region_summaries.py); none single-region.
    summaries = service.regions.summaries_io(settings.kafka, settings.edge_id, producer)
    if summaries is not None:
        await summaries.start()
    health.set(Lifecycle.SERVING)
    log.info(
        "edge %s serving: ws://%s:%d/v1/chat, routers at %s:%d",
        settings.edge_id, settings.host, settings.port, internal.host, internal.port,
    )
    try:
        await _until_either(serving, stopping)
        if not serving.done():
            # Routers keep delivering over the internal link meanwhile: it closes after the drain.
            await service.drain(settings.drain_timeout_s)
    finally:
        health.set(Lifecycle.STOPPED)
        watchdog.cancel()
        tenants.cancel()
        loading.cancel()
        renewing.cancel()
        kv_events.cancel()
        if summaries is not None:
            await summaries.stop()
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        link.close()
        await membership.stop()
        await service.aclose()
        await stop_client(kv_consumer)
        await producer.stop()
        await redis.aclose()


async def _until_either(serving: asyncio.Task, stopping: asyncio.Event) -> None:
    """Until the server ends by itself or the edge is told to stop; the server is not cancelled here."""
    told = asyncio.create_task(stopping.wait())
    try:
        await asyncio.wait({serving, told}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        told.cancel()


def main(settings: EdgeSettings) -> None:
    setup_logging(settings.log_level, settings.edge_id)
    health = Health("edge", settings.edge_id)
    run_until_signalled(
        lambda stopping: serve_edge(settings, health, stopping),
        on_signal=lambda: health.set(Lifecycle.DRAINING),
        backstop_s=settings.drain_timeout_s + DRAIN_BACKSTOP_MARGIN_S,
        loop_factory=settings.event_loop.factory(),
    )
