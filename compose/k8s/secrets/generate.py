"""Makes the files kustomization.yaml turns into the fleet's Secrets: a fresh random password for
each role's Kafka and Redis user, KEDA's Kafka login, and the fleet (gossip) secret.

All or nothing: the passwords appear in more than one file (a role's env file, the KafkaUsers'
file, the Redis ACL file), so they are made together and never half-replaced. Run it from the
repository's virtualenv: `.venv/bin/python compose/k8s/secrets/generate.py [FOLDER]`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys
from pathlib import Path

from shared.infra.permissions import SERVICE_ROLES, Role, redis_acl_file

# The Kafka user KEDA reads consumer-group lag as (compose/k8s/strimzi/users.yaml).
KEDA_USER = "keda"
FLEET_FILE = "fleet.env"
KAFKA_USERS_FILE = "kafka-users.env"
KEDA_FILE = "keda.env"
REDIS_ACL_FILE = "redis-users.acl"
REDIS_ADMIN_FILE = "redis-admin.env"


def role_file(role: Role) -> str:
    return f"{role}.env"


def made_files() -> list[str]:
    return [FLEET_FILE, *(role_file(r) for r in SERVICE_ROLES), KEDA_FILE, KAFKA_USERS_FILE, REDIS_ACL_FILE, REDIS_ADMIN_FILE]


def new_password() -> str:
    # Hex only: safe in env files, JAAS strings and ACL files alike.
    return secrets.token_hex(24)


def secret_files(kafka: dict[str, str], redis: dict[Role, str], fleet_secret: str) -> dict[str, str]:
    """File name -> content. `kafka` holds the service roles' and KEDA's passwords, `redis` every Role's."""
    files = {FLEET_FILE: f"DRIVETRAIN_GOSSIP_SECRET={fleet_secret}\n"}
    for role in SERVICE_ROLES:
        files[role_file(role)] = f"DRIVETRAIN_KAFKA_PASSWORD={kafka[role]}\nDRIVETRAIN_REDIS_PASSWORD={redis[role]}\n"
    files[KEDA_FILE] = f"sasl=scram_sha512\nusername={KEDA_USER}\npassword={kafka[KEDA_USER]}\ntls=enable\n"
    files[KAFKA_USERS_FILE] = "".join(f"{user}={password}\n" for user, password in kafka.items())
    files[REDIS_ACL_FILE] = redis_acl_file({role: hashlib.sha256(pw.encode()).hexdigest() for role, pw in redis.items()})
    files[REDIS_ADMIN_FILE] = f"REDIS_ADMIN_PASSWORD={redis[Role.ADMIN]}\n"
    return files


def generate(folder: Path) -> list[str]:
    """Writes every file (owner-only) unless all exist already; returns the names written."""
    existing = [name for name in made_files() if (folder / name).exists()]
    if len(existing) == len(made_files()):
        return []
    if existing:
        raise SystemExit(f"{folder} holds only some of the files ({', '.join(existing)}): delete them to start afresh")
    kafka = {str(role): new_password() for role in SERVICE_ROLES} | {KEDA_USER: new_password()}
    files = secret_files(kafka, {role: new_password() for role in Role}, secrets.token_hex(32))
    for name, text in files.items():
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
    return list(files)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=Path(__file__).parent)
    written = generate(parser.parse_args(argv).folder)
    print(f"wrote {', '.join(written)}" if written else "every file exists already; nothing written", file=sys.stderr)


if __name__ == "__main__":
    main()
