"""How fast the fleet notices a death, and what clients see, with real processes (gossip at its one-machine defaults).

- kill-to-error: SIGKILL a worker under streaming load; time until each of its
  streams' clients holds its `worker_lost` error (p50/p99/max over --runs kills);
- kill-to-detection: time until every other member's view says the worker is dead;
- router failover: SIGKILL a router mid-stream; the longest gap in any stream;
- false positives: a soak under load with no kill; any member seen as not alive.
The gossip simulation's figures (convergence and detection vs N, loss) come from
loadtest/bench_gossip.py and are merged in when its results file exists.

    python loadtest/bench_failover.py --json loadtest/results/failover.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from services.launcher.fleet import Fleet
from services.launcher.spec import FleetSpec
from shared.chat_client import ChatSocket
from shared.infra.command import fresh_topics
from shared.infra.settings import InfraSettings
from shared.membership import MembershipSettings, query_members

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = 200


def start_fleet(workers: int, routers: int, tag: str) -> Fleet:
    layout = fresh_topics(f"bench-{tag}")
    log_dir = Path(InfraSettings().infra_dir) / "logs" / "bench-failover"
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = FleetSpec(
        edges=1, workers=workers, routers=routers, model="echo", echo_delay_ms=20,
        base_port=31080, base_internal_port=32180, base_gossip_port=33280,
        extra_env={"DRIVETRAIN_TOPICS_PREFIX": layout.prefix},
    )
    fleet = Fleet(spec, log_dir=log_dir, echo_logs=False)
    fleet.start()
    return fleet


async def open_streams(url: str, count: int) -> list[ChatSocket]:
    text = " ".join(f"w{i}" for i in range(WORDS))
    sockets = [await ChatSocket.open(url) for _ in range(count)]
    for sock in sockets:
        await sock.chat("c", text, max_tokens=WORDS)
    await asyncio.sleep(0.5)
    return sockets


async def collect_all(sockets: list[ChatSocket]):
    try:
        return await asyncio.gather(*(s.collect("c", timeout=60) for s in sockets))
    finally:
        await asyncio.gather(*(s.close() for s in sockets), return_exceptions=True)


async def views_agree_dead(fleet: Fleet, victim: str, since: float, timeout: float = 10.0) -> float | None:
    """Seconds until every member still running sees `victim` as dead (asked over gossip)."""
    gossip = MembershipSettings(cluster_name=fleet.spec.extra_env["DRIVETRAIN_TOPICS_PREFIX"])
    seed = ("127.0.0.1", fleet.spec.base_gossip_port)
    others = [m for m in await query_members(seed, gossip) if m["id"] != victim and m["status"] == "alive"]
    pending = {m["id"]: tuple(m["address"].rsplit(":", 1)) for m in others}
    while pending and time.perf_counter() - since < timeout:
        for member_id, (host, port) in list(pending.items()):
            try:
                view = {m["id"]: m["status"] for m in await query_members((host, int(port)), gossip, timeout=0.3, attempts=1)}
            except TimeoutError:
                continue
            if view.get(victim) in ("dead", "left"):
                del pending[member_id]
        await asyncio.sleep(0.02)
    return None if pending else time.perf_counter() - since


async def worker_kills(fleet: Fleet, runs: int) -> dict:
    errors, detections = [], []
    for run in range(runs):
        sockets = await open_streams(fleet.spec.chat_url(0), 10)
        victim = fleet.children["worker-0"].spec.member_id
        fleet.kill("worker-0")
        killed = time.perf_counter()
        detection = asyncio.create_task(views_agree_dead(fleet, victim, killed))
        results = await collect_all(sockets)
        errors += [r.arrivals[-1] - killed for r in results if r.final["type"] == "error"]
        if (seconds := await detection) is not None:
            detections.append(seconds)
        fleet.start_child(fleet.spec.worker(0))
        fleet.wait_ready(60)
        print(f"run {run + 1}/{runs}: {len(errors)} errors so far", flush=True)
    return {"kill_to_error_s": summary(errors), "kill_to_detection_by_all_s": summary(detections)}


async def router_kill(fleet: Fleet) -> dict:
    sockets = await open_streams(fleet.spec.chat_url(0), 20)
    fleet.kill("router-0")
    results = await collect_all(sockets)
    gaps = [float(np.max(np.diff(r.arrivals))) for r in results if len(r.arrivals) > 1]
    intact = sum(r.final["type"] == "done" and r.text.count(" ") == WORDS - 1 for r in results)
    return {"streams": len(results), "intact": intact, "longest_gap_s": round(max(gaps), 3), "median_of_longest_gaps_s": round(float(np.median(gaps)), 3)}


async def soak(fleet: Fleet, minutes: float) -> dict:
    """Streams keep flowing; every second, is anyone seen as anything but alive?"""
    gossip = MembershipSettings(cluster_name=fleet.spec.extra_env["DRIVETRAIN_TOPICS_PREFIX"])
    seed = ("127.0.0.1", fleet.spec.base_gossip_port)
    end, samples, false_positives = time.monotonic() + minutes * 60, 0, []

    async def load() -> None:
        while time.monotonic() < end:
            await collect_all(await open_streams(fleet.spec.chat_url(0), 20))

    loader = asyncio.create_task(load())
    while time.monotonic() < end:
        view = await query_members(seed, gossip)
        samples += 1
        false_positives += [m["id"] for m in view if m["status"] != "alive"]
        await asyncio.sleep(1.0)
    await loader
    return {"minutes": minutes, "samples": samples, "false_positives": len(false_positives), "members": false_positives}


def summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.array(values)
    return {"n": len(values), "p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3), "max": round(float(a.max()), 3)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["kill → error (client)", "kill → dead in every view"]
    stats = [result["worker_kill"]["kill_to_error_s"], result["worker_kill"]["kill_to_detection_by_all_s"]]
    x = np.arange(len(names))
    for offset, key in ((-0.25, "p50"), (0, "p99"), (0.25, "max")):
        ax.bar(x + offset, [s.get(key, 0) for s in stats], 0.25, label=key)
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="target p99 2 s")
    ax.set(xticks=x, xticklabels=names, ylabel="seconds", title="worker SIGKILL, one-machine gossip timing")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def measure(args: argparse.Namespace) -> dict:
    result: dict = {}
    fleet = await asyncio.to_thread(start_fleet, 2, 2, "kill")
    try:
        result["worker_kill"] = await worker_kills(fleet, args.runs)
        result["router_kill"] = await router_kill(fleet)
    finally:
        fleet.stop()
    if args.soak_minutes > 0:
        fleet = await asyncio.to_thread(start_fleet, 2, 2, "soak")
        try:
            result["soak"] = await soak(fleet, args.soak_minutes)
        finally:
            fleet.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--soak-minutes", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=RESULTS / "failover.json")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    gossip = RESULTS / "gossip.json"
    if gossip.exists():
        result["gossip_simulation"] = json.loads(gossip.read_text())
    result["command"] = "python loadtest/bench_failover.py " + " ".join(sys.argv[1:])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    plot(result, args.json.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "gossip_simulation"}, indent=2))


if __name__ == "__main__":
    main()
