"""compose/k8s around the fleet: KEDA's scaling, Strimzi's Kafka, the Redis namespace's policies and
the Secrets, each checked against what the code says (topics, grants, groups, metrics, settings).

KEDA and Prometheus Operator resources are validated against their schemas in test_k8s.py; no
registry ships Strimzi's, so its resources are checked field by field against short lists of
the fields used (KafkaTopic, KafkaUser, Kafka, KafkaNodePool as Strimzi documents them).
"""

import base64
import hashlib
import inspect
import re

import pytest
from prometheus_client import CollectorRegistry

from services.edge.metrics import EdgeMetrics
from services.router.metrics import RouterMetrics
from services.worker.engine.types import EngineLoad
from services.worker.metrics import WorkerMetrics
from shared.infra.permissions import (
    SERVICE_ROLES,
    Operation,
    ResourceType,
    kafka_grants,
    router_group,
    worker_group,
)
from shared.kafka_clients import make_consumer
from shared.status_server import metrics_route
from shared.topics import TOPIC_CONFIGS
from tests.unit import k8s_manifests as k8s

NAMESPACE = "drivetrain"
FLEET_POD = {"app.kubernetes.io/part-of": "drivetrain", "app.kubernetes.io/component": "worker"}
GROUP_DEFAULT_RESET = inspect.signature(make_consumer).parameters["auto_offset_reset"].default


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> list[k8s.Resource]:
    return k8s.render_secrets(tmp_path_factory.mktemp("k8s-infra") / "secrets")


def secret_value(secrets, name: str, key: str) -> str:
    return base64.b64decode(k8s.one(secrets, "Secret", name)["data"][key]).decode()


def scaled(role: str) -> k8s.Resource:
    return k8s.one(k8s.overlay("gpu"), "ScaledObject", f"drivetrain-{role}")["spec"]


def triggers(role: str, kind: str) -> list[k8s.Resource]:
    return [t for t in scaled(role)["triggers"] if t["type"] == kind]


# Scaling -----------------------------------------------------------------------------------------
# KEDA's CRDs do not reject unknown fields (the API server prunes them), so a misspelt one would
# be dropped silently; these are the fields KEDA's docs define that the manifests use.
SCALED_OBJECT_FIELDS = {"scaleTargetRef", "pollingInterval", "minReplicaCount", "maxReplicaCount", "advanced", "triggers"}
TRIGGER_FIELDS = {
    "kafka": {"bootstrapServers", "consumerGroup", "topic", "lagThreshold", "offsetResetPolicy"},
    "prometheus": {"serverAddress", "query", "threshold"},
}


@pytest.mark.parametrize("role", k8s.ROLES)
def test_each_role_scales_its_deployment_and_never_to_zero(role):
    spec = scaled(role)
    assert set(spec) <= SCALED_OBJECT_FIELDS and set(spec["advanced"]) == {"horizontalPodAutoscalerConfig"}
    assert spec["scaleTargetRef"] == {"name": k8s.deployment(k8s.overlay("gpu"), role)["metadata"]["name"]}
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    for trigger in spec["triggers"]:
        assert set(trigger["metadata"]) <= TRIGGER_FIELDS[trigger["type"]], (role, trigger["type"])


