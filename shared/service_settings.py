"""The settings every service shares: where Kafka and the Redis Cluster are, its topics, its gossip.

The defaults are the local profile (the infrastructure `drivetrain infra up` starts, on
loopback); `compose` points at the docker-compose stack's services and gossips on the LAN.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

import uvloop
from aiokafka.helpers import create_ssl_context
from pydantic import SecretStr

from shared.addresses import parse_addresses
from shared.infra.settings import LOCAL_HOST, LOCAL_KAFKA_PORT, LOCAL_REDIS_PORTS
from shared.membership.settings import LAN, MembershipSettings
from shared.settings import ProfiledSettings, Section
from shared.topics import TopicLayout


class KafkaSecurityProtocol(StrEnum):
    PLAINTEXT = "PLAINTEXT"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"


class SaslMechanism(StrEnum):
    SCRAM_SHA_512 = "SCRAM-SHA-512"
    SCRAM_SHA_256 = "SCRAM-SHA-256"
    PLAIN = "PLAIN"


class EventLoop(StrEnum):
    UVLOOP = "uvloop"
    ASYNCIO = "asyncio"

    def factory(self) -> Callable[[], asyncio.AbstractEventLoop]:
        return uvloop.new_event_loop if self is EventLoop.UVLOOP else asyncio.new_event_loop


class KafkaSettings(Section):
    bootstrap: str = f"{LOCAL_HOST}:{LOCAL_KAFKA_PORT}"
    """Kafka bootstrap servers, host:port[,host:port]"""
    security_protocol: KafkaSecurityProtocol = KafkaSecurityProtocol.PLAINTEXT
    """PLAINTEXT (loopback only) | SASL_PLAINTEXT (log in; on one host) | SASL_SSL (log in over TLS; any hop that leaves the host)"""
    sasl_mechanism: SaslMechanism = SaslMechanism.SCRAM_SHA_512
    """how a SASL login proves the password (docs/security.md)"""
    username: str | None = None
    """Kafka user this service logs in as (its role: edge, worker or router); ACLs name it"""
    password: SecretStr | None = None
    """that user's password"""
    ssl_cafile: Path | None = None
    """CA certificate that signs the brokers' TLS certificates (SASL_SSL); none trusts the system's CAs"""

    def client_options(self) -> dict[str, Any]:
        """aiokafka keyword arguments for this security: none on PLAINTEXT."""
        if self.security_protocol is KafkaSecurityProtocol.PLAINTEXT:
            return {}
        options: dict[str, Any] = {
            "security_protocol": str(self.security_protocol),
            "sasl_mechanism": str(self.sasl_mechanism),
            "sasl_plain_username": self.username,
            "sasl_plain_password": self.password.get_secret_value() if self.password else None,
        }
        if self.security_protocol is KafkaSecurityProtocol.SASL_SSL:
            options["ssl_context"] = create_ssl_context(cafile=str(self.ssl_cafile) if self.ssl_cafile else None)
        return options


class RedisSettings(Section):
    nodes: str = ",".join(f"{LOCAL_HOST}:{port}" for port in LOCAL_REDIS_PORTS[:3])
    """Redis Cluster startup nodes, host:port[,host:port]; the client finds the rest of the cluster from any one"""

    username: str | None = None
    """Redis ACL user this service logs in as (its role: edge, worker or router); none is the default user"""
    password: SecretStr | None = None
    """that user's password"""
    ssl: bool = False
    """talk TLS to the nodes (any hop that leaves the host)"""
    ssl_ca_certs: Path | None = None
    """CA certificate that signs the nodes' TLS certificates; none trusts the system's CAs"""

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
    event_loop: EventLoop = EventLoop.UVLOOP
    """the asyncio loop the service runs on: uvloop (libuv's; less CPU per socket write and Kafka record) | asyncio (the standard library's)"""
    topics: TopicLayout = TopicLayout()
    kafka: KafkaSettings = KafkaSettings()
    redis: RedisSettings = RedisSettings()
    gossip: MembershipSettings = MembershipSettings()

    @property
    def fleet_secret(self) -> bytes:
        """The gossip secret keys every internal message too: Kafka records and the router -> edge link."""
        return self.gossip.secret_bytes

    def membership(self) -> MembershipSettings:
        """The gossip settings as this fleet uses them: its cluster is named by the topic prefix."""
        return self.gossip if self.gossip.cluster_name else self.gossip.replace(cluster_name=self.topics.prefix)
