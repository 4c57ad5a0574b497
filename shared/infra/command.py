"""`drivetrain infra up|down|status`: start, stop and inspect the local Kafka and Redis.

`ensure_up` is the same `up` for Python callers (the test suite's session fixture).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from shared.infra import InfraError, MissingPrerequisite, kafka, redis_cluster
from shared.infra.config import InfraConfig, kafka_bootstrap, load_config

COMPONENTS = ("kafka", "redis")
Report = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


def _quiet(_: str) -> None:
    pass


def _kafka_up(cfg: InfraConfig, report: Report) -> None:
    current = kafka.up(cfg, report)
    missing = current.missing_topics(cfg)
    if not current.answering or missing:
        raise InfraError(f"Kafka came up without topics {missing}")


def _redis_up(cfg: InfraConfig, report: Report) -> None:
    redis_cluster.up(cfg, report)


def up(cfg: InfraConfig, only: tuple[str, ...] = COMPONENTS, report: Report = _print) -> None:
    """Bring the chosen components up, side by side, and raise if any did not make it."""
    steps = {"kafka": _kafka_up, "redis": _redis_up}
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


def ensure_up(cfg: InfraConfig | None = None, report: Report = _quiet) -> None:
    """Start what is not running and return once Kafka and Redis are ready; raise if not."""
    up(cfg or load_config(), COMPONENTS, report)


def down(cfg: InfraConfig, only: tuple[str, ...], purge: bool, report: Report = _print) -> None:
    if "kafka" in only:
        if not kafka.stop_broker(cfg, report):
            report("kafka: not running")
            if kafka.answers(cfg):
                report(f"kafka: WARNING a broker not started from {cfg.infra_dir} "
                       f"still answers on {kafka_bootstrap(cfg)}")  # fmt: skip
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


def status_lines(cfg: InfraConfig, only: tuple[str, ...]) -> tuple[bool, list[str]]:
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
            f"kafka  {'up' if is_up else 'DOWN':4}  {kafka_bootstrap(cfg)} (controller "
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
    return all_up, lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drivetrain infra",
        description="Local Kafka (KRaft, from Maven jars) and Redis Cluster, no Docker.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    only = argparse.ArgumentParser(add_help=False)
    only.add_argument("--only", choices=COMPONENTS, help="act on one component")
    sub.add_parser("up", parents=[only], help="start, create topics, wait until ready")
    down_parser = sub.add_parser("down", parents=[only], help="stop Kafka and Redis")
    down_parser.add_argument(
        "--purge", action="store_true", help="also delete their data (keeps the jars)"
    )
    sub.add_parser("status", parents=[only], help="up/down per component; exit 0 if all up")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of `drivetrain infra ...`; returns the process exit status."""
    args = _parser().parse_args(argv)
    # The CLI prints its own, clearer errors; aiokafka's connection retries are noise.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        cfg = load_config()
    except ValueError as exc:
        print(f"infra: bad configuration: {exc}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