@pytest.mark.parametrize("role", k8s.ROLES)
def test_scale_down_drains_one_pod_at_a_time(role):
    """Each step waits out the last pod's whole grace period, so drains never pile up."""
    spec = scaled(role)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"keda-hpa-drivetrain-{role}"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec["scaleTargetRef"]["name"]},
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": behavior,
        },
    }
    assert not k8s.schema_errors([hpa]), "KEDA hands this behavior to the HPA as it is"
    grace = k8s.pod_spec(k8s.overlay("gpu"), role)["terminationGracePeriodSeconds"]
    down = behavior["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300
    for policy in down["policies"]:
        assert policy["type"] == "Pods" and policy["value"] == 1 and policy["periodSeconds"] >= grace, policy


def test_kafka_triggers_watch_each_roles_own_group_and_topic(secrets):
    topics = k8s.role_settings("gpu", "worker", secrets).topics
    watched = {"worker": (topics.requests, worker_group(topics)), "router": (topics.tokens, router_group(topics))}
    assert not triggers("edge", "kafka")
    for role, (topic, group) in watched.items():
        s = k8s.role_settings("gpu", role, secrets)
        (trigger,) = triggers(role, "kafka")
        meta = trigger["metadata"]
        assert (meta["topic"], meta["consumerGroup"]) == (topic, group)
        assert meta["bootstrapServers"] == s.kafka.bootstrap
        assert meta["offsetResetPolicy"] == GROUP_DEFAULT_RESET, "as the groups themselves start"
        assert trigger["authenticationRef"]["name"] == "drivetrain-keda-kafka"


def test_keda_logs_in_to_kafka_as_the_fleet_does(secrets):
    s = k8s.role_settings("gpu", "worker", secrets)
    auth = k8s.one(k8s.overlay("gpu"), "TriggerAuthentication", "drivetrain-keda-kafka")["spec"]["secretTargetRef"]
    assert {ref["parameter"] for ref in auth} == {"sasl", "username", "password", "tls", "ca"}
    for ref in auth:
        assert ref["key"] in k8s.one(secrets, "Secret", ref["name"])["data"], ref
    assert secret_value(secrets, "drivetrain-keda-kafka", "sasl") == "scram_" + str(s.kafka.sasl_mechanism).lower().removeprefix("scram-").replace("-", "")
    assert secret_value(secrets, "drivetrain-keda-kafka", "tls") == ("enable" if str(s.kafka.security_protocol) == "SASL_SSL" else "disable")
    assert secret_value(secrets, "drivetrain-keda-kafka", "ca") == secret_value(secrets, "drivetrain-tls", "kafka-ca.crt")


def test_no_more_consumers_than_partitions(secrets):
    """The extra ones would get no partition: Kafka gives each to one member of the group."""
    topics = k8s.role_settings("gpu", "worker", secrets).topics
    assert scaled("worker")["maxReplicaCount"] <= topics.requests_partitions
    assert scaled("router")["maxReplicaCount"] <= topics.tokens_partitions


def exported(role: str) -> set[str]:
    registry = CollectorRegistry()
    {"edge": EdgeMetrics, "router": RouterMetrics}.get(role, lambda r: WorkerMetrics(r, EngineLoad))(registry)
    return {family.name for family in registry.collect()}


def test_prometheus_triggers_query_what_each_role_exports():
    queried = {role: triggers(role, "prometheus") for role in k8s.ROLES}
    assert queried["edge"] and queried["worker"], "edges scale on connections, workers also on waiting tokens"
    for role, found in queried.items():
        for trigger in found:
            query = trigger["metadata"]["query"]
            names = set(re.findall(r"\bdrivetrain_[a-z0-9_]+", query))
            assert names and names <= exported(role), (role, query)
            assert f'namespace="{NAMESPACE}"' in query, "only this fleet's pods"
            host = trigger["metadata"]["serverAddress"].split("//")[1].split(":")[0]
            assert host.split(".")[1] == "monitoring", "Prometheus lives where the metrics policy admits it"


def test_pod_monitor_scrapes_every_role_where_it_serves_metrics(secrets):
    monitor = k8s.find(k8s.overlay("gpu"), "PodMonitor")[0]["spec"]
    assert monitor["jobLabel"] == "app.kubernetes.io/component", "the dashboard's job labels are the roles"
    for role in k8s.ROLES:
        spec = k8s.container(k8s.overlay("gpu"), role)
        s = k8s.role_settings("gpu", role, secrets)
        labels = k8s.deployment(k8s.overlay("gpu"), role)["spec"]["template"]["metadata"]["labels"]
        assert k8s.selects(monitor["selector"], labels)
        (endpoint,) = [e for e in monitor["podMetricsEndpoints"] if e["port"] in k8s.ports(spec)]
        assert endpoint["path"] == metrics_route(CollectorRegistry()).path
        assert k8s.ports(spec)[endpoint["port"]][0] == (s.port if role == "edge" else s.metrics.port)


# Kafka, run by Strimzi ---------------------------------------------------------------------------
STRIMZI_FIELDS = {
    "KafkaTopic": {"partitions", "replicas", "config"},
    "KafkaUser": {"authentication", "authorization"},
    "Kafka": {"kafka", "entityOperator"},
    "KafkaNodePool": {"replicas", "roles", "storage"},
}
ACL_TYPES = {ResourceType.TOPIC: "topic", ResourceType.GROUP: "group"}


def strimzi(kind: str) -> list[k8s.Resource]:
    return k8s.find(k8s.rendered("strimzi"), kind)


def acls(user: str) -> set[tuple[str, str, str]]:
    (found,) = [u for u in strimzi("KafkaUser") if u["metadata"]["name"] == user]
    rules = found["spec"]["authorization"]["acls"]
    assert all(rule["resource"]["patternType"] == "literal" for rule in rules)
    return {(rule["resource"]["type"], rule["resource"]["name"], op) for rule in rules for op in rule["operations"]}


def test_strimzi_resources_use_only_the_fields_checked_here():
    for resource in k8s.rendered("strimzi"):
        assert resource["apiVersion"] == "kafka.strimzi.io/v1beta2"
        assert set(resource["spec"]) <= STRIMZI_FIELDS[resource["kind"]], resource["metadata"]["name"]
        assert resource["metadata"]["namespace"] == "kafka"


def test_strimzi_topics_are_the_fleets_layout(secrets):
    topics = k8s.role_settings("gpu", "worker", secrets).topics
    made = {t["metadata"]["name"]: t["spec"] for t in strimzi("KafkaTopic")}
    assert {name: spec["partitions"] for name, spec in made.items()} == topics.partitions()
    for spec in made.values():
        assert TOPIC_CONFIGS.items() <= spec["config"].items()
        assert int(spec["config"]["min.insync.replicas"]) < spec["replicas"], "one broker may be down"


def test_strimzi_users_are_granted_exactly_what_the_code_grants(secrets):
    topics = k8s.role_settings("gpu", "worker", secrets).topics
    for role in SERVICE_ROLES:
        wanted = {(ACL_TYPES[g.resource], g.name, g.operation.name.title()) for g in kafka_grants(topics) if g.role is role}
        assert acls(str(role)) == wanted, role


def test_keda_may_only_describe_the_topics_and_groups_it_watches():
    watched = {(t["metadata"]["topic"], t["metadata"]["consumerGroup"]) for role in k8s.ROLES for t in triggers(role, "kafka")}
    describe = Operation.DESCRIBE.name.title()
    wanted = {("topic", t, describe) for t, _ in watched} | {("group", g, describe) for _, g in watched}
    assert acls("keda") == wanted


def test_kafka_passwords_are_the_ones_the_fleet_logs_in_with(secrets):
    users = {u["metadata"]["name"]: u["spec"]["authentication"] for u in strimzi("KafkaUser")}
    assert set(users) == {str(r) for r in SERVICE_ROLES} | {secret_value(secrets, "drivetrain-keda-kafka", "username")}
    for user, auth in users.items():
        assert auth["type"] == "scram-sha-512"
        ref = auth["password"]["valueFrom"]["secretKeyRef"]
        (secret,) = [s for s in secrets if s["metadata"]["name"] == ref["name"] and s["metadata"]["namespace"] == "kafka"]
        theirs = base64.b64decode(secret["data"][ref["key"]]).decode()
        ours = secret_value(secrets, *(("drivetrain-keda-kafka", "password") if user == "keda" else (f"drivetrain-{user}", "DRIVETRAIN_KAFKA_PASSWORD")))
        assert theirs == ours, user


def test_the_fleet_dials_strimzis_tls_listener_with_scram(secrets):
    s = k8s.role_settings("gpu", "edge", secrets)
    (kafka,) = strimzi("Kafka")
    cluster, namespace = kafka["metadata"]["name"], kafka["metadata"]["namespace"]
    (listener,) = [li for li in kafka["spec"]["kafka"]["listeners"] if f"{cluster}-kafka-bootstrap.{namespace}.svc:{li['port']}" == s.kafka.bootstrap]
    assert listener["tls"] is True and str(s.kafka.security_protocol) == "SASL_SSL"
    assert listener["authentication"]["type"] == str(s.kafka.sasl_mechanism).lower()
    assert kafka["spec"]["kafka"]["authorization"]["type"] == "simple", "ACLs apply"
    for resource in k8s.rendered("strimzi"):
        if resource["kind"] != "Kafka":
            assert resource["metadata"]["labels"]["strimzi.io/cluster"] == cluster


def test_only_the_fleet_and_keda_reach_the_kafka_listener():
    (kafka,) = strimzi("Kafka")
    (listener,) = kafka["spec"]["kafka"]["listeners"]
    policy = {"metadata": {"namespace": "kafka"}, "spec": {"podSelector": {}, "ingress": [{"from": listener["networkPolicyPeers"]}]}}

    def reaches(namespace: str, labels: dict[str, str]) -> bool:
        return k8s.ingress_allowed([policy], "kafka", {}, 9093, "TCP", namespace, labels, {})

    assert reaches(NAMESPACE, FLEET_POD) and reaches("keda", {"app": "keda-operator"})
    assert not reaches(NAMESPACE, {"app": "stranger"}) and not reaches("other", FLEET_POD)


# Redis -------------------------------------------------------------------------------------------
def test_redis_admits_the_fleet_on_its_client_port_and_nobody_on_the_bus(secrets):
    policies = k8s.find(k8s.rendered("redis"), "NetworkPolicy")
    for host, port in k8s.role_settings("gpu", "worker", secrets).redis.startup_nodes():
        namespace = host.split(".")[1]

        def reaches(source_ns: str, labels: dict[str, str], to: int) -> bool:
            return k8s.ingress_allowed(policies, namespace, {"app": "redis"}, to, "TCP", source_ns, labels, {})

        assert reaches(NAMESPACE, FLEET_POD, port)
        assert not reaches(NAMESPACE, FLEET_POD, port + 10000), "the cluster bus has no authentication"
        assert not reaches("other", FLEET_POD, port) and not reaches(NAMESPACE, {"app": "stranger"}, port)
        assert reaches(namespace, {"app": "redis"}, port + 10000), "the nodes talk among themselves"


# Secrets -----------------------------------------------------------------------------------------
def test_redis_acl_file_holds_each_roles_password(secrets):
    lines = secret_value(secrets, "drivetrain-redis-users", "users.acl").splitlines()
    assert lines[0].startswith("user default off")
    passwords = {str(r): secret_value(secrets, f"drivetrain-{r}", "DRIVETRAIN_REDIS_PASSWORD") for r in SERVICE_ROLES}
    passwords["admin"] = secret_value(secrets, "drivetrain-redis-users", "REDIS_ADMIN_PASSWORD")
    for user, password in passwords.items():
        assert any(line.startswith(f"user {user} on #{hashlib.sha256(password.encode()).hexdigest()} ") for line in lines), user


def test_generating_secrets_is_all_or_nothing(tmp_path):
    generate = k8s.load_generator()
    assert generate.generate(tmp_path) and generate.generate(tmp_path) == []
    (tmp_path / "edge.env").unlink()
    with pytest.raises(SystemExit, match="only some of the files"):
        generate.generate(tmp_path)
    assert all((tmp_path / name).stat().st_mode & 0o077 == 0 for name in generate.made_files() if (tmp_path / name).exists())
