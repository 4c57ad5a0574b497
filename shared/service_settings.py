"""The settings every service shares: where Kafka and the Redis Cluster are, its topics, its gossip.

The defaults are the local profile (the infrastructure `drivetrain infra up` starts, on
loopback); `compose` points at the docker-compose stack's services and gossips on the LAN.
"""

from __future__ import annotations

from typing import Any, ClassVar

from shared.addresses import parse_addresses
from shared.infra.settings import LOCAL_HOST, LOCAL_KAFKA_PORT, LOCAL_REDIS_PORTS
from shared.membership.settings import LAN, MembershipSettings
from shared.settings import ProfiledSettings, Section
from shared.topics import TopicLayout


class KafkaSettings(Section):
    bootstrap: str = f"{LOCAL_HOST}:{LOCAL_KAFKA_PORT}"
    """Kafka bootstrap servers, host:port[,host:port]"""


class RedisSettings(Section):
    nodes: str = ",".join(f"{LOCAL_HOST}:{port}" for port in LOCAL_REDIS_PORTS[:3])
    """Redis Cluster startup nodes, host:port[,host:port]; the client finds the rest of the cluster from any one"""

    def startup_nodes(self) -> list[tuple[str, int]]:
        return parse_addresses(self.nodes)


class MetricsSettings(Section):
    host: str = LOCAL_HOST
    """address of the HTTP endpoint that serves /metrics and /healthz"""
    port: int = 0
    """port of that endpoint; 0 serves none"""


class ServiceSettings(ProfiledSettings):
    profiles: ClassVar[dict[str, dict[str, Any]]] = {
        "compose": {
            "kafka": {"bootstrap": "kafka:9092"},
            "redis": {"nodes": "redis-0:7000,redis-1:7000,redis-2:7000"},
            "gossip": {**LAN, "seeds": "edge-0:7946"},
            "metrics": {"host": "0.0.0.0"},
        },
    }

    log_level: str = "INFO"
    """Python logging level"""
    topics: TopicLayout = TopicLayout()
    kafka: KafkaSettings = KafkaSettings()
    redis: RedisSettings = RedisSettings()
    gossip: MembershipSettings = MembershipSettings()

    def membership(self) -> MembershipSettings:
        """The gossip settings as this fleet uses them: its cluster is named by the topic prefix."""
        return self.gossip if self.gossip.cluster_name else self.gossip.replace(cluster_name=self.topics.prefix)
