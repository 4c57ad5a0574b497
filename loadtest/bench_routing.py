"""Placement policies over a simulated fleet: prefix-cache hit rate, load balance and TTFT.

20 shared prefixes (documents or system prompts of 1,024 tokens) with Zipf popularity, each chat a
prefix plus its own 64-token question, arrive as a Poisson stream at one edge that places them on 8
workers. The placement is the edge's own (services/edge/placer.py: the policy, the KV index fed by
KV-cache events every 50 ms, the in-flight count, gossiped load every second); each worker is the
engine's real scheduler, KV cache manager and block pool (so hits and evictions are real) with the
model as a clock: a step takes STEP_S + PER_TOKEN_S per scheduled token, in virtual time. TTFT is
thus modelled from what a worker must compute (the uncached prompt tokens, its decodes) and how
long a chat waits for its turn there; the figures are the same on any machine.

    python loadtest/bench_routing.py --json loadtest/results/routing.json
    python loadtest/bench_routing.py --quick

Keys: policies.<policy>.hit_rate (prompt tokens read from the prefix cache), .max_over_mean_load
(busiest worker's chats in flight over the mean, averaged over arrivals while the mean is >= 1),
.max_over_mean_load_p99, .max_over_mean_chats (whole-run chats per worker, busiest over mean),
.ttft_p50_ms, .ttft_p99_ms.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from services.edge.kv_index import KVIndex
from services.edge.placement import Policy
from services.edge.placer import Placer
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import Scheduler, SchedulerConfig
from services.worker.kv_events import KVEventCollector, kv_records
from shared import wire
from shared.membership import MemberView, Status
from shared.models.cache_salt import CacheSharing
from shared.partition_owners import REQUESTS_ADDRESS

RESULTS = Path(__file__).resolve().parent / "results"
WORKERS, PREFIXES, ZIPF_S = 8, 20, 1.1
PREFIX_TOKENS, QUESTION_TOKENS, OUTPUT_TOKENS = 1024, 64, (64, 256)
BLOCK_SIZE, NUM_BLOCKS = 16, 640  # a worker's pool holds about 8 of the 20 prefixes
STEP_S, PER_TOKEN_S = 0.004, 0.0001  # the model as a clock
EVENTS_EVERY_S, GOSSIP_EVERY_S = 0.05, 1.0
LOAD_BOUND = 1.25
TARGETS = {"hit_rate_bounded_over_prefix": (">=", 0.9), "max_over_mean_load_bounded": ("<=", 1.25)}


def workload(seconds: float, rate: float, seed: int) -> list[tuple[float, int, list[int], int]]:
    """(arrival, prefix, prompt tokens, output tokens)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30_000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    weights = [1 / (k + 1) ** ZIPF_S for k in range(PREFIXES)]
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        k = rng.choices(range(PREFIXES), weights)[0]
        question = [rng.randrange(1, 30_000) for _ in range(QUESTION_TOKENS)]
        arrivals.append((t, k, prefixes[k] + question, rng.randint(*OUTPUT_TOKENS)))
    return arrivals


class Worker:
    def __init__(self, name: str, partition: int) -> None:
        self.name, self.partition = name, partition
        self.config = SchedulerConfig(max_num_seqs=64, max_batch_tokens=2048, max_model_len=2048)
        pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
        self.events = pool.listener = KVEventCollector()
        self.scheduler = Scheduler(self.config, KVCacheManager(pool, self.config.max_model_len))
        self.clock = float("inf")  # its next step; inf: idle
        self.chats = 0

    @property
    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    def view(self) -> MemberView:
        load = {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting}
        return MemberView(self.name, "worker", ("sim", 0), {REQUESTS_ADDRESS: str(self.partition)}, load, Status.ALIVE, 1, 1)


