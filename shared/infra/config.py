"""Settings of the local Kafka broker and Redis Cluster, with `DRIVETRAIN_*` overrides.

Also the small helpers services and tests use to find them: `kafka_bootstrap`,
`redis_startup_nodes`, `ensure_up`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.topics import TopicLayout

REPO_ROOT = Path(__file__).resolve().parents[2]
# Static files (the Maven POM that fetches Kafka, its log4j2 config) live here.
COMPOSE_LOCAL_DIR = REPO_ROOT / "compose" / "local"


@dataclass(frozen=True)
class InfraConfig:
    """Where and how the local infrastructure runs; every field has a default."""

    # Root of all state: cached jars, broker and Redis data, pid and log files.
    infra_dir: Path = REPO_ROOT / ".infra"
    # org.apache.kafka:kafka_2.13 version fetched from Maven Central.
    kafka_version: str = "4.1.1"
    # log4j2 version of the slf4j binding added beside Kafka (its POM lacks one).
    log4j_version: str = "2.24.3"
    # Address clients and the broker listener use; loopback keeps it private.
    kafka_host: str = "127.0.0.1"
    # PLAINTEXT listener for producers, consumers and admin clients.
    kafka_port: int = 9092
    # KRaft controller listener of the same combined node.
    kafka_controller_port: int = 9093
    # JVM heap (-Xms and -Xmx); a single local node needs little.
    kafka_heap: str = "512M"
    # Partitions of __consumer_offsets: few, so the first consumer group is quick.
    kafka_offsets_partitions: int = 4
    # Address the Redis nodes bind to and announce.
    redis_host: str = "127.0.0.1"
    # One Redis Cluster node per port; with one replica each, half become masters.
    # Each node also listens on port + 10000 (cluster bus): keep those free too.
    redis_ports: tuple[int, ...] = (7000, 7001, 7002, 7003, 7004, 7005)
    # Replicas per master given to `redis-cli --cluster create`.
    redis_replicas: int = 1
    # cluster-node-timeout: how long a silent master lasts before failover starts.
    redis_node_timeout_ms: int = 2000
    # How long `up` waits for the broker to answer an admin request.
    kafka_ready_timeout_s: float = 90.0
    # How long `up` waits for cluster_state:ok, replica links up, replicas in slot maps.
    redis_ready_timeout_s: float = 60.0
    # How long `down` waits after SIGTERM before it sends SIGKILL to the broker.
    kafka_stop_timeout_s: float = 30.0
    # Upper bound on the one-time Maven download of the Kafka jars.
    download_timeout_s: float = 900.0
    # Project topics and their partition counts, created by `up`.
    topic_layout: TopicLayout = field(default_factory=TopicLayout)

    @property
    def kafka_dir(self) -> Path:
        return self.infra_dir / "kafka"

    @property
    def kafka_lib_dir(self) -> Path:
        # Outside kafka_dir so that `down --purge` keeps the downloaded jars.
        return self.infra_dir / "jars" / f"kafka_2.13-{self.kafka_version}"

    @property
    def kafka_data_dir(self) -> Path:
        return self.kafka_dir / "data"

    @property
    def kafka_properties_file(self) -> Path:
        return self.kafka_dir / "server.properties"

    @property
    def kafka_pid_file(self) -> Path:
        return self.kafka_dir / "kafka.pid"

    @property
    def kafka_log_file(self) -> Path:
        return self.kafka_dir / "kafka.log"

    @property
    def redis_dir(self) -> Path:
        return self.infra_dir / "redis"

    def redis_node_dir(self, port: int) -> Path:
        return self.redis_dir / str(port)

    def redis_log_file(self, port: int) -> Path:
        return self.redis_node_dir(port) / "redis.log"


def _parse_ports(text: str) -> tuple[int, ...]:
    """Accept "7000-7005" or "7000,7001,7002"."""
    text = text.strip()
    if "-" in text and "," not in text:
        low, high = (int(part) for part in text.split("-", 1))
        return tuple(range(low, high + 1))
    return tuple(int(part) for part in text.split(",") if part.strip())


def _layout_from_env(env: Mapping[str, str]) -> TopicLayout:
    # DRIVETRAIN_REQUESTS_PARTITIONS=16 and so on, one per partition count, and the
    # services' own DRIVETRAIN_TOPIC_PREFIX, so `up` creates the topics they will use.
    overrides: dict[str, object] = {
        f.name: int(env[key])
        for f in dataclasses.fields(TopicLayout)
        if f.name.endswith("_partitions") and (key := f"DRIVETRAIN_{f.name.upper()}") in env
    }
    if "DRIVETRAIN_TOPIC_PREFIX" in env:
        overrides["prefix"] = env["DRIVETRAIN_TOPIC_PREFIX"]
    return TopicLayout(**overrides)  # type: ignore[arg-type]


def load_config(env: Mapping[str, str] | None = None) -> InfraConfig:
    """Defaults, overridden by DRIVETRAIN_<FIELD> variables (e.g. DRIVETRAIN_KAFKA_PORT)."""
    env = os.environ if env is None else env
    converters = {
        "infra_dir": lambda v: Path(v).expanduser().resolve(),
        "redis_ports": _parse_ports,
    }
    values: dict[str, object] = {}
    for f in dataclasses.fields(InfraConfig):
        key = f"DRIVETRAIN_{f.name.upper()}"
        if f.name == "topic_layout" or key not in env:
            continue
        default = getattr(InfraConfig, f.name, None)
        convert = converters.get(f.name) or type(default)
        try:
            values[f.name] = convert(env[key])
        except ValueError as exc:
            raise ValueError(f"{key}={env[key]!r}: {exc}") from exc
    values["topic_layout"] = _layout_from_env(env)
    cfg = InfraConfig(**values)  # type: ignore[arg-type]
    if len(cfg.redis_ports) < 3 * (cfg.redis_replicas + 1):
        raise ValueError(
            f"a Redis Cluster needs at least 3 masters: {len(cfg.redis_ports)} ports "
            f"cannot hold 3 masters with {cfg.redis_replicas} replica(s) each"
        )
    return cfg


def kafka_bootstrap(cfg: InfraConfig) -> str:
    """bootstrap_servers for aiokafka clients, e.g. "127.0.0.1:9092"."""
    return f"{cfg.kafka_host}:{cfg.kafka_port}"


def redis_startup_nodes(cfg: InfraConfig) -> list[tuple[str, int]]:
    """(host, port) of every cluster node, for redis-py's RedisCluster startup_nodes."""
    return [(cfg.redis_host, port) for port in cfg.redis_ports]


def ensure_up(cfg: InfraConfig | None = None) -> None:
    """Start whatever is not running and return once Kafka and Redis are ready."""
    # Imported here because the orchestration module itself imports this one.
    from shared.infra.command import ensure_up as _ensure_up

    _ensure_up(cfg or load_config())
