"""Fair share between tenants, FCFS against weighted VTC, in the engine's real scheduler.

One hot tenant sends 10x what each of three others sends, and together they ask for twice
what the engine can do. The scheduler, its KV cache manager and block pool are the engine's
own; the model is a clock (a step takes STEP_S + PER_TOKEN_S per scheduled token, in virtual
time), so the figures measure the scheduling decisions alone and are the same on any machine.

    python loadtest/bench_fairness.py --json loadtest/results/fairness.json
    python loadtest/bench_fairness.py --quick

Keys: jain_fcfs / jain_fair (Jain's index over each tenant's service divided by its max-min
fair share of what was served; 1 is perfectly fair), max_service_difference (largest gap, in
weighted tokens, between a tenant's service and its fair share; fair run, and _fcfs),
cold_ttft_p99_fcfs_over_fair, throughput_fair_over_fcfs.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import Scheduler, SchedulerConfig
from services.worker.engine.tenant_order import FCFS
from services.worker.engine.vtc import VirtualTokenCounters, VTCCosts

RESULTS = Path(__file__).resolve().parent / "results"
STEP_S, PER_TOKEN_S = 0.010, 0.0001  # the model as a clock
TENANTS = {"hot": 10.0, "cold-1": 1.0, "cold-2": 1.0, "cold-3": 1.0}  # relative request rates
COSTS = VTCCosts()
TARGETS = {"jain_fair": (">=", 0.95), "throughput_fair_over_fcfs": (">=", 0.95)}


def workload(seconds: float, rate: float, seed: int) -> list[tuple[float, str, int, int]]:
    """(arrival, tenant, prompt tokens, output tokens), Poisson per tenant."""
    rng, arrivals = random.Random(seed), []
    total = sum(TENANTS.values())
    for tenant, share in TENANTS.items():
        t = 0.0
        while (t := t + rng.expovariate(rate * share / total)) < seconds:
            arrivals.append((t, tenant, rng.randint(64, 256), rng.randint(32, 128)))
    return sorted(arrivals)


def run(policy: str, arrivals: list[tuple[float, str, int, int]], seconds: float) -> dict:
    config = SchedulerConfig(max_num_seqs=32, max_batch_tokens=512, max_model_len=1024)
    waiting = VirtualTokenCounters(COSTS) if policy == "fair" else FCFS()
    scheduler = Scheduler(config, KVCacheManager(BlockPool(512, 16), config.max_model_len), waiting)
    now, pending = 0.0, list(arrivals)
    arrived: dict[str, float] = {}
    ttft: dict[str, list[float]] = {t: [] for t in TENANTS}
    service = dict.fromkeys(TENANTS, 0.0)  # weighted tokens computed, as VTC counts them
    tokens_done = 0
    while now < seconds:
        while pending and pending[0][0] <= now:
            at, tenant, prompt, output = pending.pop(0)
            request_id = f"{tenant}-{len(arrived)}"
            # Distinct prompts: no prefix is shared, so the cache plays no part here.
            tokens = [random.Random(request_id).randrange(30_000) for _ in range(prompt)]
            scheduler.add_request(Request(request_id, tokens, SamplingParams(max_tokens=output), tenant))
            arrived[request_id] = at
        output = scheduler.schedule()
        if not output.chunks:
            now = pending[0][0] if pending else seconds
            continue
        now += STEP_S + PER_TOKEN_S * output.num_scheduled_tokens
        sampled = {c.request_id: 1 for c in output.chunks if c.sample}
        for chunk in output.chunks:
            request = scheduler.requests[chunk.request_id]
            prefill = max(0, min(request.num_prompt_tokens, chunk.start_position + chunk.num_tokens) - chunk.start_position)
            service[request.tenant] += prefill * COSTS.w_in + (COSTS.w_out if chunk.sample else 0.0)
            if chunk.sample and request.num_output_tokens == 0:
                ttft[request.tenant].append(now - arrived[request.request_id])
        tokens_done += output.num_scheduled_tokens
        scheduler.update_from_output(output, sampled)
        for request in [r for r in scheduler.requests.values() if r.reached_max_num_tokens]:
            scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    return {"service": service, "ttft": ttft, "throughput_tok_s": tokens_done / now}


def fair_shares(total: float, demand: dict[str, float]) -> dict[str, float]:
    """Max-min fair shares of `total` (water-filling): nobody gets more than it asked for."""
    left, shares, open_ = total, {}, dict(demand)
    while open_:
        even = left / len(open_)
        capped = {t: d for t, d in open_.items() if d <= even}
        if not capped:
            shares.update(dict.fromkeys(open_, even))
            break
        for tenant, d in capped.items():
            shares[tenant], left = d, left - d
            del open_[tenant]
    return shares


def jain(service: dict[str, float], shares: dict[str, float]) -> float:
    """Jain's index of each tenant's service over its fair share."""
    x = [service[t] / shares[t] for t in service]
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x))


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a CI-sized run")
    parser.add_argument("--json", type=Path, default=RESULTS / "fairness.json")
    args = parser.parse_args()
    seconds = 30.0 if args.quick else 120.0
    capacity = 1 / (STEP_S / 32 + PER_TOKEN_S * 240)  # requests/s the clock allows, roughly
    arrivals = workload(seconds, 2.0 * capacity, seed=7)
    demand = dict.fromkeys(TENANTS, 0.0)
    for _, tenant, prompt, output in arrivals:
        demand[tenant] += prompt * COSTS.w_in + output * COSTS.w_out
    fcfs, fair = run("fcfs", arrivals, seconds), run("fair", arrivals, seconds)
    fcfs_shares = fair_shares(sum(fcfs["service"].values()), demand)
    fair_shares_ = fair_shares(sum(fair["service"].values()), demand)
    cold = [t for t in TENANTS if t != "hot"]
    results = {
        "setup": {"seconds": seconds, "tenants": TENANTS, "offered_over_capacity": 2.0, "step_s": STEP_S,
                  "per_token_s": PER_TOKEN_S, "costs": {"w_in": COSTS.w_in, "w_out": COSTS.w_out}},
        "service_fcfs": fcfs["service"], "service_fair": fair["service"],
        "jain_fcfs": jain(fcfs["service"], fcfs_shares), "jain_fair": jain(fair["service"], fair_shares_),
        "max_service_difference": max(abs(fair["service"][t] - fair_shares_[t]) for t in TENANTS),
        "max_service_difference_fcfs": max(abs(fcfs["service"][t] - fcfs_shares[t]) for t in TENANTS),
        "cold_ttft_p99_fcfs_s": p99([v for t in cold for v in fcfs["ttft"][t]]),
        "cold_ttft_p99_fair_s": p99([v for t in cold for v in fair["ttft"][t]]),
        "throughput_fair_over_fcfs": fair["throughput_tok_s"] / fcfs["throughput_tok_s"],
    }
    results["cold_ttft_p99_fcfs_over_fair"] = results["cold_ttft_p99_fcfs_s"] / results["cold_ttft_p99_fair_s"]
    results["targets"] = {
        key: {"target": f"{op} {bound}", "met": results[key] >= bound} for key, (op, bound) in TARGETS.items()
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.json.with_suffix(".png"))
    print(json.dumps({k: v for k, v in results.items() if not k.startswith(("service", "setup"))}, indent=2))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenants = list(TENANTS)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for i, (label, key) in enumerate((("FCFS", "service_fcfs"), ("weighted VTC", "service_fair"))):
        ax.bar([j + (i - 0.5) * width for j in range(len(tenants))], [results[key][t] for t in tenants], width, label=label)
    ax.set_xticks(range(len(tenants)), tenants)
    ax.set_ylabel("weighted tokens served")
    ax.set_title(f"hot tenant at 10x, 2x overload: Jain {results['jain_fcfs']:.2f} (FCFS) vs {results['jain_fair']:.2f} (VTC)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
