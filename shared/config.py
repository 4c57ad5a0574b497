"""Frozen service configs, filled from CLI flags, then DRIVETRAIN_* environment, then a named profile.

Each service declares one dataclass; `load_config` turns every field into a flag
(`--field-name`) and an environment variable (`DRIVETRAIN_FIELD_NAME`), so a field
is documented once, beside its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints

from shared.topics import TopicLayout

C = TypeVar("C")

# Values that differ from the field defaults (which are the `local` profile).
PROFILES: dict[str, dict[str, Any]] = {
    "local": {},
    "compose": {
        "kafka_bootstrap": "kafka:9092",
        "redis_nodes": "redis-0:7000,redis-1:7000,redis-2:7000",
        "host": "0.0.0.0",
        "internal_host": "0.0.0.0",
        "gossip_profile": "lan",
        "gossip_host": "0.0.0.0",
        "metrics_host": "0.0.0.0",
        "gossip_port": 7946,
        "gossip_seeds": "edge-0:7946",
    },
}


def doc(text: str, default: Any) -> Any:
    """A dataclass field whose help text travels with it to --help."""
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class CommonConfig:
    """Settings every service shares: where Kafka and Redis are, and the topic namespace."""

    profile: str = doc("named profile of defaults: local | compose", "local")
    kafka_bootstrap: str = doc("Kafka bootstrap servers, host:port[,host:port]", "127.0.0.1:9092")
    redis_nodes: str = doc("Redis Cluster startup nodes, host:port[,host:port]", "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002")
    topic_prefix: str = doc("prefix of the Kafka topic names (tests use their own)", "drivetrain")
    log_level: str = doc("logging level", "INFO")
    gossip_profile: str = doc("membership timing profile: local | lan", "local")
    gossip_host: str = doc("address the gossip (SWIM, UDP) socket binds to", "127.0.0.1")
    gossip_port: int = doc("gossip port; 0 picks a free one", 0)
    gossip_seeds: str = doc("members to join through, host:port[,host:port]", "127.0.0.1:7946")
    gossip_secret: str = doc("shared key that signs gossip packets (empty: the profile's)", "")
    metrics_host: str = doc("address the /metrics endpoint binds to (workers and routers)", "127.0.0.1")
    metrics_port: int = doc("port of the Prometheus /metrics endpoint (0: none; the edge serves it on its own port)", 0)

    @property
    def topics(self) -> TopicLayout:
        return TopicLayout(prefix=self.topic_prefix)

    def redis_startup_nodes(self) -> list[tuple[str, int]]:
        return [parse_address(a) for a in self.redis_nodes.split(",") if a]

    def gossip_seed_addresses(self) -> list[tuple[str, int]]:
        return [parse_address(a) for a in self.gossip_seeds.split(",") if a]


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {text!r}")
    return host, int(port)


def env_name(field_name: str) -> str:
    return "DRIVETRAIN_" + field_name.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


def _converter(kind: type) -> Any:
    return _parse_bool if kind is bool else kind


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field; defaults stay None so we can tell what was given."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_converter(hints[f.name]),
            default=None,
            help=f"{f.metadata.get('help', '')} (env {env_name(f.name)}, default {f.default!r})",
        )


def config_from_namespace(cls: type[C], ns: argparse.Namespace, **overrides: Any) -> C:
    """Flags win over environment, environment over profile, profile over defaults."""
    hints = get_type_hints(cls)
    given = {name: value for name, value in vars(ns).items() if value is not None}
    profile = given.get("profile") or os.environ.get(env_name("profile")) or "local"
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif f.name in given:
            values[f.name] = given[f.name]
        elif env_name(f.name) in os.environ:
            values[f.name] = _converter(hints[f.name])(os.environ[env_name(f.name)])
        elif f.name in PROFILES[profile]:
            values[f.name] = PROFILES[profile][f.name]
    values["profile"] = profile
    return cls(**values)


def load_config(cls: type[C], argv: list[str] | None = None, prog: str | None = None) -> C:
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_config_arguments(parser, cls)
    return config_from_namespace(cls, parser.parse_args(argv))
