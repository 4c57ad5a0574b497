"""compose/k8s renders, validates against the Kubernetes schemas, and agrees with the code's settings.

No cluster runs here. Each overlay is rendered by the pinned kubectl's kustomize; core resources
go through kubernetes-validate (strict), KEDA's and Prometheus Operator's through validators
generated from their API types. Then every container's environment is loaded into the service's
own settings class, so a renamed variable, port or path fails here rather than in a deploy.
Scaling, Kafka and Redis are checked in test_k8s_infra.py.
"""

from pathlib import Path

import pytest

from services.edge import main as edge_main
from services.router import main as router_main
from services.worker import main as worker_main
from shared.addresses import parse_addresses
from shared.health import Health, health_route
from shared.models.shapes import SHAPES
from shared.settings import setting_docs
from tests.unit import k8s_manifests as k8s
from tests.unit.test_compose import SERVICES as COMPOSE_SERVICES

ROLES = k8s.ROLES
OVERLAYS = ("gpu", "cpu")
NAMESPACE = "drivetrain"
HEALTH_PATH = health_route(Health("edge", "x")).path
# How long each role's stop may take past its drain timeout before its backstop ends it.
BACKSTOP_S = {"edge": edge_main.DRAIN_BACKSTOP_MARGIN_S, "worker": worker_main.DRAIN_BACKSTOP_MARGIN_S}
# Variables the manifests may set that are not settings: where caches go on a read-only root, and
# the user name torch puts in them.
NOT_SETTINGS = {"HOME", "USER"}


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> list[k8s.Resource]:
    return k8s.render_secrets(tmp_path_factory.mktemp("k8s") / "secrets")


settings = k8s.role_settings


# Rendering and schemas ---------------------------------------------------------------------------
@pytest.mark.parametrize("folder", ["overlays/gpu", "overlays/cpu", "redis"])
def test_core_resources_validate_against_the_kubernetes_schemas(folder):
    errors = k8s.schema_errors(k8s.rendered(folder))
    assert not errors, "\n".join(errors)


def test_secrets_validate_against_the_kubernetes_schemas(secrets):
    errors = k8s.schema_errors(secrets)
    assert not errors, "\n".join(errors)


def test_keda_and_prometheus_operator_resources_validate_against_their_schemas():
    custom = [r for r in k8s.overlay("gpu") if r["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/"))]
    assert {r["kind"] for r in custom} == {"ScaledObject", "TriggerAuthentication", "PodMonitor"}
    errors = k8s.crd_errors(custom)
    assert not errors, "\n".join(errors)


def test_the_validators_reject_a_broken_resource():
    """The checks above could fail: a wrong type is caught by each validator."""
    deployment = dict(k8s.deployment(k8s.overlay("cpu"), "edge"))
    deployment["spec"] = {**deployment["spec"], "replicas": "one"}
    assert k8s.schema_errors([deployment])
    scaled = next(r for r in k8s.overlay("gpu") if r["kind"] == "ScaledObject")
    assert k8s.crd_errors([{**scaled, "spec": {**scaled["spec"], "minReplicaCount": "one"}}])


# Every variable is a setting, and the settings it makes are what the manifests assume ------------
def known(role: str) -> set[str]:
    return {doc.env for doc in setting_docs(ROLES[role])}


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ROLES)
def test_every_variable_of_a_role_is_one_of_its_settings(overlay, role, secrets):
    """Its own env entries and its own Secret; the shared ConfigMap is checked below."""
    resources = k8s.overlay(overlay)
    spec = k8s.container(resources, role)
    own = {var["name"] for var in spec["env"]} | set(k8s.one(secrets, "Secret", f"drivetrain-{role}")["data"])
    unknown = own - known(role) - NOT_SETTINGS
    assert not unknown, f"{role} sets variables no setting reads: {sorted(unknown)}"
    settings(overlay, role, secrets)  # and they validate


def test_every_fleet_wide_variable_is_read_by_a_role(secrets):
    config = k8s.find(k8s.overlay("gpu"), "ConfigMap")[0]["data"]
    fleet = k8s.one(secrets, "Secret", "drivetrain-fleet")["data"]
    unread = (set(config) | set(fleet)) - set().union(*(known(role) for role in ROLES))
    assert not unread, f"no role reads {sorted(unread)}"


