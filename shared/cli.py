"""The `drivetrain` command: infrastructure, the three services, a local fleet, and clients."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from shared.config import add_config_arguments, config_from_namespace

SERVICES = {
    "edge": ("services.edge.config", "EdgeConfig", "services.edge.main"),
    "worker": ("services.worker.config", "WorkerConfig", "services.worker.main"),
    "router": ("services.router.config", "RouterConfig", "services.router.main"),
}


def _service_config_class(name: str) -> type:
    import importlib

    module, cls, _ = SERVICES[name]
    return getattr(importlib.import_module(module), cls)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drivetrain", description="Serve a language model to many people at once.")
    sub = parser.add_subparsers(dest="command", required=True)

    infra = sub.add_parser("infra", help="local Kafka and Redis Cluster: up | down | status")
    infra.add_argument("infra_args", nargs=argparse.REMAINDER)

    for name in SERVICES:
        cls = _service_config_class(name)
        add_config_arguments(sub.add_parser(name, help=cls.__doc__, description=cls.__doc__), cls)

    up = sub.add_parser("up", help="start infrastructure and a local fleet; Ctrl-C stops it")
    up.add_argument("--model", default="smollm2", help="model the workers serve (default smollm2)")
    up.add_argument("--echo-delay-ms", type=float, default=0.0, help="echo model: sleep per step")
    up.add_argument("--edges", type=int, default=1)
    up.add_argument("--workers", type=int, default=1)
    up.add_argument("--routers", type=int, default=1)

    members = sub.add_parser("members", help="the fleet as one member sees it (SWIM gossip)")
    members.add_argument("--address", default="127.0.0.1:7946", help="gossip address of any member")
    members.add_argument("--cluster", default="drivetrain", help="cluster name (the fleet's topic prefix)")
    members.add_argument("--profile", default="local", help="gossip profile: local | lan")
    members.add_argument("--secret", default="", help="gossip key (default: the profile's)")
    members.add_argument("--json", action="store_true", help="JSON instead of a table")

    chat = sub.add_parser("chat", help="send one chat and stream the reply")
    chat.add_argument("text")
    chat.add_argument("--url", default="ws://127.0.0.1:8080/v1/chat")
    chat.add_argument("--api-key", default="dev-key")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)

    from services.worker import generate

    generate.add_arguments(sub.add_parser("generate", help="run prompts through the engine in this process"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "infra":
        from shared.infra.command import main as infra_main

        return infra_main(args.infra_args)
    if args.command in SERVICES:
        import importlib

        config = config_from_namespace(_service_config_class(args.command), args)
        importlib.import_module(SERVICES[args.command][2]).main(config)
        return 0
    if args.command == "up":
        return _up(args)
    if args.command == "members":
        return _members(args)
    if args.command == "chat":
        from shared.chat_client import stream_chat

        return stream_chat(args.url, args.api_key, args.text, args.max_tokens, args.temperature)
    if args.command == "generate":
        from services.worker import generate

        return generate.run(args)
    return 2


def _members(args: argparse.Namespace) -> int:
    import asyncio

    from shared.config import parse_address
    from shared.membership import members_json, members_table, profile, query_members

    overrides = {"cluster_name": args.cluster, **({"secret": args.secret} if args.secret else {})}
    try:
        rows = asyncio.run(query_members(parse_address(args.address), profile(args.profile, **overrides)))
    except TimeoutError as exc:
        print(f"{exc} (is a member listening there, with this cluster name and key?)", file=sys.stderr)
        return 1
    print(members_json(rows) if args.json else members_table(rows))
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _up(args: argparse.Namespace) -> int:
    from shared.infra import ensure_up, load_config
    from shared.launcher import Fleet, FleetSpec

    infra = load_config()
    ensure_up(infra)
    log_dir = Path(infra.infra_dir) / "logs" / "fleet"
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = FleetSpec(args.edges, args.workers, args.routers, args.model, args.echo_delay_ms)
    fleet = Fleet(spec, log_dir=log_dir)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        fleet.start(ready_timeout_s=600)
        print(f"\nDrivetrain is up: {spec.chat_url()} (API key dev-key)")
        print('Try: drivetrain chat "What is the capital of France?"   Ctrl-C stops.\n', flush=True)
        while True:
            time.sleep(1)
            fleet.check_alive()
    except KeyboardInterrupt:
        print("\nstopping…", flush=True)
    except RuntimeError as exc:  # a child died
        print(f"\n{exc}; stopping", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
