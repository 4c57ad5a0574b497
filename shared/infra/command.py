"""`drivetrain infra up|down|status`: start, stop and inspect the local Kafka and Redis.

`ensure_up` is the same `up` for Python callers (the test suite's session fixture), and
`create_topics` / `fresh_topics` give a fleet its topics.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from shared.infra import credentials, kafka, redis_cluster
from shared.infra.acls import grant_roles
from shared.infra.errors import InfraError, MissingPrerequisite
from shared.infra.process import run_sync
from shared.infra.settings import InfraSettings
from shared.infra.topics import ensure_topics
from shared.settings import SettingsError, from_arguments, from_environment
from shared.settings import add_arguments as add_settings_arguments
from shared.topics import TopicLayout

log = logging.getLogger(__name__)

COMPONENTS = ("kafka", "redis")
Report = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


def _quiet(_: str) -> None:
    pass


def _kafka_up(cfg: InfraSettings, report: Report) -> None:
    current = kafka.up(cfg, report)
    missing = current.missing_topics(cfg)
    if not current.answering or missing:
        raise InfraError(f"Kafka came up without topics {missing}")


def _redis_up(cfg: InfraSettings, report: Report) -> None:
    redis_cluster.up(cfg, report)


def up(cfg: InfraSettings, only: tuple[str, ...] = COMPONENTS, report: Report = _print) -> None:
    """Bring the chosen components up, side by side, and raise if any did not make it."""
    steps = {"kafka": _kafka_up, "redis": _redis_up}
    if cfg.secure:
        # Made here, before the two start side by side, so both use the same passwords.
        credentials.load_or_create(cfg)
    # The broker's JVM start and the cluster's replica sync both wait on their own
    # processes, so running them together roughly halves a cold start.
    with ThreadPoolExecutor(max_workers=len(only), thread_name_prefix="infra-up") as pool:
        futures = {name: pool.submit(steps[name], cfg, report) for name in only}
        errors = []
        for name, future in futures.items():
            try:
                future.result()
            except InfraError as exc:
                errors.append((name, exc))
    if errors:
        missing = [exc for _, exc in errors if isinstance(exc, MissingPrerequisite)]
        message = "\n".join(f"{name}: {exc}" for name, exc in errors)
        raise (MissingPrerequisite if missing else InfraError)(message)


def ensure_up(cfg: InfraSettings | None = None, report: Report = _quiet) -> InfraSettings:
    """Start what is not running and return once Kafka and Redis are ready; raise if not."""
    cfg = cfg or from_environment(InfraSettings)
    up(cfg, COMPONENTS, report)
    return cfg


def create_topics(cfg: InfraSettings, layout: TopicLayout) -> None:
    """The layout's topics on the broker, created or grown as needed (idempotent); on the
    secure broker each role is granted what it needs on them."""

    async def create() -> None:
        async with kafka.open_admin(cfg) as admin:
            await ensure_topics(admin, layout.partitions())
            if cfg.secure:
                await grant_roles(admin, layout)

    run_sync(create)


def fresh_topics(tag: str, partitions: int = 4) -> TopicLayout:
    """Topics of their own, created now: a fleet on them shares no consumer group, no
    gossip cluster and no message with any other (tests and benchmarks use this)."""
    layout = TopicLayout(prefix=f"{tag}-{uuid.uuid4().hex[:8]}", requests_partitions=partitions, tokens_partitions=partitions)
    create_topics(ensure_up(), layout)
    return layout


def drop_topics(layout: TopicLayout) -> None:
    """Delete fresh topics once their fleet is gone: a long-lived local broker would otherwise
    keep every test's and benchmark's, and load them all at each start."""

    async def drop() -> None:
        async with kafka.open_admin(from_environment(InfraSettings)) as admin:
            await admin.delete_topics(list(layout.partitions()))

    try:
        run_sync(drop)
    except Exception as exc:  # noqa: BLE001 - cleanup only: a broker that is gone keeps them, harmlessly
        log.warning("could not delete topics %s.*: %s", layout.prefix, exc)


def down(cfg: InfraSettings, only: tuple[str, ...], purge: bool, report: Report = _print) -> None:
    if "kafka" in only:
        if not kafka.stop_broker(cfg, report):
            report("kafka: not running")
            if kafka.answers(cfg):
                report(f"kafka: WARNING a broker not started from {cfg.infra_dir} "
                       f"still answers on {cfg.kafka_bootstrap}")  # fmt: skip
        if purge:
            # Data, properties, pid and logs go; the jars under infra_dir/jars stay.
            shutil.rmtree(cfg.kafka_dir, ignore_errors=True)
            report(f"kafka: removed {cfg.kafka_dir}")
    if "redis" in only:
        if not redis_cluster.down(cfg, report):
            report("redis: not running")
        if purge:
            shutil.rmtree(cfg.redis_dir, ignore_errors=True)
            report(f"redis: removed {cfg.redis_dir}")
    if purge and cfg.secure and set(only) == set(COMPONENTS):
        # Both stores are gone, so nothing uses these passwords any more.
        shutil.rmtree(cfg.state_dir, ignore_errors=True)
        report(f"secrets: removed {cfg.state_dir}")


def status_lines(cfg: InfraSettings, only: tuple[str, ...]) -> tuple[bool, list[str]]:
    """One line per component, and whether all of them are up."""
    all_up, lines = True, []
    if "kafka" in only:
        k = kafka.status(cfg)
        missing = k.missing_topics(cfg)
        is_up = k.answering and not missing
        all_up &= is_up
        if k.pid:
            pid = f"pid {k.pid}"
        else:
            pid = "not started from " + str(cfg.infra_dir) if k.answering else "no process"
        topics = f"topics missing: {missing}" if missing else f"{len(k.topics)} topics"
        detail = topics if k.answering else ("starting or stuck" if k.pid else "not running")
        lines.append(
            f"kafka  {'up' if is_up else 'DOWN':4}  {cfg.kafka_bootstrap} (controller "
            f"{cfg.kafka_host}:{cfg.kafka_controller_port})  {pid}  {detail}  "
            f"log {cfg.kafka_log_file}"
        )
    if "redis" in only:
        r = redis_cluster.status(cfg)
        all_up &= r.ready
        ports = cfg.redis_ports
        span = f"{cfg.redis_host}:{ports[0]}-{ports[-1]}" if ports else "-"
        lines.append(
            f"redis  {'up' if r.ready else 'DOWN':4}  {span}  {redis_cluster.describe(r)}  "
            f"logs {cfg.redis_dir}/<port>/redis.log"
        )
    if cfg.secure:
        where = cfg.role_env_file("ROLE") if cfg.secrets_file.exists() else "none yet (`up --secure` makes them)"
        lines.append(f"secrets  {cfg.secrets_file}; per role (admin, edge, worker, router): {where}")
    return all_up, lines


ACTIONS = {
    "up": "start, create topics, wait until ready",
    "down": "stop Kafka and Redis",
    "status": "up/down per component; exit 0 if all up",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The actions, each with `--only` and every infrastructure setting as a flag."""
    actions = parser.add_subparsers(dest="action", required=True)
    for name, help_text in ACTIONS.items():
        action = actions.add_parser(name, help=help_text, description=InfraSettings.__doc__)
        action.add_argument("--only", choices=COMPONENTS, help="act on one component")
        if name == "down":
            action.add_argument("--purge", action="store_true", help="also delete their data (keeps the jars)")
        action.set_defaults(infra_settings=add_settings_arguments(action, InfraSettings))


def run(args: argparse.Namespace) -> int:
    """`drivetrain infra ACTION`, from parsed arguments; returns the process exit status."""
    # The CLI prints its own, clearer errors; aiokafka's connection retries are noise.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        cfg = from_arguments(InfraSettings, args.infra_settings, args)
    except SettingsError as exc:
        print(f"infra: {exc}", file=sys.stderr)
        return 2
    only = (args.only,) if args.only else COMPONENTS
    started = time.monotonic()
    try:
        if args.action == "up":
            up(cfg, only)
            _, lines = status_lines(cfg, only)
            print("\n".join(lines))
            print(f"infra: up in {time.monotonic() - started:.1f} s")
            return 0
        if args.action == "down":
            down(cfg, only, args.purge)
            return 0
        all_up, lines = status_lines(cfg, only)
        print("\n".join(lines))
        return 0 if all_up else 1
    except MissingPrerequisite as exc:
        print(f"infra: missing prerequisite:\n{exc}", file=sys.stderr)
        return 3
    except InfraError as exc:
        print(f"infra: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="drivetrain infra", description=InfraSettings.__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
