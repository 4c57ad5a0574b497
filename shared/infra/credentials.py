"""The secure infrastructure's passwords: made on first start, kept in the secure state dir.

One Kafka user and one Redis user per role (their own passwords, so a leaked Redis
password opens no Kafka door), and the KRaft controller's own. The file and the per-role
env files are readable by their owner only; nothing here is ever committed (.infra/ is
ignored by git).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from shared.infra.errors import InfraError
from shared.infra.permissions import SERVICE_ROLES, Role
from shared.infra.settings import InfraSettings


@dataclass(frozen=True)
class InfraSecrets:
    kafka: dict[Role, str]  # role -> SCRAM password
    redis: dict[Role, str]  # role -> Redis ACL password
    controller: str  # the broker's password on the KRaft controller listener (SASL/PLAIN)

    @classmethod
    def generate(cls) -> InfraSecrets:
        # Hex only: safe inside JAAS strings, `--add-scram [..]` and ACL files alike.
        def new() -> str:
            return secrets.token_hex(24)

        return cls({r: new() for r in Role}, {r: new() for r in Role}, new())

    def redis_sha256(self) -> dict[Role, str]:
        return {role: hashlib.sha256(pw.encode()).hexdigest() for role, pw in self.redis.items()}

    def to_json(self) -> str:
        return json.dumps({"kafka": self.kafka, "redis": self.redis, "controller": self.controller}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> InfraSecrets:
        data = json.loads(text)
        return cls(
            {Role(k): v for k, v in data["kafka"].items()},
            {Role(k): v for k, v in data["redis"].items()},
            data["controller"],
        )


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, created so from the start (no window at 0644)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def load(cfg: InfraSettings) -> InfraSecrets | None:
    try:
        return InfraSecrets.from_json(cfg.secrets_file.read_text())
    except FileNotFoundError:
        return None


def require(cfg: InfraSettings) -> InfraSecrets:
    """The stored secrets; an InfraError (not a silent plain start) if there are none."""
    found = load(cfg)
    if found is None:
        raise InfraError(f"no secrets in {cfg.secrets_file}: `drivetrain infra up --secure` makes them")
    return found


def load_or_create(cfg: InfraSettings) -> InfraSecrets:
    """The stored secrets, or new ones (written with each role's env file) on first start."""
    found = load(cfg)
    if found is not None:
        return found
    created = InfraSecrets.generate()
    write_private(cfg.secrets_file, created.to_json())
    for role in Role:
        write_private(cfg.role_env_file(role), env_file_text(role_env(cfg, created, role)))
    return created


def role_env(cfg: InfraSettings, found: InfraSecrets, role: Role) -> dict[str, str]:
    """The DRIVETRAIN_* variables that point a service of `role` at this infrastructure."""
    return {
        "DRIVETRAIN_KAFKA_BOOTSTRAP": cfg.kafka_bootstrap,
        "DRIVETRAIN_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "DRIVETRAIN_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "DRIVETRAIN_KAFKA_USERNAME": str(role),
        "DRIVETRAIN_KAFKA_PASSWORD": found.kafka[role],
        "DRIVETRAIN_REDIS_NODES": ",".join(f"{h}:{p}" for h, p in cfg.redis_startup_nodes()[:3]),
        "DRIVETRAIN_REDIS_USERNAME": str(role),
        "DRIVETRAIN_REDIS_PASSWORD": found.redis[role],
    }


def env_file_text(env: dict[str, str]) -> str:
    """KEY=value lines, for `set -a; . FILE` or compose's `env_file:`."""
    return "".join(f"{key}={value}\n" for key, value in env.items())


__all__ = ["SERVICE_ROLES", "InfraSecrets", "load", "load_or_create", "require", "role_env", "write_private"]
