"""Settings of the local Kafka broker and Redis Cluster that `drivetrain infra` runs on this machine.

Loaded like every command's settings (flags > DRIVETRAIN_* environment > defaults); the
services' own defaults point at what this starts (LOCAL_*), so a fresh machine needs none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import TypeAdapter, field_validator, model_validator
from pydantic_settings import NoDecode

from shared.settings import Settings
from shared.topics import TopicLayout

REPO_ROOT = Path(__file__).resolve().parents[2]
# Static files (the Maven POM that fetches Kafka, its log4j2 config) live here.
COMPOSE_LOCAL_DIR = REPO_ROOT / "compose" / "local"
LOCAL_HOST = "127.0.0.1"
LOCAL_KAFKA_PORT = 9092
LOCAL_REDIS_PORTS = (7000, 7001, 7002, 7003, 7004, 7005)
# The secure infrastructure runs beside the plain one, so it has ports of its own.
SECURE_KAFKA_PORT = 9192
SECURE_KAFKA_CONTROLLER_PORT = 9193
SECURE_REDIS_PORTS = (7100, 7101, 7102, 7103, 7104, 7105)


class InfraSettings(Settings):
    """drivetrain infra: a local Apache Kafka (KRaft, from Maven jars) and Redis Cluster, no Docker."""

    infra_dir: Path = REPO_ROOT / ".infra"
    """root of all state: cached jars, broker and Redis data, pid and log files"""
    secure: bool = False
    """the secure infrastructure instead: Kafka SASL/SCRAM with ACLs per role, Redis ACL users, generated passwords; its state lives in INFRA_DIR/secure and its ports default to 9192/9193 and 7100-7105, so it runs beside the plain one"""
    kafka_version: str = "4.1.1"
    """org.apache.kafka:kafka_2.13 version fetched from Maven Central"""
    log4j_version: str = "2.24.3"
    """log4j2 version of the slf4j binding added beside Kafka (its POM lacks one)"""
    kafka_host: str = LOCAL_HOST
    """address of the broker's listeners; loopback keeps it private"""
    kafka_port: int = LOCAL_KAFKA_PORT
    """listener for producers, consumers and admin clients"""
    kafka_controller_port: int = 9093
    """KRaft controller listener of the same combined node"""
    kafka_heap: str = "512M"
    """JVM heap (-Xms and -Xmx); a single local node needs little"""
    kafka_offsets_partitions: int = 4
    """partitions of __consumer_offsets: few, so the first consumer group is quick"""
    redis_host: str = LOCAL_HOST
    """address the Redis nodes bind to and announce"""
    redis_ports: Annotated[tuple[int, ...], NoDecode] = LOCAL_REDIS_PORTS
    """one Redis Cluster node per port, 7000-7005 or 7000,7001,...; port + 10000 is each node's cluster bus"""
    redis_replicas: int = 1
    """replicas per master given to `redis-cli --cluster create`; the ports must hold at least 3 masters"""
    redis_node_timeout_ms: int = 2000
    """cluster-node-timeout: how long a silent master lasts before failover starts"""
    kafka_ready_timeout_s: float = 90.0
    """how long `up` waits for the broker to answer an admin request"""
    redis_ready_timeout_s: float = 60.0
    """how long `up` waits for cluster_state:ok, replica links up, replicas in slot maps"""
    kafka_stop_timeout_s: float = 30.0
    """how long `down` waits after SIGTERM before it sends SIGKILL to the broker"""
    download_timeout_s: float = 900.0
    """upper bound on the one-time Maven download of the Kafka jars"""
    topics: TopicLayout = TopicLayout()

    @model_validator(mode="before")
    @classmethod
    def _secure_ports(cls, data: object) -> object:
        """Secure mode moves the ports that were not given, so both modes can run at once."""
        if not isinstance(data, dict) or not TypeAdapter(bool).validate_python(data.get("secure", False)):
            return data
        defaults = {
            "kafka_port": SECURE_KAFKA_PORT,
            "kafka_controller_port": SECURE_KAFKA_CONTROLLER_PORT,
            "redis_ports": SECURE_REDIS_PORTS,
        }
        return {**defaults, **data}

    @field_validator("infra_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @field_validator("redis_ports", mode="before")
    @classmethod
    def _port_list(cls, value: object) -> object:
        """Accept "7000-7005" or "7000,7001,7002" as well as a list."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if "-" in text and "," not in text:
            low, high = (int(part) for part in text.split("-", 1))
            return tuple(range(low, high + 1))
        return tuple(int(part) for part in text.split(",") if part.strip())

    @model_validator(mode="after")
    def _three_masters(self) -> InfraSettings:
        if len(self.redis_ports) < 3 * (self.redis_replicas + 1):
            raise ValueError(
                f"a Redis Cluster needs at least 3 masters: {len(self.redis_ports)} ports "
                f"cannot hold 3 masters with {self.redis_replicas} replica(s) each"
            )
        return self

    @property
    def kafka_bootstrap(self) -> str:
        """bootstrap_servers for clients of this broker, e.g. "127.0.0.1:9092"."""
        return f"{self.kafka_host}:{self.kafka_port}"

    def redis_startup_nodes(self) -> list[tuple[str, int]]:
        return [(self.redis_host, port) for port in self.redis_ports]

    @property
    def state_dir(self) -> Path:
        """Where this mode keeps its data; the jars under infra_dir/jars serve both modes."""
        return self.infra_dir / "secure" if self.secure else self.infra_dir

    @property
    def secrets_file(self) -> Path:
        """The generated passwords of the secure mode (JSON, readable by its owner only)."""
        return self.state_dir / "secrets.json"

    def role_env_file(self, role: str) -> Path:
        """DRIVETRAIN_* lines that give one role's service its secure addresses and credentials."""
        return self.state_dir / "env" / f"{role}.env"

    @property
    def kafka_dir(self) -> Path:
        return self.state_dir / "kafka"

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
        return self.state_dir / "redis"

    def redis_node_dir(self, port: int) -> Path:
        return self.redis_dir / str(port)

    def redis_log_file(self, port: int) -> Path:
        return self.redis_node_dir(port) / "redis.log"
