"""Gossip membership in simulation (virtual time, the LAN timing): how fast joins converge, how fast a
crash is known everywhere, and how often a live member is wrongly declared dead under packet loss.

    python loadtest/bench_gossip.py            # N = 10..200, 3 seeds, 300 probe periods per loss level
    python loadtest/bench_gossip.py --quick    # N = 10..100, 2 seeds, 100 periods

Writes loadtest/results/gossip.json and gossip.png and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from shared.membership import MembershipSettings, Simulation, Status
from shared.membership.timing import suspicion_bounds

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = MembershipSettings.lan(secret="bench")
PERIOD = CONFIG.probe_interval


def start_cluster(n: int, seed: int) -> Simulation:
    """n members all starting at t=0, each joining through a random member started before it."""
    sim = Simulation(CONFIG, seed=seed)
    sim.add("m0")
    for i in range(1, n):
        sim.add(f"m{i}", seeds=[f"m{sim.rng.randrange(i)}"])
    return sim


def converge_and_crash(n: int, seed: int) -> dict[str, Any]:
    """Probe periods until every member sees every member alive; then seconds until a crash is known to all."""
    sim = start_cluster(n, seed)
    took = sim.run_until_true(sim.converged, timeout=120 * PERIOD, step=PERIOD / 4)
    sim.run_for(5 * PERIOD)
    victim = f"m{n // 2}"
    crashed_at = sim.now
    sim.crash(victim)
    all_dead = sim.run_until_true(lambda: sim.all_see(victim, [Status.DEAD]), timeout=120 * PERIOD, step=PERIOD / 4)
    suspected = [c.at for c in sim.changes if c.member == victim and c.new is Status.SUSPECT and c.at >= crashed_at]
    return {
        "n": n, "seed": seed,
        "converge_periods": None if took is None else took / PERIOD,
        "first_suspect_s": min(suspected) - crashed_at if suspected else None,
        "all_dead_s": all_dead,
    }


def false_positives(n: int, loss: float, periods: int, seed: int) -> dict[str, Any]:
    """A converged cluster with no failures run under loss: every 'dead' is a false positive."""
    sim = start_cluster(n, seed)
    sim.run_until_true(sim.converged, timeout=120 * PERIOD, step=PERIOD)
    sim.faults.loss = loss
    sim.changes.clear()
    packets, sent_bytes = sim.packets_sent, sim.bytes_sent
    sim.run_for(periods * PERIOD)
    dead = [c for c in sim.changes if c.new is Status.DEAD]
    member_seconds = n * periods * PERIOD
    return {
        "n": n, "loss": loss, "periods": periods, "seed": seed,
        "dead_declarations": len(dead),
        "members_declared_dead": len({c.member for c in dead}),
        "suspicions_started": sum(1 for c in sim.changes if c.new is Status.SUSPECT and c.observer != c.member),
        "refutations": sum(node.table.refutations for node in sim.live()),
        "max_health_score": max(node.awareness.score for node in sim.live()),
        "packets_per_member_s": (sim.packets_sent - packets) / member_seconds,
        "bytes_per_member_s": (sim.bytes_sent - sent_bytes) / member_seconds,
    }


def summarize(runs: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        mine = [r for r in runs if r["n"] == n]
        shortest, longest = suspicion_bounds(CONFIG.suspicion_mult, CONFIG.suspicion_max_timeout_mult, n, PERIOD)
        row: dict[str, Any] = {"n": n, "seeds": len(mine), "suspicion_min_s": shortest, "suspicion_max_s": longest}
        for key in ("converge_periods", "first_suspect_s", "all_dead_s"):
            values = [r[key] for r in mine if r[key] is not None]
            row[key] = {"p50": statistics.median(values), "max": max(values), "all": values, "failed": len(mine) - len(values)}
        rows.append(row)
    return rows


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    plot_join_and_crash(axes[0], report["join_and_crash"])
    plot_loss(axes[1], report["false_positives"], [r["n"] for r in report["join_and_crash"]])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_join_and_crash(axes: Any, rows: list[dict[str, Any]]) -> None:
    sizes = [r["n"] for r in rows]
    ax = axes[0]
    ax.plot(sizes, [r["converge_periods"]["p50"] for r in rows], "o-", label="p50")
    ax.plot(sizes, [r["converge_periods"]["max"] for r in rows], "s--", label="max")
    ax.plot(sizes, [math.log2(n) for n in sizes], "k-", alpha=0.3, label="log2 N")
    ax.set(xscale="log", xlabel="members", ylabel="probe periods", title="Join storm: periods until all see all alive")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax = axes[1]
    ax.plot(sizes, [r["all_dead_s"]["p50"] for r in rows], "o-", label="all know: p50")
    ax.plot(sizes, [r["all_dead_s"]["max"] for r in rows], "s--", label="all know: max")
    ax.plot(sizes, [r["first_suspect_s"]["p50"] for r in rows], "^:", label="first suspicion: p50")
    ax.plot(sizes, [r["suspicion_min_s"] for r in rows], "k-", alpha=0.3, label="suspicion min")
    ax.set(xscale="log", xlabel="members", ylabel="seconds", title=f"Crash: until every member holds it dead ({PERIOD:g}s period)")
    ax.legend()


def plot_loss(axes: Any, fps: list[dict[str, Any]], sizes: list[int]) -> None:
    losses = sorted({f["loss"] for f in fps})
    ax = axes[0]
    width = 0.8 / len(sizes)
    for i, n in enumerate(sizes):
        counts = [next(f["members_declared_dead"] for f in fps if f["n"] == n and f["loss"] == loss) for loss in losses]
        ax.bar([j + i * width for j in range(len(losses))], counts, width, label=f"N={n}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(losses))], [f"{loss:.0%}" for loss in losses])
    ax.set(xlabel="packet loss", ylabel="live members declared dead",
           title=f"False positives over {fps[0]['periods']} periods")
    ax.set_ylim(0, max(1, *(f["members_declared_dead"] for f in fps)) + 0.5)
    ax.legend()
    ax = axes[1]
    for n in sizes:
        mine = [f for f in fps if f["n"] == n]
        ax.plot([f"{f['loss']:.0%}" for f in mine],
                [1000 * f["refutations"] / (n * f["periods"]) for f in mine], "o-", label=f"N={n}")
    ax.set(xlabel="packet loss", ylabel="refutations per 1000 member-periods", title="Suspicions refuted by their target")
    ax.legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes, seeds and periods")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--json", type=Path, default=RESULTS / "gossip.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "gossip.png")
    args = parser.parse_args()
    sizes = [10, 20, 50, 100] if args.quick else [10, 20, 50, 100, 200]
    seeds = [1, 2] if args.quick else [1, 2, 3]
    periods = 100 if args.quick else 300
    losses = [0.01, 0.05, 0.10]

    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        # Largest first, so the long runs overlap instead of finishing last.
        fp_jobs = [pool.submit(false_positives, n, loss, periods, 1) for n in reversed(sizes) for loss in losses]
        crash_jobs = [pool.submit(converge_and_crash, n, s) for n in reversed(sizes) for s in seeds]
        crash_runs = [j.result() for j in crash_jobs]
        fp_runs = sorted((j.result() for j in fp_jobs), key=lambda f: (f["n"], f["loss"]))
    report = {
        "timing": "lan",
        "probe_interval_s": PERIOD,
        "config": {k: v for k, v in vars(CONFIG).items() if k != "secret"},
        "join_and_crash": summarize(crash_runs, sizes),
        "false_positives": fp_runs,
        "wall_s": round(time.monotonic() - started, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    plot(report, args.png)
    print_report(report)


def print_report(report: dict[str, Any]) -> None:
    print(f"LAN timing, probe period {PERIOD:g}s; wall {report['wall_s']}s")
    print(f"{'N':>5} {'converge p50/max (periods)':>27} {'1st suspect p50':>16} {'all dead p50/max (s)':>21} {'susp min/max (s)':>17}")
    for r in report["join_and_crash"]:
        c, d = r["converge_periods"], r["all_dead_s"]
        print(f"{r['n']:>5} {c['p50']:>13.2f} / {c['max']:<11.2f} {r['first_suspect_s']['p50']:>16.2f} "
              f"{d['p50']:>10.2f} / {d['max']:<8.2f} {r['suspicion_min_s']:>8.1f} / {r['suspicion_max_s']:<6.1f}")
    print(f"{'N':>5} {'loss':>5} {'periods':>7} {'declared dead':>13} {'refutations':>11} {'max health':>10} {'pkt/member/s':>12} {'B/member/s':>10}")
    for f in report["false_positives"]:
        print(f"{f['n']:>5} {f['loss']:>5.0%} {f['periods']:>7} {f['members_declared_dead']:>13} {f['refutations']:>11} "
              f"{f['max_health_score']:>10} {f['packets_per_member_s']:>12.1f} {f['bytes_per_member_s']:>10.0f}")


if __name__ == "__main__":
    main()