@pytest.mark.parametrize("role", ROLES)
def test_container_ports_are_the_ports_the_settings_serve(role, secrets):
    s = settings("gpu", role, secrets)
    spec = k8s.container(k8s.overlay("gpu"), role)
    serving = {"http": (s.port, "TCP"), "internal": (s.internal.port, "TCP")} if role == "edge" else {"metrics": (s.metrics.port, "TCP")}
    assert k8s.ports(spec) == serving | {"gossip": (s.gossip.port, "UDP")}
    assert all(port > 0 for port, _ in k8s.ports(spec).values())


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ROLES)
def test_probes_ask_healthz_where_the_role_serves_it(overlay, role, secrets):
    s = settings(overlay, role, secrets)
    spec = k8s.container(k8s.overlay(overlay), role)
    health_port = s.port if role == "edge" else s.metrics.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = spec[probe]["httpGet"]
        assert get["path"] == HEALTH_PATH, (role, probe)
        assert k8s.ports(spec)[get["port"]][0] == health_port, (role, probe)


@pytest.mark.parametrize("role", ROLES)
def test_grace_period_covers_the_drain_and_its_backstop(role, secrets):
    """SIGKILL must not cut a drain short, and a stuck process must not linger much past it."""
    s = settings("gpu", role, secrets)
    pod = k8s.pod_spec(k8s.overlay("gpu"), role)
    pre_stop = k8s.container(k8s.overlay("gpu"), role).get("lifecycle", {}).get("preStop")
    sleep_s = int(pre_stop["exec"]["command"][1]) if pre_stop else 0
    needed = sleep_s + (router_main.STOP_BACKSTOP_S if role == "router" else s.drain_timeout_s + BACKSTOP_S[role])
    assert needed <= pod["terminationGracePeriodSeconds"] <= needed + 10


