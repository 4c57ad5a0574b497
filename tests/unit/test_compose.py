"""The compose stack cannot run here, so check that it agrees with the code's config."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.edge.settings import EdgeSettings
from services.router.settings import RouterSettings
from services.worker.settings import WorkerSettings
from shared.addresses import parse_address
from shared.service_settings import ServiceSettings
from shared.settings import setting_docs
from shared.topics import TopicLayout

COMPOSE = yaml.safe_load((Path(__file__).parents[2] / "compose" / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
ROLES = {"edge": EdgeSettings, "router": RouterSettings, "worker": WorkerSettings}


def drivetrain_services():
    for name, service in SERVICES.items():
        command = service.get("command")
        if isinstance(command, list) and command and command[0] in ROLES:
            yield name, service, ROLES[command[0]]


def test_every_role_is_in_the_stack():
    assert {cls for _, _, cls in drivetrain_services()} == set(ROLES.values())


def test_environment_names_real_settings():
    for name, service, cls in drivetrain_services():
        known = {doc.env for doc in setting_docs(cls)}
        unknown = set(service["environment"]) - known
        assert not unknown, f"{name} sets variables no setting reads: {unknown}"


def test_compose_profile_points_at_stack_services():
    profile = ServiceSettings(profile="compose")
    host, port = parse_address(profile.kafka.bootstrap)
    assert host in SERVICES and f"PLAINTEXT://{host}:{port}" in SERVICES[host]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    for node in profile.redis.nodes.split(","):
        host, port = parse_address(node)
        assert host in SERVICES and f"--port {port}" in " ".join(SERVICES[host]["command"])


def test_edge_ports_and_router_peers_agree():
    edge = SERVICES["edge-0"]
    port = int(edge["environment"]["DRIVETRAIN_PORT"])
    internal = int(edge["environment"]["DRIVETRAIN_INTERNAL_PORT"])
    assert f"{port}:{port}" in edge["ports"]
    peers = RouterSettings(edges=SERVICES["router"]["environment"]["DRIVETRAIN_EDGES"]).edge_addresses()
    assert peers == {"edge-0": ("edge-0", internal)}


def test_topics_created_match_the_layout():
    script = "\n".join(SERVICES["kafka-init"]["command"])
    layout = TopicLayout()
    for topic, partitions in layout.partitions().items():
        suffix = topic.removeprefix(layout.prefix + ".")
        assert f"{suffix}:{partitions}" in script


def test_workers_reserve_a_gpu():
    devices = SERVICES["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_every_service_is_health_checked_on_its_own_endpoint():
    for name, service, cls in drivetrain_services():
        env = service["environment"]
        port = env.get("DRIVETRAIN_PORT") if cls is EdgeSettings else env.get("DRIVETRAIN_METRICS_PORT")
        assert port, f"{name} serves no /healthz"
        assert service["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/healthz", name


SECURE = yaml.safe_load((Path(__file__).parents[2] / "compose" / "docker-compose.secure.yml").read_text())


def test_secure_overlay_logs_each_role_in_as_itself_with_secrets_from_the_env_file():
    for name, service, cls in drivetrain_services():
        env = SECURE["services"][name]["environment"]
        role = service["command"][0]
        assert set(env) <= {doc.env for doc in setting_docs(cls)}, name
        assert env["DRIVETRAIN_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
        assert env["DRIVETRAIN_KAFKA_USERNAME"] == env["DRIVETRAIN_REDIS_USERNAME"] == role
        for key in ("DRIVETRAIN_KAFKA_PASSWORD", "DRIVETRAIN_REDIS_PASSWORD"):
            assert env[key].startswith("${") and env[key].endswith(":?set in compose/secure.env}"), (name, key)


def test_secure_overlay_secures_every_redis_node_and_the_broker():
    redis_nodes = [name for name in SERVICES if name.startswith("redis-") and name != "redis-init"]
    assert redis_nodes and all(SECURE["services"][n]["command"] == ["/secure/redis-start.sh"] for n in redis_nodes)
    assert SECURE["services"]["kafka"]["entrypoint"] == ["/secure/kafka-start.sh"]
    assert "--user admin" in SECURE["services"]["redis-init"]["command"]


# A real Compose parses and validates both files (`config` needs no Docker engine) ----------------
COMPOSE_DIR = Path(__file__).parents[2] / "compose"


def docker_compose(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is missing: `make test` installs Debian's docker-compose (make system-deps)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DRIVETRAIN_", "COMPOSE_", "KAFKA_", "REDIS_"))}
    return subprocess.run([binary, *args, "config", "-q"], capture_output=True, text=True, env=clean | env, timeout=120)


def test_docker_compose_validates_the_stack():
    done = docker_compose(["-f", str(COMPOSE_DIR / "docker-compose.yml")], {"DRIVETRAIN_GOSSIP_SECRET": "x" * 32})
    assert done.returncode == 0, done.stderr


def test_docker_compose_refuses_the_stack_without_a_gossip_secret():
    done = docker_compose(["-f", str(COMPOSE_DIR / "docker-compose.yml")], {})
    assert done.returncode != 0 and "DRIVETRAIN_GOSSIP_SECRET" in done.stderr


def test_docker_compose_validates_the_secure_overlay_with_every_secret_of_the_example(tmp_path):
    names = [line.split("=")[0] for line in (COMPOSE_DIR / "secure.env.example").read_text().splitlines() if "=" in line and not line.startswith("#")]
    env_file = tmp_path / "secure.env"
    env_file.write_text("".join(f"{name}={name.lower()}-value\n" for name in names))
    files = ["-f", str(COMPOSE_DIR / "docker-compose.yml"), "-f", str(COMPOSE_DIR / "docker-compose.secure.yml")]
    done = docker_compose(["--env-file", str(env_file), *files], {})
    assert done.returncode == 0, done.stderr
    env_file.write_text("".join(f"{name}=v\n" for name in names if name != "KAFKA_EDGE_PASSWORD"))
    refused = docker_compose(["--env-file", str(env_file), *files], {})
    assert refused.returncode != 0 and "KAFKA_EDGE_PASSWORD" in refused.stderr


DISAGGREGATED = yaml.safe_load((COMPOSE_DIR / "docker-compose.disaggregated.yml").read_text())["services"]


def test_the_disaggregated_overlay_runs_a_prefill_and_a_decode_worker_with_real_settings():
    known = {doc.env for doc in setting_docs(WorkerSettings)}
    assert DISAGGREGATED["worker"]["environment"] == {"DRIVETRAIN_ROLE": "prefill"}
    decode = DISAGGREGATED["decode-worker"]
    assert decode["command"] == SERVICES["worker"]["command"] and set(decode["environment"]) <= known
    settings = WorkerSettings(role=decode["environment"]["DRIVETRAIN_ROLE"], kv_link={"host": "0.0.0.0", "port": 9300})
    assert settings.role == "decode" and decode["environment"]["DRIVETRAIN_KV_LINK_PORT"] == str(settings.kv_link.port)
    files = ["-f", str(COMPOSE_DIR / "docker-compose.yml"), "-f", str(COMPOSE_DIR / "docker-compose.disaggregated.yml")]
    done = docker_compose(files, {"DRIVETRAIN_GOSSIP_SECRET": "x" * 32})
    assert done.returncode == 0, done.stderr
