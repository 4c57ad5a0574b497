"""Runs the Locust chat load test headless, against a running fleet or one it starts, and plots it.

If no edge answers at --host, it starts Kafka and Redis (when they are down) and a
fleet serving the echo model on topics of its own, and stops all that it started
when Locust is done. Flags it does not know go to Locust (and to the locustfile:
--prompt-words, --max-tokens, --api-keys, --think-time, --chat-timeout …).

    python loadtest/run_locust.py -u 200 -r 50 -t 60s --prompt-words 16-64

Locust runs in a process of its own: importing it patches sockets for gevent.
Outputs: PREFIX_stats.csv, PREFIX_stats_history.csv, PREFIX_failures.csv,
PREFIX_exceptions.csv, the HTML report and a PNG of the percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from aiokafka.errors import KafkaError

ROOT = Path(__file__).resolve().parents[1]

from services.launcher.fleet import Fleet
from services.launcher.spec import FleetSpec
from shared.infra.settings import InfraSettings
from shared.topics import TopicLayout

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
RESULTS = Path(__file__).resolve().parent / "results"
METRICS = ("accepted", "ttft", "itl", "stream")
# Edge i takes clients on base+i, routers on base+1100+i, gossip (UDP) on base+2200+i:
# a fleet of its own, apart from any other on the machine.
INTERNAL_PORT_OFFSET = 1100
GOSSIP_PORT_OFFSET = 2200


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--host", default="ws://127.0.0.1:8080/v1/chat",
                        help="edge URL(s), comma-separated; a fleet is started there if none answers")
    parser.add_argument("-u", "--users", type=int, default=200)
    parser.add_argument("-r", "--spawn-rate", type=float, default=50)
    parser.add_argument("-t", "--run-time", default="60s")
    fleet = parser.add_argument_group("the fleet started when none answers")
    fleet.add_argument("--edges", type=int, default=2)
    fleet.add_argument("--workers", type=int, default=1)
    fleet.add_argument("--routers", type=int, default=2)
    fleet.add_argument("--echo-delay-ms", type=float, default=20.0, help="echo model: one piece per step of this")
    out = parser.add_argument_group("outputs")
    out.add_argument("--csv", default=str(RESULTS / "locust"), help="prefix of Locust's CSV files")
    out.add_argument("--html", default=str(RESULTS / "locust.html"))
    out.add_argument("--plot", default=str(RESULTS / "locust.png"), help="PNG of the percentiles ('' for none)")
    return parser.parse_known_args(argv)


# The fleet --------------------------------------------------------------------------------
def edge_answers(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with urllib.request.urlopen(f"http://{parts.hostname}:{parts.port or 80}/healthz", timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def served_model(url: str, api_key: str) -> str | None:
    """The model a running edge serves (its /v1/models), or None if it does not say."""
    parts = urlsplit(url)
    request = urllib.request.Request(f"http://{parts.hostname}:{parts.port or 80}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=2.0) as response:
            return json.load(response)["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
        return None


def first_api_key(extra: list[str]) -> str:
    """The key the locustfile's first user will present (--api-keys, its variable, or dev-key)."""
    keys = os.environ.get("DRIVETRAIN_LOAD_API_KEYS", "dev-key")
    for i, arg in enumerate(extra):
        if arg == "--api-keys" and i + 1 < len(extra):
            keys = extra[i + 1]
        elif arg.startswith("--api-keys="):
            keys = arg.partition("=")[2]
    return keys.split(",")[0].strip()


class LocalStack:
    """Infrastructure (if down) plus an echo fleet on its own topics; `stop` undoes only what `start` did."""

    def __init__(self, args: argparse.Namespace, base_port: int) -> None:
        self.args = args
        self.base_port = base_port
        self.layout = TopicLayout(prefix=f"loadtest-{uuid.uuid4().hex[:8]}")
        self.fleet: Fleet | None = None
        self.started_infra = False
        self.infra = None

    def start(self) -> str:
        from shared.infra.command import COMPONENTS, ensure_up, status_lines

        self.infra = InfraSettings()
        self.started_infra = not status_lines(self.infra, COMPONENTS)[0]
        if self.started_infra:
            print("starting Kafka and Redis …", flush=True)
        ensure_up(self.infra)
        asyncio.run(self._topics(create=True))
        log_dir = Path(self.infra.infra_dir) / "logs" / "loadtest"
        log_dir.mkdir(parents=True, exist_ok=True)
        spec = FleetSpec(
            edges=self.args.edges, workers=self.args.workers, routers=self.args.routers, model="echo",
            echo_delay_ms=self.args.echo_delay_ms, base_port=self.base_port,
            base_internal_port=self.base_port + INTERNAL_PORT_OFFSET,
            base_gossip_port=self.base_port + GOSSIP_PORT_OFFSET,
            extra_env={"DRIVETRAIN_TOPICS_PREFIX": self.layout.prefix},
        )
        print(f"starting an echo fleet ({spec.edges} edges, {spec.workers} workers, {spec.routers} routers, "
              f"{spec.echo_delay_ms:g} ms per step) on port {self.base_port}; logs in {log_dir}", flush=True)
        self.fleet = Fleet(spec, log_dir=log_dir, echo_logs=False)
        self.fleet.start(ready_timeout_s=180)
        return ",".join(spec.chat_url(i) for i in range(spec.edges))

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None
        if self.infra is None:
            return
        try:
            asyncio.run(self._topics(create=False))
        except (KafkaError, OSError, TimeoutError) as exc:  # leftover topics are harmless; say so and go on
            print(f"could not delete topics {self.layout.prefix}.*: {exc!r}", file=sys.stderr)
        if self.started_infra:
            from shared.infra.command import COMPONENTS, down

            down(self.infra, COMPONENTS, purge=False)

    async def _topics(self, create: bool) -> None:
        from shared.infra.kafka import open_admin
        from shared.infra.topics import ensure_topics

        async with open_admin(self.infra) as admin:
            if create:
                await ensure_topics(admin, self.layout.partitions())
            else:
                await admin.delete_topics(list(self.layout.partitions()))


