"""Scenario A: one region of N GPUs, unified workers against every prefill/decode split of the
same N, swept over offered load. Every system at a given rate sees the same arrivals and lengths."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from sim_dispatch import DisaggregatedFleet, UnifiedFleet
from sim_events import EventLoop
from sim_metrics import SLO, capacity, output_tokens_in, summarize
from sim_model import StepModel
from sim_workload import Lengths, make_requests, poisson_arrivals

FULL_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5)
QUICK_FRACTIONS = (0.2, 0.5, 0.8, 1.2)


@dataclass(frozen=True)
class SweepConfig:
    num_gpus: int = 8
    lengths: Lengths = field(default_factory=Lengths)
    rate_fractions: tuple[float, ...] = FULL_FRACTIONS  # of capacity_estimate
    window_lifetimes: float = 3.0  # measured arrivals span this many lifetimes of a request at the loose SLO
    warmup_lifetimes: float = 1.0  # arrivals before the window fill the fleet and are not measured
    min_requests: int = 400  # ... or longer, so each point has at least this many requests
    saturation_rounds: int = 3  # closed-loop throughput run: requests = rounds x its concurrency (>= 3)
    itl_stat: str = "p90"
    splits: tuple[int, ...] = ()  # prefill workers in each disaggregated split; () = 1 .. N-1


def lifetime_s(model: StepModel, lengths: Lengths) -> float:
    """A median request alone on an idle worker: its prefill, then its decode steps at batch 1."""
    return model.prefill_s(lengths.prompt_median) + (lengths.output_median - 1) * model.decode_step_s(1, lengths.prompt_median)


def slo_lifetime_s(slo: SLO, lengths: Lengths) -> float:
    """A median request that just meets the SLO: how long a fleet near that load holds it."""
    return slo.ttft_s + (lengths.output_median - 1) * slo.itl_s


def capacity_estimate(model: StepModel, lengths: Lengths, num_gpus: int) -> float:
    """Requests/s the GPUs could finish if every decode ran in a full batch: the sweep's scale only."""
    prompt, output = lengths.means()
    batch = model.max_num_seqs
    decode = output * model.decode_step_s(batch, prompt + output / 2) / batch
    return num_gpus / (model.prefill_s(int(prompt)) + decode)


SLO_SCALES = (2.0, 3.0, 4.0, 6.0, 10.0)


def scaled_slo(model: StepModel, lengths: Lengths, scale: float, name: str = "") -> SLO:
    """An SLO pair as `scale` x the median request's zero-load TTFT and `scale` x a batch-1 decode step."""
    ttft, itl = model.prefill_s(lengths.prompt_median), model.decode_step_s(1, lengths.prompt_median)
    return SLO(name or f"scale_{scale:g}", scale * ttft, scale * itl)


def default_slos(model: StepModel, lengths: Lengths, tight: float = 3.0, loose: float = 10.0,
                 scales: tuple[float, ...] = SLO_SCALES) -> list[SLO]:
    """tight and loose first, then the SLO-scale series (DistServe's x-axis) the same runs are judged by."""
    return [scaled_slo(model, lengths, tight, "tight"), scaled_slo(model, lengths, loose, "loose"),
            *(scaled_slo(model, lengths, s) for s in scales)]


def system_names(config: SweepConfig) -> list[str]:
    splits = config.splits or tuple(range(1, config.num_gpus))
    return ["unified"] + [f"{p}P{config.num_gpus - p}D" for p in splits]


def build(name: str, loop: EventLoop, model: StepModel, num_gpus: int, on_finish):
    if name == "unified":
        return UnifiedFleet(loop, model, num_gpus, on_finish)
    prefill = int(name.split("P")[0])
    return DisaggregatedFleet(loop, model, prefill, num_gpus - prefill, on_finish)


def run_once(name: str, model: StepModel, num_gpus: int, arrivals: np.ndarray, prompts: np.ndarray,
             outputs: np.ndarray, window: tuple[float, float], slos: list[SLO], itl_stat: str) -> dict:
    """One system at one offered load; arrivals keep coming until every measured request is done."""
    loop = EventLoop()
    requests = make_requests(arrivals, prompts, outputs)
    left = sum(1 for r in requests if window[0] <= r.arrival < window[1])

    def finished(request) -> None:
        nonlocal left
        if window[0] <= request.arrival < window[1]:
            left -= 1
            if left == 0:
                loop.stop()

    fleet = build(name, loop, model, num_gpus, finished)

    def arrive(i: int) -> None:
        fleet.submit(requests[i])
        if i + 1 < len(requests):
            loop.at(requests[i + 1].arrival, arrive, i + 1)

    horizon = float(arrivals[-1]) if len(arrivals) else window[1]
    loop.at(requests[0].arrival, arrive, 0)
    end = loop.run(until=horizon)
    summary = summarize(requests, fleet.all_workers, window, end, slos, itl_stat)
    summary["simulated_s"] = end
    return summary


