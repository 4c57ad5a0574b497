"""Every service serves Prometheus metrics that move with real traffic, and says on /healthz that it serves."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import InvalidStatus

from shared.chat_client import ChatSocket


def scrape(port: int, path: str = "/metrics") -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_follow_traffic(echo_fleet):
    spec = echo_fleet.spec
    sock = await ChatSocket.open(spec.chat_url(0))
    try:
        for i in range(3):
            await sock.chat(f"m{i}", "count these five words please")
            await sock.collect(f"m{i}")
        await sock.send("{broken")
        await sock.next_frame(None)
    finally:
        await sock.close()
    await asyncio.sleep(0.2)
    edge = scrape(spec.base_port)
    assert value(edge, "drivetrain_edge_tokens_total") >= 15
    assert value(edge, "drivetrain_edge_ttft_seconds_count") >= 3
    assert value(edge, "drivetrain_edge_itl_seconds_count") >= 12
    assert value(edge, "drivetrain_edge_refusals_total", code="invalid_json", tier="standard") >= 1
    with pytest.raises(InvalidStatus):  # a refused key counts too, without a tier
        await ChatSocket.open(spec.chat_url(0), api_key="wrong")
    assert value(scrape(spec.base_port), "drivetrain_edge_refusals_total", code="invalid_api_key", tier="none") >= 1
    assert value(edge, "drivetrain_edge_stream_endings_total", reason="stop") >= 3
    assert value(edge, "drivetrain_gossip_members", role="worker", status="alive") == 2
    workers = [scrape(spec.worker_metrics_port(i)) for i in range(spec.workers)]
    assert sum(value(w, "drivetrain_worker_tokens_total") for w in workers) >= 15
    assert all(("drivetrain_worker_running_requests", ()) in w for w in workers)
    routers = [scrape(spec.router_metrics_port(i)) for i in range(spec.routers)]
    assert sum(value(r, "drivetrain_router_events_total") for r in routers) >= 15
    assert sum(value(r, "drivetrain_router_route_cache_misses_total") for r in routers) >= 3
    assert sum(value(w, "drivetrain_worker_engine_steps_total") for w in workers) >= 5  # counted and exported


def test_every_service_answers_healthz_while_it_serves(echo_fleet):
    for child in echo_fleet.children.values():
        with urllib.request.urlopen(child.spec.health_url, timeout=5) as response:
            body = json.loads(response.read())
        assert response.status == 200 and body["status"] == "serving", child.name
        assert (body["role"], body["id"], body["pid"]) == (child.spec.command, child.spec.member_id, child.process.pid)