# Locust -------------------------------------------------------------------------------------
def locust_command(args: argparse.Namespace, host: str, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "-u", str(args.users), "-r", str(args.spawn_rate), "-t", args.run_time, "--host", host,
        "--csv", args.csv, "--csv-full-history", "--html", args.html, *extra,
    ]


def read_stats(prefix: str) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def summary_lines(stats: dict[str, dict[str, str]]) -> list[str]:
    lines = [f"{'':10}{'count':>9}{'fails':>7}{'per s':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"]
    for name in (*METRICS, "connect"):
        row = stats.get(name)
        if row:
            lines.append(f"{name:10}{row['Request Count']:>9}{row['Failure Count']:>7}{float(row['Requests/s']):>9.1f}"
                         f"{row['50%']:>9}{row['95%']:>9}{row['99%']:>9}")
    tokens_per_s = sum(float(stats[n]["Requests/s"]) for n in ("ttft", "itl") if n in stats)
    lines.append(f"tokens delivered per second: {tokens_per_s:.0f}")
    return lines


def plot(prefix: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = read_stats(prefix)
    with open(f"{prefix}_stats_history.csv", newline="") as f:
        history = list(csv.DictReader(f))
    fig, (bars, series) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [n for n in METRICS if n in stats]
    width = 0.26
    for k, pct in enumerate(("50%", "95%", "99%")):
        values = [max(float(stats[n][pct]), 0.5) for n in names]
        xs = [i + (k - 1) * width for i in range(len(names))]
        drawn = bars.bar(xs, values, width, label=f"p{pct[:-1]}")
        bars.bar_label(drawn, labels=[stats[n][pct] for n in names], fontsize=7)
    bars.set_xticks(range(len(names)), names)
    bars.set_yscale("log")
    bars.set_ylabel("ms (log)")
    bars.set_title("whole run")
    bars.legend()

    start = min((int(r["Timestamp"]) for r in history), default=0)
    lines = (("ttft", "50%", "C0-"), ("ttft", "95%", "C0--"), ("itl", "50%", "C1-"), ("itl", "95%", "C1--"))
    for name, pct, style in lines:
        points = [(int(r["Timestamp"]) - start, float(r[pct])) for r in history
                  if r["Name"] == name and r[pct] not in ("", "N/A") and int(r["Total Request Count"]) > 0]
        if points:
            series.plot(*zip(*points), style, label=f"{name} p{pct[:-1]}")
    users = [(int(r["Timestamp"]) - start, int(r["User Count"])) for r in history if r["Name"] == "Aggregated"]
    series.set_xlabel("s since start")
    series.set_ylabel("ms (last 10 s)")
    series.set_title("over time")
    if users:
        twin = series.twinx()
        twin.plot(*zip(*users), "k:", label="users")
        twin.set_ylabel("users")
        series.plot([], [], "k:", label="users")  # listed in the one legend below
    if series.get_lines():
        series.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=5, fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    for output in (args.csv, args.html, args.plot):
        if output:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
    urls = [u.strip() for u in args.host.split(",") if u.strip()]
    stack = None
    try:
        host = args.host
        if not any(edge_answers(u) for u in urls):
            stack = LocalStack(args, urlsplit(urls[0]).port or 80)
            host = stack.start()
        elif "--no-echo-check" not in extra:
            model = served_model(urls[0], first_api_key(extra))
            if model not in (None, "echo"):
                print(f"{urls[0]} serves {model}, not echo: checking the protocol, not the replies' text")
                extra = [*extra, "--no-echo-check"]
        command = locust_command(args, host, extra)
        print("$ " + " ".join(command[1:]), flush=True)
        started = time.time()
        rc = subprocess.run(command, cwd=ROOT, check=False).returncode
    finally:
        if stack is not None:
            stack.stop()
    stats_csv = Path(f"{args.csv}_stats.csv")
    if stats_csv.exists() and stats_csv.stat().st_mtime >= started:  # not a previous run's
        stats = read_stats(args.csv)
        print("\n".join(summary_lines(stats)), flush=True)
        finished = stats.get("stream", {})
        if int(finished.get("Request Count", 0)) == int(finished.get("Failure Count", 0)):
            # Chats still waiting when the run ends are not counted, so a stalled fleet
            # would otherwise pass with no failures.
            print("no chat finished during the run: is a worker serving?", file=sys.stderr)
            rc = rc or 1
        if args.plot:
            title = f"chat load: {args.users} users, {args.run_time}" + (
                f", echo {args.echo_delay_ms:g} ms/step" if stack else "")
            plot(args.csv, Path(args.plot), title)
            print(f"plot: {args.plot}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