def saturation(name: str, model: StepModel, num_gpus: int, lengths: Lengths, rounds: int, seed: int) -> dict:
    """Throughput with the fleet kept full: 1.25 x its seats in flight, a new request for each one done.

    Measured between the first `concurrency` completions and the last, while it stays full."""
    if rounds < 3:
        raise ValueError("saturation needs >= 3 rounds: it measures between the first round's end and the last's start")
    loop = EventLoop()
    concurrency = int(1.25 * num_gpus * model.max_num_seqs)
    prompts, outputs = lengths.sample(np.random.default_rng([seed, 1_000_003]), concurrency * rounds)
    requests = make_requests(np.zeros(len(prompts)), prompts, outputs)
    finish_times: list[float] = []

    def finished(request) -> None:
        finish_times.append(loop.now)
        following = len(finish_times) + concurrency - 1
        if following < len(requests):
            requests[following].arrival = loop.now
            fleet.submit(requests[following])
        elif len(finish_times) == len(requests):
            loop.stop()

    fleet = build(name, loop, model, num_gpus, finished)
    for request in requests[:concurrency]:
        fleet.submit(request)
    loop.run()
    window = (finish_times[concurrency - 1], finish_times[-concurrency])
    tokens = output_tokens_in(requests, fleet.all_workers, window)
    done = sum(1 for t in finish_times if window[0] < t <= window[1])
    decoded, steps = 0, 0
    for worker in fleet.all_workers:  # decode batch of the steps inside the window, decoding workers only
        lo, hi = np.searchsorted(np.asarray(worker.step_ends), window)
        if sum(worker.step_decodes[lo:hi]):
            decoded, steps = decoded + sum(worker.step_decodes[lo:hi]), steps + hi - lo
    batch = decoded / max(1, steps)
    return {"concurrency": concurrency, "window_s": window, "output_tok_s": tokens / (window[1] - window[0]),
            "req_s": done / (window[1] - window[0]), "mean_decode_batch": batch}


def sweep(model: StepModel, config: SweepConfig, slos: list[SLO], seed: int) -> dict:
    """Every system at every rate, then each system's goodput capacity for each SLO pair.

    A system's sweep stops at the first rate where it meets no SLO for even half its requests:
    past that it is overloaded, and its capacity for every SLO is already known."""
    life = slo_lifetime_s(max(slos[:2], key=lambda s: s.itl_s), config.lengths)
    scale = capacity_estimate(model, config.lengths, config.num_gpus)
    rates = [f * scale for f in config.rate_fractions]
    names = system_names(config)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    stopped: set[str] = set()
    for i, rate in enumerate(rates):
        rng = np.random.default_rng([seed, i])
        span = max(config.window_lifetimes * life, config.min_requests / rate)
        window = (config.warmup_lifetimes * life, config.warmup_lifetimes * life + span)
        arrivals = poisson_arrivals(rng, rate, window[1] + span)  # after the window: load goes on
        prompts, outputs = config.lengths.sample(rng, len(arrivals))
        for name in names:
            if name in stopped:
                continue
            run = run_once(name, model, config.num_gpus, arrivals, prompts, outputs, window, slos, config.itl_stat)
            runs[name].append(run)
            if all(run["slo"][slo.name]["attainment"] < 0.5 for slo in slos):
                stopped.add(name)
    capacities = {
        slo.name: {n: capacity(rates[:len(runs[n])], [r["slo"][slo.name]["attainment"] for r in runs[n]]) for n in names}
        for slo in slos
    }
    best = {}
    for slo in slos:
        # Ties (all zero when no split meets the SLO at the lowest rate) go to the best attainment there.
        split = max(names[1:], key=lambda n: (capacities[slo.name][n]["rate"], runs[n][0]["slo"][slo.name]["attainment"]))
        best[slo.name] = {"split": split, "rate": capacities[slo.name][split]["rate"],
                          "unified_rate": capacities[slo.name]["unified"]["rate"]}
    saturated = {n: saturation(n, model, config.num_gpus, config.lengths, config.saturation_rounds, seed) for n in names}
    return {
        "num_gpus": config.num_gpus, "rates_req_s": rates, "rate_scale_req_s": scale,
        "rate_scale_note": "rates are fractions of capacity_estimate: GPUs / (prefill + full-batch decode time per request)",
        "warmup_s": window[0], "measure_window_s_min": config.window_lifetimes * life,
        "zero_load_lifetime_s": lifetime_s(model, config.lengths), "itl_stat": config.itl_stat,
        "sweep_stop_rule": "a system's sweep stops after the first rate where every SLO's attainment is below 50 %",
        "slos": [{"name": slo.name, **slo.as_dict()} for slo in slos],
        "systems": names, "runs": runs, "capacity_req_s": capacities, "best_split": best,
        "saturation": saturated,
    }
