"""`drivetrain up --regions N`: each region a fleet of its own, peers of each other both ways."""

from __future__ import annotations

import json

from services.edge.settings import EdgeSettings
from services.launcher.regions import REGION_PORT_STEP, local_regions
from shared.settings import from_environment


def test_each_region_has_its_own_topics_and_ports_and_the_others_as_peers(monkeypatch):
    regions = local_regions(2, 8080, edges=2, workers=1, routers=1)
    r1, r2 = regions
    assert (r1.name, r2.name) == ("r1", "r2")
    assert (r1.topics.prefix, r2.topics.prefix) == ("drivetrain-r1", "drivetrain-r2")
    assert (r1.spec.base_port, r2.spec.base_port) == (8080, 8080 + REGION_PORT_STEP)
    ports = lambda spec: {spec.base_port, spec.base_internal_port, spec.base_gossip_port, spec.worker_metrics_port(0), spec.router_metrics_port(0)}  # noqa: E731
    assert not ports(r1.spec) & ports(r2.spec) and not (ports(r1.spec) | ports(r2.spec)) & {9092, *range(7000, 7006)}
    peers = json.loads(r1.spec.extra_env["DRIVETRAIN_REGIONS_PEERS"])
    assert peers == [{"name": "r2", "edge_url": "ws://127.0.0.1:8580/v1/chat", "rtt_ms": 70.0}]
    # An edge of r2 reads its region from the environment the launcher gives it.
    for name, value in r2.spec.extra_env.items():
        monkeypatch.setenv(name, value)
    settings = from_environment(EdgeSettings)
    assert settings.regions.name == "r2" and settings.regions.added_delay_ms == 35.0
    assert [(p.name, p.edge_url) for p in settings.regions.peers] == [("r1", "ws://127.0.0.1:8080/v1/chat")]
    assert settings.topics.prefix == "drivetrain-r2" and settings.membership().cluster_name == "drivetrain-r2"


def test_a_region_may_override_its_own_settings():
    r1, r2 = local_regions(2, 8080, region_env={"r1": {"DRIVETRAIN_REGIONS_OVERFLOW_LOAD": "0.0"}})
    assert r1.spec.extra_env["DRIVETRAIN_REGIONS_OVERFLOW_LOAD"] == "0.0"
    assert "DRIVETRAIN_REGIONS_OVERFLOW_LOAD" not in r2.spec.extra_env
