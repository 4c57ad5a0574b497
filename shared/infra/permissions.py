"""What each service role may do on Kafka and Redis: least privilege, as plain data.

The roles' needs are read off the code: the edge writes requests and control messages
and keeps routes; a worker reads requests and control, writes tokens and dead letters,
and reads who claimed a request; a router reads tokens and routes, writes dead letters
and claims; workers and edges write usage records, which routers read and count in Redis
(`drivetrain usage` reads the counters as admin). Kafka gets them as ACL bindings on one fleet's topics and groups, Redis as
ACL rules (commands plus key patterns). Nothing here talks to a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum

from shared.topics import TopicLayout


class Role(StrEnum):
    """Who a credential belongs to; `admin` creates topics, grants ACLs and forms the cluster."""

    ADMIN = "admin"
    EDGE = "edge"
    WORKER = "worker"
    ROUTER = "router"


SERVICE_ROLES = (Role.EDGE, Role.WORKER, Role.ROUTER)


# Kafka's wire codes (org.apache.kafka.common.acl / resource), as CreateAcls carries them.
class ResourceType(IntEnum):
    TOPIC = 2
    GROUP = 3


class Operation(IntEnum):
    READ = 3
    WRITE = 4
    DESCRIBE = 8


@dataclass(frozen=True)
class KafkaGrant:
    """ALLOW `operation` on the literal resource `name` to User:`role`, from any host."""

    role: Role
    resource: ResourceType
    name: str
    operation: Operation

    @property
    def principal(self) -> str:
        return f"User:{self.role}"


def worker_group(topics: TopicLayout) -> str:
    return f"{topics.prefix}-workers"


def router_group(topics: TopicLayout) -> str:
    return f"{topics.prefix}-routers"


def usage_meter_group(topics: TopicLayout) -> str:
    """The routers' second group: the usage topic's aggregate (shared/metering)."""
    return f"{topics.prefix}-usage-meter"


def kafka_grants(topics: TopicLayout) -> list[KafkaGrant]:
    """The ACLs one fleet's topics need. Read and Write imply Describe; Write on a topic
    also lets an idempotent producer get its producer id (KIP-679), so no cluster ACL."""
    t, g = ResourceType.TOPIC, ResourceType.GROUP
    read, write = Operation.READ, Operation.WRITE
    edge, worker, router = Role.EDGE, Role.WORKER, Role.ROUTER
    return [
        KafkaGrant(edge, t, topics.requests, write),
        KafkaGrant(edge, t, topics.control, write),
        KafkaGrant(worker, t, topics.requests, read),
        KafkaGrant(worker, t, topics.control, read),
        KafkaGrant(worker, t, topics.tokens, write),
        KafkaGrant(worker, t, topics.dead_letter, write),
        KafkaGrant(worker, g, worker_group(topics), read),
        KafkaGrant(router, t, topics.tokens, read),
        KafkaGrant(router, t, topics.dead_letter, write),
        KafkaGrant(router, g, router_group(topics), read),
        # Usage: workers and edges report finished requests, routers count them.
        KafkaGrant(worker, t, topics.usage, write),
        KafkaGrant(edge, t, topics.usage, write),
        KafkaGrant(router, t, topics.usage, read),
        KafkaGrant(router, g, usage_meter_group(topics), read),
        # KV-cache events: workers tell every edge what their prefix caches hold (read without a
        # group); an edge dead-letters a record it cannot read.
        KafkaGrant(worker, t, topics.kv_events, write),
        KafkaGrant(edge, t, topics.kv_events, read),
        KafkaGrant(edge, t, topics.dead_letter, write),
    ]


# What redis-py's cluster client sends besides the data commands: the handshake, the slot
# map and command table it loads, its name. CLIENT SETINFO is left out (Redis 7.0 lacks
# it and rejects the ACL file); redis-py ignores its refusal.
_CLIENT_COMMANDS = "+auth +hello +ping +readonly +command +cluster|slots +cluster|shards +cluster|nodes +client|setname"

# Each role's data commands and key patterns (shared/routing_map.py); %R~ read-only, %W~ write-only.
_REDIS_RULES = {
    Role.EDGE: "~route:* ~response:* +hset +expire +hmget +hincrby +del +get +set",  # response: response_store.py
    Role.WORKER: "%R~claim:* +get",
    Role.ROUTER: "%R~route:* %W~claim:* ~usage:* +hmget +set +eval +hincrby +expire +sadd",  # usage: ledger.py
}


def redis_acl_line(role: Role, password_sha256: str) -> str:
    """One `user` line of an ACL file; the password is given as its SHA-256, never in clear."""
    secret = f"#{password_sha256}"
    if role is Role.ADMIN:
        return f"user {role} on {secret} ~* &* +@all"
    return f"user {role} on {secret} resetchannels {_REDIS_RULES[role]} {_CLIENT_COMMANDS}"


def redis_acl_file(password_sha256: dict[Role, str]) -> str:
    """A whole ACL file: the roles' users, and the default (password-less) user switched off."""
    lines = ["user default off resetkeys resetchannels -@all"]
    lines += [redis_acl_line(role, password_sha256[role]) for role in Role]
    return "\n".join(lines) + "\n"