def run(policy: Policy, arrivals: list, seconds: float) -> dict:
    workers = {f"w{i}": Worker(f"w{i}", i) for i in range(WORKERS)}
    by_partition = {w.partition: w for w in workers.values()}
    placer = Placer(policy, LOAD_BOUND, CacheSharing(cache_isolation=False), lambda tokens: list(tokens), KVIndex())
    gossiped = [w.view() for w in workers.values()]
    placer.members = lambda: gossiped
    pending, arrived, ttft, ratios = list(arrivals), {}, [], []
    prompt_tokens = cached_tokens = 0
    next_events, next_gossip, now = EVENTS_EVERY_S, GOSSIP_EVERY_S, 0.0
    while now < seconds or any(w.clock < float("inf") for w in workers.values()):
        busy = min(workers.values(), key=lambda w: w.clock)
        now = min(pending[0][0] if pending else float("inf"), busy.clock, next_events, next_gossip)
        if now == float("inf"):
            break
        if now == next_events:  # the workers' KV-cache events reach the edge's index
            for w in workers.values():
                if (batch := w.events.drain()) is not None:
                    for record in kv_records(w.name, BLOCK_SIZE, batch):
                        placer.index.apply(record)
            next_events += EVENTS_EVERY_S
        elif now == next_gossip:
            gossiped = [w.view() for w in workers.values()]
            next_gossip += GOSSIP_EVERY_S
        elif pending and now == pending[0][0]:
            _, _, tokens, output = pending.pop(0)
            loads = [w.load for w in workers.values()]
            if (mean := sum(loads) / len(loads)) >= 1:
                ratios.append(max(loads) / mean)
            request_id = f"r{len(arrived)}"
            _, partition = placer.place(request_id, "bench", tuple(tokens), None, now=now)
            worker = by_partition[partition]
            worker.scheduler.add_request(Request(request_id, tokens, SamplingParams(max_tokens=output), "bench"))
            worker.clock, worker.chats = min(worker.clock, now), worker.chats + 1
            arrived[request_id] = now
        else:
            prompt_tokens, cached_tokens = step(busy, placer, arrived, ttft, prompt_tokens, cached_tokens)
    mean_chats = sum(w.chats for w in workers.values()) / WORKERS
    return {
        "hit_rate": cached_tokens / prompt_tokens,
        "max_over_mean_load": sum(ratios) / len(ratios),
        "max_over_mean_load_p99": percentile(ratios, 0.99),
        "max_over_mean_chats": max(w.chats for w in workers.values()) / mean_chats,
        "ttft_p50_ms": 1000 * percentile(ttft, 0.50),
        "ttft_p99_ms": 1000 * percentile(ttft, 0.99),
        "chats": len(arrived),
    }


def step(worker: Worker, placer: Placer, arrived: dict, ttft: list, prompt_tokens: int, cached_tokens: int):
    scheduler = worker.scheduler
    output = scheduler.schedule()
    if not output.chunks:
        worker.clock = float("inf")
        return prompt_tokens, cached_tokens
    worker.clock += STEP_S + PER_TOKEN_S * output.num_scheduled_tokens
    for chunk in output.chunks:
        request = scheduler.requests[chunk.request_id]
        if chunk.sample and request.num_output_tokens == 0:
            ttft.append(worker.clock - arrived[request.request_id])
            prompt_tokens += request.num_prompt_tokens
            cached_tokens += request.num_cached_tokens
    scheduler.update_from_output(output, {c.request_id: 1 for c in output.chunks if c.sample})
    for request in [r for r in scheduler.requests.values() if r.reached_max_num_tokens]:
        scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        placer.settled(wire.Done(request.request_id, 0, "length", wire.Usage(0, 0, 0)))
    return prompt_tokens, cached_tokens


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a CI-sized run")
    parser.add_argument("--json", type=Path, default=RESULTS / "routing.json")
    parser.add_argument("--rate", type=float, default=120.0, help="chats per second offered to the fleet")
    args = parser.parse_args()
    seconds = 10.0 if args.quick else 60.0
    arrivals = workload(seconds, args.rate, seed=7)
    policies = {str(p): run(p, arrivals, seconds) for p in Policy}
    bounded, prefix = policies["bounded_affinity"], policies["prefix_affinity"]
    results = {
        "setup": {"seconds": seconds, "rate_per_s": args.rate, "workers": WORKERS, "prefixes": PREFIXES,
                  "zipf_s": ZIPF_S, "prefix_tokens": PREFIX_TOKENS, "question_tokens": QUESTION_TOKENS,
                  "output_tokens": OUTPUT_TOKENS, "block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS,
                  "step_s": STEP_S, "per_token_s": PER_TOKEN_S, "load_bound": LOAD_BOUND},
        "policies": policies,
        "hit_rate_bounded_over_prefix": bounded["hit_rate"] / prefix["hit_rate"],
        "max_over_mean_load_bounded": bounded["max_over_mean_load"],
    }  # fmt: skip
    results["targets"] = {
        key: {"target": f"{op} {bound}", "met": results[key] >= bound if op == ">=" else results[key] <= bound}
        for key, (op, bound) in TARGETS.items()
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.json.with_suffix(".png"))
    print(json.dumps({k: v for k, v in results.items() if k != "setup"}, indent=2))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["policies"])
    rows = results["policies"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, key, label in zip(
        axes, ("hit_rate", "max_over_mean_load", "ttft_p99_ms"), ("prefix hit rate", "max / mean load", "TTFT p99 (ms)")
    ):
        ax.bar(range(len(names)), [rows[n][key] for n in names], color=["#999", "#69c", "#c96", "#6a6"])
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=8)
        ax.set_title(label)
    axes[1].axhline(LOAD_BOUND, color="k", lw=0.8, ls="--")
    fig.suptitle(f"{WORKERS} workers, {PREFIXES} Zipf prefixes, {results['setup']['rate_per_s']:.0f} chats/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
