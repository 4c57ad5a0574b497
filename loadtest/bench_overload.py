"""Admission by tier under overload: the edge's admission function in front of the engine's real scheduler.

Three tiers offer 150 % of what one engine can serve (enterprise 20 % of the offer, pro 30 %,
free 50 %). Each arrival is admitted or refused by `services.edge.admission.admit` against the
worker's load as gossip would report it (a snapshot of running, waiting, KV use and waiting
prompt tokens, refreshed once a second, so admission sees load as stale as an edge does, plus
the chats admitted since that report, which an edge counts itself). The
admitted go to the engine's own scheduler (weighted VTC, KV cache manager, block pool); the
model is a clock (STEP_S + PER_TOKEN_S per scheduled token, in virtual time), as in
bench_fairness.py, so the figures are the same on any machine.

    python loadtest/bench_overload.py --json loadtest/results/overload.json
    python loadtest/bench_overload.py --quick

Keys: capacity_req_s (finished requests/s when saturated), enterprise_ttft_p99_unloaded_s (enterprise's
load alone), enterprise_ttft_p99_s (everyone, with admission), enterprise_ttft_p99_over_unloaded (target
<= 1.5), ..._no_admission (everyone admitted), refused_fraction per tier (free first, then pro).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from services.edge.admission import WorkerLoad, admit, fleet_load, tier_limits
from services.edge.tenants import DEFAULT_TIERS
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import Scheduler, SchedulerConfig
from services.worker.engine.vtc import VirtualTokenCounters, VTCCosts

RESULTS = Path(__file__).resolve().parent / "results"
STEP_S, PER_TOKEN_S = 0.010, 0.0001  # the model as a clock
MAX_NUM_SEQS, NUM_BLOCKS = 32, 512
GOSSIP_S = 1.0  # how often the worker's load reaches the edge
OFFERED = 1.5  # offered load over capacity
SATURATING_REQ_S = 60.0  # about 3x what the engine finishes: enough to measure its capacity
SHARES = {"enterprise": 0.2, "pro": 0.3, "free": 0.5}  # of the offered load
TARGETS = {"enterprise_ttft_p99_over_unloaded": ("<=", 1.5)}

Arrival = tuple[float, str, int, int]  # (time, tier, prompt tokens, output tokens)


def workload(seconds: float, rate: float, shares: dict[str, float], seed: int) -> list[Arrival]:
    rng, arrivals = random.Random(seed), []
    for tier, share in shares.items():
        t = 0.0
        while (t := t + rng.expovariate(rate * share)) < seconds:
            arrivals.append((t, tier, rng.randint(64, 256), rng.randint(32, 128)))
    return sorted(arrivals)


@dataclass
class Run:
    offered: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SHARES, 0))
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SHARES, 0))
    ttft: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in SHARES})
    finished: int = 0
    seconds: float = 0.0


def snapshot(scheduler: Scheduler) -> WorkerLoad:
    """What the worker gossips (services/worker/engine/engine.py Engine.load)."""
    pool = scheduler.kv_cache_manager.block_pool
    waiting_tokens = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
    return WorkerLoad(
        scheduler.num_running, scheduler.num_waiting, MAX_NUM_SEQS, pool.usage, waiting_tokens,
        pool.num_usable_blocks * pool.block_size,
    )  # fmt: skip


def run(arrivals: list[Arrival], seconds: float, admission: bool) -> Run:
    config = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_batch_tokens=512, max_model_len=1024)
    scheduler = Scheduler(
        config, KVCacheManager(BlockPool(NUM_BLOCKS, 16), config.max_model_len), VirtualTokenCounters(VTCCosts())
    )
    limits = tier_limits(DEFAULT_TIERS, full_load=1.0)
    result, pending, arrived = Run(), list(arrivals), {}
    now, gossiped_at, since, since_tokens = 0.0, float("-inf"), 0, 0
    while now < seconds:
        if now - gossiped_at >= GOSSIP_S:
            report, gossiped_at, since, since_tokens = snapshot(scheduler), now, 0, 0
        while pending and pending[0][0] <= now:
            at, tier, prompt, output = pending.pop(0)
            result.offered[tier] += 1
            # As an edge does (fleet_view.py): the last report, plus what was admitted since.
            if admission and admit(tier, fleet_load([report], since, since_tokens), limits, 1000) is not None:
                result.refused[tier] += 1
                continue
            request_id = f"{tier}-{len(arrived)}"
            tokens = [random.Random(request_id).randrange(30_000) for _ in range(prompt)]  # no shared prefixes
            weight = DEFAULT_TIERS[tier].weight
            scheduler.add_request(Request(request_id, tokens, SamplingParams(max_tokens=output), tier, weight=weight))
            arrived[request_id] = at
            since, since_tokens = since + 1, since_tokens + prompt
        output = scheduler.schedule()
        if not output.chunks:
            now = min(pending[0][0] if pending else seconds, gossiped_at + GOSSIP_S)
            continue
        now += STEP_S + PER_TOKEN_S * output.num_scheduled_tokens
        for chunk in output.chunks:
            request = scheduler.requests[chunk.request_id]
            if chunk.sample and request.num_output_tokens == 0:
                result.ttft[request.tenant].append(now - arrived[request.request_id])
        scheduler.update_from_output(output, {c.request_id: 1 for c in output.chunks if c.sample})
        for request in [r for r in scheduler.requests.values() if r.reached_max_num_tokens]:
            scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
            result.finished += 1
    result.seconds = now
    return result


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a CI-sized run")
    parser.add_argument("--json", type=Path, default=RESULTS / "overload.json")
    args = parser.parse_args(argv)
    seconds = 10.0 if args.quick else 120.0
    # Capacity measured, not assumed: what the engine finishes when offered far more than it can do.
    saturated = run(workload(seconds, SATURATING_REQ_S, SHARES, seed=1), seconds, admission=False)
    capacity = saturated.finished / saturated.seconds
    everyone = workload(seconds, OFFERED * capacity, SHARES, seed=7)
    alone = [a for a in everyone if a[1] == "enterprise"]
    unloaded = run(alone, seconds, admission=False)
    loaded = run(everyone, seconds, admission=True)
    flooded = run(everyone, seconds, admission=False)
    base = p99(unloaded.ttft["enterprise"])
    results = {
        "setup": {
            "seconds": seconds,
            "offered_over_capacity": OFFERED,
            "shares": SHARES,
            "step_s": STEP_S,
            "per_token_s": PER_TOKEN_S,
            "max_num_seqs": MAX_NUM_SEQS,
            "kv_blocks": NUM_BLOCKS,
            "gossip_s": GOSSIP_S,
            "tiers": {n: {"weight": t.weight, "reserve": t.reserve} for n, t in DEFAULT_TIERS.items()},
            "driver": "admission function + the engine's scheduler in-process, virtual time",
        },
        "capacity_req_s": capacity,
        "offered": loaded.offered,
        "refused": loaded.refused,
        "refused_fraction": {t: loaded.refused[t] / max(1, loaded.offered[t]) for t in SHARES},
        "enterprise_ttft_p99_unloaded_s": base,
        "enterprise_ttft_p99_s": p99(loaded.ttft["enterprise"]),
        "enterprise_ttft_p99_no_admission_s": p99(flooded.ttft["enterprise"]),
        "ttft_p99_s": {t: p99(loaded.ttft[t]) for t in SHARES},
        "ttft_p99_no_admission_s": {t: p99(flooded.ttft[t]) for t in SHARES},
    }
    results["enterprise_ttft_p99_over_unloaded"] = results["enterprise_ttft_p99_s"] / base
    results["enterprise_ttft_p99_over_unloaded_no_admission"] = results["enterprise_ttft_p99_no_admission_s"] / base
    refused = results["refused_fraction"]
    results["targets"] = {
        key: {"target": f"{op} {bound}", "met": results[key] <= bound} for key, (op, bound) in TARGETS.items()
    }
    results["targets"]["free_refused_first"] = {
        "target": "free >= pro >= enterprise",
        "met": refused["free"] >= refused["pro"] >= refused["enterprise"],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.json.with_suffix(".png"))
    print(json.dumps({k: v for k, v in results.items() if k != "setup"}, indent=2))
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = list(SHARES)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(tiers, [100 * results["refused_fraction"][t] for t in tiers], color=["tab:green", "tab:blue", "tab:gray"])
    left.set_ylabel("% of offered refused (overloaded)")
    left.set_title(f"{results['setup']['offered_over_capacity']:.0%} of capacity offered")
    labels = ["enterprise alone", "all tiers, admission", "all tiers, no admission"]
    values = [
        results["enterprise_ttft_p99_unloaded_s"],
        results["enterprise_ttft_p99_s"],
        results["enterprise_ttft_p99_no_admission_s"],
    ]
    right.bar(labels, values, color=["tab:green", "tab:blue", "tab:red"])
    right.set_yscale("log")
    right.set_ylabel("enterprise TTFT p99 (s)")
    right.set_title(f"{results['enterprise_ttft_p99_over_unloaded']:.2f}x unloaded with admission")
    right.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
