"""Local Kafka broker and Redis Cluster for development and tests (`drivetrain infra`).

Public API: `InfraConfig`, `load_config`, `kafka_bootstrap`, `redis_startup_nodes`,
`ensure_up`; the errors below are shared by the modules of this package.
"""

from __future__ import annotations

from pathlib import Path

from shared.infra.config import (
    InfraConfig,
    ensure_up,
    kafka_bootstrap,
    load_config,
    redis_startup_nodes,
)


class InfraError(RuntimeError):
    """A component could not be brought to the state asked for; the message says why."""


class MissingPrerequisite(InfraError):
    """A tool the infrastructure needs (java, mvn, redis-server) is not installed."""


def log_tail(path: Path, lines: int = 20) -> str:
    """Last lines of a log file, to show beside an error; empty if there is none."""
    try:
        with path.open("rb") as f:
            # Logs grow large; the last 64 KiB hold far more than the lines wanted.
            f.seek(max(0, path.stat().st_size - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


__all__ = [
    "InfraConfig",
    "InfraError",
    "MissingPrerequisite",
    "ensure_up",
    "kafka_bootstrap",
    "load_config",
    "log_tail",
    "redis_startup_nodes",
]
