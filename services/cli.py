"""The `drivetrain` command: the one module that knows every service. Infrastructure, the three
services, a supervised local fleet, the settings reference, and clients.

Importing it loads no torch: an edge process starts through here too.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from services.edge.settings import EdgeSettings
from services.edge.tenants import TenantsError
from services.router.settings import RouterSettings
from services.worker.settings import WorkerSettings
from shared.infra import command as infra_command
from shared.models.errors import ModelError
from shared.service_settings import ServiceSettings
from shared.settings import (
    Settings,
    SettingsError,
    add_arguments,
    from_arguments,
    from_environment,
)

READY_TIMEOUT_S = 600  # `up`: the longest a fleet may take to serve, once its services are started
COMPILING_READY_TIMEOUT_S = 1800  # ...when its workers compile their CPU decode graphs first

if TYPE_CHECKING:
    from services.launcher.regions import RegionFleets
    from shared.infra.settings import InfraSettings

SERVICES: dict[str, type[Settings]] = {"edge": EdgeSettings, "worker": WorkerSettings, "router": RouterSettings}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drivetrain", description="Serve a language model to many people at once.")
    sub = parser.add_subparsers(dest="command", required=True)

    infra_command.add_arguments(sub.add_parser("infra", help="local Kafka and Redis Cluster: up | down | status"))

    for name, cls in SERVICES.items():
        service = sub.add_parser(name, help=cls.__doc__, description=cls.__doc__)
        service.set_defaults(settings_source=add_arguments(service, cls))

    up = sub.add_parser("up", help="start infrastructure and a supervised local fleet; Ctrl-C stops it")
    up.add_argument("--model", default="smollm2", help="model the fleet serves (default smollm2)")
    up.add_argument("--echo-delay-ms", type=float, default=0.0, help="echo model: sleep per step")
    up.add_argument("--edges", type=int, default=1)
    up.add_argument("--workers", type=int, default=1)
    up.add_argument("--routers", type=int, default=1)
    up.add_argument(
        "--decode-workers", type=int, default=0,
        help="of the workers, this many decode and the rest prefill (disaggregated); 0: every worker does both",
    )  # fmt: skip
    up.add_argument("--base-port", type=int, default=8080, help="edge i serves clients on this + i; every other port follows")
    up.add_argument("--no-restart", action="store_true", help="leave a child that dies dead")
    up.add_argument(
        "--regions", type=int, default=1,
        help="local regions, each a whole fleet of the sizes above with its own topics (r1 at --base-port, r2 500 ports "
        "above, ...), peers of each other with 35 ms added each way; a region nearly full overflows to the other",
    )  # fmt: skip
    up.add_argument("--log-dir", type=Path, help="one log file per child (default: INFRA_DIR/logs/fleet)")

    from services.edge import tenants_command

    tenants_command.add_arguments(sub.add_parser("tenants", help="the tenants file: add | list | rotate-key | revoke"))

    from services.router import usage_command

    usage_command.add_usage_arguments(sub.add_parser("usage", help="tokens and money per tenant, from the usage counters"))

    members = sub.add_parser("members", help="the fleet as one member sees it (SWIM gossip)")
    members.add_argument("--address", default="127.0.0.1:7946", help="gossip address of any member")
    members.add_argument("--json", action="store_true", help="JSON instead of a table")
    members.set_defaults(settings_source=add_arguments(members, ServiceSettings))

    chat = sub.add_parser(
        "chat", help="stream one reply, or with no text chat in the terminal (/help lists the commands)"
    )
    chat.add_argument("text", nargs="?", help="one question; without it, an interactive multi-turn session")
    chat.add_argument("--url", default="ws://127.0.0.1:8080/v1/chat")
    chat.add_argument("--api-key", default="dev-key")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--system", default="", help="system prompt, sent first each turn (/system changes it)")
    chat.add_argument("--json", action="store_true", help="print each frame received as a line of JSON")

    from services.worker.generate import GenerateSettings
    from services.worker.generate import add_arguments as add_generate_arguments

    generate = sub.add_parser("generate", help="run prompts through the engine in this process")
    add_generate_arguments(generate)
    generate.set_defaults(settings_source=add_arguments(generate, GenerateSettings))

    settings = sub.add_parser("settings", help="every setting of every command, as a Markdown reference")
    settings.add_argument("--write", type=Path, help="rewrite the generated part of this file (docs/configuration.md)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (SettingsError, ModelError, TenantsError) as exc:  # said in a line, not a traceback
        print(f"drivetrain {args.command}: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "infra":
        return infra_command.run(args)
    if args.command in SERVICES:
        settings = from_arguments(SERVICES[args.command], args.settings_source, args)
        _service_main(args.command)(settings)
        return 0
    if args.command == "up":
        return _up(args)
    if args.command == "tenants":
        from services.edge import tenants_command

        return tenants_command.run(args)
    if args.command == "usage":
        from services.router import usage_command

        return usage_command.run(args, from_arguments(usage_command.UsageSettings, args.settings_source, args))
    if args.command == "members":
        return _members(args, from_arguments(ServiceSettings, args.settings_source, args))
    if args.command == "chat":
        from shared import chat_terminal

        params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
        return chat_terminal.run(args.url, args.api_key, args.text, params, args.system, args.json)
    if args.command == "generate":
        from services.worker import generate

        return generate.run(from_arguments(generate.GenerateSettings, args.settings_source, args), args)
    if args.command == "settings":
        from services.settings_reference import print_or_write

        return print_or_write(args.write)
    return 2


def _service_main(name: str):
    if name == "edge":
        from services.edge.main import main
    elif name == "worker":
        from services.worker.main import main
    else:
        from services.router.main import main
    return main


def _members(args: argparse.Namespace, settings: ServiceSettings) -> int:
    import asyncio

    from shared.addresses import parse_address
    from shared.membership import members_json, members_table, query_members

    try:
        rows = asyncio.run(query_members(parse_address(args.address), settings.membership()))
    except TimeoutError as exc:
        print(f"{exc} (is a member listening there, with this cluster name and key?)", file=sys.stderr)
        return 1
    print(members_json(rows) if args.json else members_table(rows))
    return 0


def _regions(args: argparse.Namespace, infra: InfraSettings, log_dir: Path) -> tuple[RegionFleets, list[str]]:
    from services.launcher.regions import (
        create_region_topics,
        local_regions,
        region_fleets,
    )
    from services.launcher.restarts import RestartPolicy

    regions = local_regions(
        args.regions, args.base_port, edges=args.edges, workers=args.workers, routers=args.routers,
        model=args.model, echo_delay_ms=args.echo_delay_ms, decode_workers=args.decode_workers,
    )  # fmt: skip
    create_region_topics(infra, regions)
    fleets = region_fleets(regions, log_dir, policy=RestartPolicy(restart=not args.no_restart))
    return fleets, [f"{region.name} {region.spec.chat_url()}" for region in regions]


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def ready_timeout_s(model: str, worker: WorkerSettings) -> float:
    """How long `up` waits for its fleet to serve. A worker that compiles its CPU decode graphs
    before it serves takes minutes (~5 on 2 cores) and is not stuck."""
    compiling = model != "echo" and worker.engine.cpu_compile == "on"
    return COMPILING_READY_TIMEOUT_S if compiling else READY_TIMEOUT_S


def _up(args: argparse.Namespace) -> int:
    from services.launcher.fleet import Fleet
    from services.launcher.restarts import RestartPolicy
    from services.launcher.spec import FleetSpec
    from shared.infra.command import create_topics, ensure_up

    if args.decode_workers and not 0 < args.decode_workers < args.workers:
        print("drivetrain up: --decode-workers must leave at least one of --workers to prefill", file=sys.stderr)
        return 2
    infra = ensure_up()
    # The fleet's own topics, whatever prefix DRIVETRAIN_TOPICS_PREFIX gives it.
    create_topics(infra, from_environment(ServiceSettings).topics)
    log_dir = args.log_dir or infra.infra_dir / "logs" / "fleet"
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = FleetSpec.at(
        args.base_port, edges=args.edges, workers=args.workers, routers=args.routers,
        model=args.model, echo_delay_ms=args.echo_delay_ms, decode_workers=args.decode_workers,
    )
    fleet = Fleet(spec, log_dir=log_dir, policy=RestartPolicy(restart=not args.no_restart))
    urls = [spec.chat_url()]
    if args.regions > 1:  # services/launcher/regions.py: one such fleet per region
        fleet, urls = _regions(args, infra, log_dir)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        fleet.start(ready_timeout_s=ready_timeout_s(args.model, from_environment(WorkerSettings)))
        print(f"\nDrivetrain is up: {', '.join(urls)} (API key dev-key)")
        print('Try: drivetrain chat "What is the capital of France?"   Ctrl-C stops.\n', flush=True)
        while True:
            time.sleep(0.25)
            fleet.supervise()
    except KeyboardInterrupt:
        print("\nstopping…", flush=True)
    except (RuntimeError, TimeoutError) as exc:  # the fleet did not come up; what it started is stopped
        print(f"\n{exc}; stopping", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C or SIGTERM must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
