"""The Grafana dashboard and the Prometheus config in compose/ agree with the metrics the code exports.

Nothing here runs Prometheus or Grafana: each service's metric objects are built into
registries of their own, and every `drivetrain_*` name a panel queries must be one of
the series those registries expose.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from services.edge.metrics import EdgeMetrics
from services.router.metrics import RouterMetrics
from services.worker.engine.types import EngineLoad
from services.worker.metrics import WorkerMetrics
from shared.metrics import GossipCollector, watch_consumer_lag

COMPOSE_DIR = Path(__file__).parents[2] / "compose"
COMPOSE = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PROMETHEUS = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
GRAFANA = COMPOSE_DIR / "grafana"
DASHBOARD_FILES = sorted((GRAFANA / "dashboards").glob("*.json"))
DATASOURCES = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
PROVIDERS = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "drivetrain.yml").read_text())

METRIC_NAME = re.compile(r"\bdrivetrain_[a-zA-Z0-9_]+")
# The series a metric family of each type puts on the wire (prometheus_client's exposition).
SERIES_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
}


# What the code exports --------------------------------------------------------------------
class _NoMembers:
    """Stands in for a Membership: the collector reads it only at scrape time."""

    def members(self) -> list:
        return []

    def drops(self) -> dict:
        return {}

    events_dropped = 0


class _NoAssignment:
    """Stands in for an AIOKafkaConsumer: the lag task is cancelled before it reads one."""

    def assignment(self) -> set:
        return set()


def _lag_registry() -> CollectorRegistry:
    registry = CollectorRegistry()

    async def build() -> None:
        task = watch_consumer_lag(_NoAssignment(), registry)  # type: ignore[arg-type]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(build())
    return registry


def service_registries() -> dict[str, CollectorRegistry]:
    edge, worker, router, gossip = (CollectorRegistry() for _ in range(4))
    EdgeMetrics(edge)
    WorkerMetrics(worker, EngineLoad)
    RouterMetrics(router)
    gossip.register(GossipCollector(_NoMembers()))  # type: ignore[arg-type]
    return {"edge": edge, "worker": worker, "router": router, "gossip": gossip, "lag": _lag_registry()}


def exported_series(registry: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in SERIES_SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples if not sample.name.endswith("_created"))
    return names


EXPORTED = {name for registry in service_registries().values() for name in exported_series(registry)}


# What the dashboard queries ---------------------------------------------------------------
def walk_panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def load_dashboard(path: Path) -> dict:
    return json.loads(path.read_text())


def expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in walk_panels(dashboard["panels"]) for t in p.get("targets", []) if "expr" in t]
    exprs += [str(v.get("query", "")) for v in dashboard.get("templating", {}).get("list", [])]
    return exprs


def queried_names(dashboard: dict) -> set[str]:
    return {name for expr in expressions(dashboard) for name in METRIC_NAME.findall(expr)}


def test_there_is_a_dashboard():
    assert [p.name for p in DASHBOARD_FILES] == ["drivetrain.json"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_queries_only_exported_series(path):
    unknown = queried_names(load_dashboard(path)) - EXPORTED
    assert not unknown, f"{path.name} queries series no service exports: {sorted(unknown)}"


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_every_exported_metric_has_a_panel(path):
    queried = queried_names(load_dashboard(path))
    registries = service_registries()
    missing = [
        family.name
        for registry in registries.values()
        for family in registry.collect()
        if not any(family.name + suffix in queried for suffix in SERIES_SUFFIXES[family.type])
    ]
    assert not missing, f"metrics with no panel on {path.name}: {missing}"


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_quantiles_come_from_bucket_rates(path):
    for expr in expressions(load_dashboard(path)):
        if "histogram_quantile" in expr:
            assert re.search(r"rate\(drivetrain_\w+_bucket(\{[^}]*\})?\[", expr), expr  # one label's series may be picked
            assert "by (le)" in expr, expr


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_panels_use_the_provisioned_datasource(path):
    dashboard = load_dashboard(path)
    uid = DATASOURCES["datasources"][0]["uid"]
    panels = [p for p in walk_panels(dashboard["panels"]) if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid, panel["title"]
    ids = [p["id"] for p in walk_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


# Provisioning and scraping ----------------------------------------------------------------
def mounts(service: str) -> dict[str, tuple[Path, str]]:
    """Container path -> (host path, mode) of a compose service's bind mounts."""
    result = {}
    for volume in SERVICES[service]["volumes"]:
        host, container, mode = volume.split(":")
        result[container] = ((COMPOSE_DIR / host).resolve(), mode)
    return result


def test_monitoring_services_mount_the_repo_files_read_only():
    prometheus, grafana = mounts("prometheus"), mounts("grafana")
    config = prometheus["/etc/prometheus/prometheus.yml"]
    assert config == ((COMPOSE_DIR / "prometheus.yml").resolve(), "ro")
    assert grafana["/etc/grafana/provisioning"] == ((GRAFANA / "provisioning").resolve(), "ro")
    (provider,) = PROVIDERS["providers"]
    dashboards_dir = provider["options"]["path"]
    assert grafana[dashboards_dir] == ((GRAFANA / "dashboards").resolve(), "ro")
    assert "9090:9090" in SERVICES["prometheus"]["ports"]
    assert "3000:3000" in SERVICES["grafana"]["ports"]


def test_datasource_points_at_the_prometheus_service():
    (source,) = DATASOURCES["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"


def scrape_targets(job: str) -> set[tuple[str, int]]:
    (config,) = [c for c in PROMETHEUS["scrape_configs"] if c["job_name"] == job]
    assert config.get("metrics_path", "/metrics") == "/metrics"
    targets = set()
    for static in config.get("static_configs", []):
        for target in static["targets"]:
            host, _, port = target.rpartition(":")
            targets.add((host, int(port)))
    for dns in config.get("dns_sd_configs", []):
        targets.update((name, int(dns["port"])) for name in dns["names"])
    return targets


def drivetrain_services(role: str) -> dict[str, dict]:
    return {name: s for name, s in SERVICES.items() if isinstance(s.get("command"), list) and s["command"][:1] == [role]}


def test_prometheus_scrapes_every_edge_on_its_client_port():
    edges = drivetrain_services("edge")
    assert edges
    expected = {(name, int(service["environment"]["DRIVETRAIN_PORT"])) for name, service in edges.items()}
    assert scrape_targets("edge") == expected


@pytest.mark.parametrize("role", ["worker", "router"])
def test_prometheus_scrapes_workers_and_routers_on_their_metrics_port(role):
    services = drivetrain_services(role)
    assert services
    expected = set()
    for name, service in services.items():
        port = int(service["environment"]["DRIVETRAIN_METRICS_PORT"])
        assert port > 0, f"{name} serves no /metrics"
        expected.add((name, port))
    assert scrape_targets(role) == expected