def test_edges_leave_the_client_service_before_they_drain():
    pre_stop = k8s.container(k8s.overlay("gpu"), "edge")["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and int(pre_stop[1]) > 0


@pytest.mark.parametrize("role", ROLES)
def test_listeners_are_reachable_and_published_at_the_pod_address(role, secrets):
    s = settings("gpu", role, secrets)
    binds = [s.gossip.host] + ([s.host] if role == "edge" else [s.metrics.host])
    assert "127.0.0.1" not in binds, f"{role} binds to loopback only"
    assert s.gossip.advertised_host == k8s.POD_IP
    assert s.membership().secret_bytes
    if role == "edge":
        assert s.internal.host == k8s.POD_IP  # what gossip tells routers to dial
        assert s.edge_id == k8s.POD_NAME


@pytest.mark.parametrize("role", ROLES)
def test_no_address_left_pointing_at_the_compose_stack(role, secrets):
    s = settings("gpu", role, secrets)
    hosts = [h for h, _ in parse_addresses(s.kafka.bootstrap) + s.redis.startup_nodes() + s.gossip.seed_addresses()]
    assert not set(hosts) & set(COMPOSE_SERVICES), f"{role} still names compose services: {hosts}"


def test_gossip_seeds_are_headless_services_that_reach_every_role(secrets):
    resources = k8s.overlay("gpu")
    reached = set()
    for host, port in settings("gpu", "edge", secrets).gossip.seed_addresses():
        service = k8s.one(resources, "Service", host)["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"], host
        assert {"port": port, "protocol": "UDP"}.items() <= next(p for p in service["ports"] if p["name"] == "gossip").items()
        reached.add(service["selector"]["app.kubernetes.io/component"])
    assert reached == set(ROLES)


@pytest.mark.parametrize("role", ROLES)
def test_each_role_logs_in_as_itself_with_its_own_secret(role, secrets):
    s = settings("gpu", role, secrets)
    assert s.kafka.username == s.redis.username == role
    assert str(s.kafka.security_protocol) == "SASL_SSL" and s.redis.ssl, "a pod network spans hosts: TLS"
    assert s.kafka.password and s.redis.password
    refs = {src["secretRef"]["name"] for src in k8s.container(k8s.overlay("gpu"), role)["envFrom"] if "secretRef" in src}
    assert refs == {"drivetrain-fleet", f"drivetrain-{role}"}, "one leaked Secret opens one role's doors"


@pytest.mark.parametrize("role", ROLES)
def test_certificate_and_tenant_files_are_mounted_from_secrets_that_hold_them(role, secrets):
    s = settings("gpu", role, secrets)
    files = [s.kafka.ssl_cafile, s.redis.ssl_ca_certs] + ([s.tenants_file] if role == "edge" else [])
    for path in files:
        name, key = k8s.mounted_file(k8s.overlay("gpu"), role, Path(path))
        assert key in k8s.one(secrets, "Secret", name)["data"], (role, path)


def test_edges_and_workers_serve_one_model_on_one_topic_layout(secrets):
    edge, worker, router = (settings("gpu", r, secrets) for r in ("edge", "worker", "router"))
    assert (edge.model, edge.max_model_len) == (worker.model, worker.max_model_len)
    assert edge.topics == worker.topics == router.topics


def test_client_service_fronts_edges_and_internal_ports_stay_headless(secrets):
    resources, s = k8s.overlay("gpu"), settings("gpu", "edge", secrets)
    client = k8s.one(resources, "Service", "drivetrain-edge")["spec"]
    assert client["selector"]["app.kubernetes.io/component"] == "edge"
    assert [p["targetPort"] for p in client["ports"]] == ["http"]
    peers = k8s.one(resources, "Service", "drivetrain-edge-peers")["spec"]
    assert peers["clusterIP"] == "None"
    assert {(p["port"], p["protocol"]) for p in peers["ports"]} == {(s.internal.port, "TCP"), (s.gossip.port, "UDP")}
    for service in k8s.find(resources, "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", "nothing is exposed outside the cluster"


@pytest.mark.parametrize("role", ROLES)
def test_disruption_budgets_cover_each_deployment(role):
    resources = k8s.overlay("gpu")
    pdb = k8s.one(resources, "PodDisruptionBudget", f"drivetrain-{role}")["spec"]
    labels = k8s.deployment(resources, role)["spec"]["template"]["metadata"]["labels"]
    assert k8s.selects(pdb["selector"], labels) and pdb["maxUnavailable"] == 1


# GPUs and sizing -------------------------------------------------------------------------------
def test_gpu_workers_take_one_whole_gpu_each_and_cpu_workers_none(secrets):
    gpu = k8s.container(k8s.overlay("gpu"), "worker")
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert settings("gpu", "worker", secrets).device == "cuda"
    cpu = k8s.overlay("cpu")
    assert not [v for r in cpu for v in k8s.walk(r) if isinstance(v, dict) and "nvidia.com/gpu" in v]
    assert "tolerations" not in k8s.pod_spec(cpu, "worker")
    assert settings("cpu", "worker", secrets).device == "cpu"


GIB = 2**30


def test_worker_memory_holds_the_weights_of_the_shape_it_is_sized_for():
    """docs/operations.md: bf16 weights are 2 bytes a parameter; they pass through host memory."""
    worker = k8s.deployment(k8s.overlay("gpu"), "worker")["spec"]["template"]
    shape = SHAPES[worker["metadata"]["annotations"]["drivetrain.io/sized-for"]]
    request = worker["spec"]["containers"][0]["resources"]["requests"]["memory"]
    assert request.endswith("Gi") and int(request[:-2]) * GIB >= 2 * shape.num_params() + 4 * GIB


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_requests_cpu_and_memory_and_caps_memory(overlay):
    for role in ROLES:
        resources = k8s.container(k8s.overlay(overlay), role)["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"], role


# Network policies encode docs/security.md -------------------------------------------------------
FLEET = {"app.kubernetes.io/part-of": "drivetrain"}


def pod(role: str) -> dict[str, str]:
    return FLEET | {"app.kubernetes.io/component": role}


def allowed(target: str, port: str, protocol: str, source_ns: str, source: dict[str, str]) -> bool:
    resources = k8s.overlay("gpu")
    policies = k8s.find(resources, "NetworkPolicy")
    named = k8s.ports(k8s.container(resources, target))
    return k8s.ingress_allowed(policies, NAMESPACE, pod(target), port, protocol, source_ns, source, named)


def test_only_routers_reach_an_edges_internal_port():
    assert allowed("edge", "internal", "TCP", NAMESPACE, pod("router"))
    assert not allowed("edge", "internal", "TCP", NAMESPACE, pod("worker"))
    assert not allowed("edge", "internal", "TCP", NAMESPACE, pod("edge"))
    assert not allowed("edge", "internal", "TCP", "other", pod("router"))


def test_clients_reach_the_edges_client_port_and_nothing_else():
    outsider = {"app": "anything"}
    assert allowed("edge", "http", "TCP", "ingress", outsider)
    for role in ROLES:
        assert not allowed(role, "gossip", "UDP", "ingress", outsider), role
    assert not allowed("worker", "metrics", "TCP", "ingress", outsider)


def test_gossip_is_members_only_and_metrics_are_prometheus_only():
    for target in ROLES:
        for source in ROLES:
            assert allowed(target, "gossip", "UDP", NAMESPACE, pod(source)), (source, target)
        assert not allowed(target, "gossip", "UDP", NAMESPACE, {"app": "stranger"}), target
    for target in ("worker", "router"):
        assert allowed(target, "metrics", "TCP", "monitoring", {"app.kubernetes.io/name": "prometheus"})
        assert not allowed(target, "metrics", "TCP", NAMESPACE, pod("edge"))
