"""SIMULATED serving fleet: unified against disaggregated prefill/decode at equal GPU count, and
regions with a day of load, overflow off against on. A discrete-event model of the engine's steps
in virtual time, for fleets this 2-core machine cannot run; nothing here is measured.

    python loadtest/sim_fleet.py                               # both profiles -> loadtest/results/sim_fleet.{json,png}
    python loadtest/sim_fleet.py --profile h200-llama8b --link-gbps 25
    python loadtest/sim_fleet.py --quick --json /tmp/sim.json  # a CI-sized run

Profiles: cpu-smollm2 (step costs from loadtest/results/peers_cpu.json) and h200-llama8b (derived
from stated facts). Modules: sim_inputs (calibration), sim_model (step cost), sim_workers and
sim_dispatch (the fleets), sim_single_region (scenario A), sim_regions (scenario B), sim_metrics,
sim_conclusions, sim_plot.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench_report import write_and_report
from sim_conclusions import PUBLISHED, scenario_a, scenario_b
from sim_inputs import PROFILES, load_profile
from sim_metrics import ITL_STATS, SLO
from sim_plot import plot_results
from sim_regions import RegionsConfig, scenario
from sim_single_region import (
    QUICK_FRACTIONS,
    SLO_SCALES,
    SweepConfig,
    default_slos,
    sweep,
)
from sim_workload import Lengths

RESULTS = Path(__file__).resolve().parent / "results"
LABEL = "SIMULATED: discrete-event model of the engine's steps in virtual time (loadtest/sim_fleet.py), not a measurement"


def numbers(text: str, kind=float) -> tuple:
    return tuple(kind(x) for x in text.split(",") if x.strip())


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="cpu-smollm2,h200-llama8b", help=f"comma list of {', '.join(PROFILES)}")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a CI-sized run (4 GPUs, 4 rates, short windows)")
    p.add_argument("--json", type=Path, default=RESULTS / "sim_fleet.json")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--link-gbps", type=float, help="KV link bandwidth in GB/s (gigaBYTES per second), every profile")
    p.add_argument("--token-budget", type=int, help="tokens per engine step (default: the profile's)")
    p.add_argument("--gpus", type=int, help="scenario A: GPUs in the region (default 8; --quick 4)")
    p.add_argument("--splits", type=lambda t: numbers(t, int), default=(), help="prefill worker counts to try, e.g. 2,4,6 (default all)")
    p.add_argument("--rates", type=numbers, help="offered loads as fractions of the capacity estimate, e.g. 0.2,0.5,1")
    p.add_argument("--prompt-median", type=int, default=1500)
    p.add_argument("--output-median", type=int, default=200)
    p.add_argument("--length-sigma", type=float, default=0.5, help="lognormal sigma of both lengths")
    p.add_argument("--slo-tight", type=numbers, help="TTFT_S,ITL_S (default 3x the zero-load TTFT / batch-1 step)")
    p.add_argument("--slo-loose", type=numbers, help="TTFT_S,ITL_S (default 10x)")
    p.add_argument("--itl-stat", choices=ITL_STATS, default="p90", help="per-request ITL statistic an SLO bounds")
    p.add_argument("--regions", type=int, default=3)
    p.add_argument("--region-gpus", type=int, help="scenario B: unified GPUs per region (default 4; --quick 2)")
    p.add_argument("--rtt-ms", type=numbers, default=(70.0, 140.0), help="NEAR,FAR round trips between regions")
    p.add_argument("--region-peak", type=float, default=1.25, help="peak offered load over a region's saturated throughput")
    p.add_argument("--admit-backlog-s", type=float, help="a region has room below this queued prompt work per worker (default: half the loose TTFT bound)")
    p.add_argument("--day-lifetimes", type=float, help="scenario B: the compressed day, in request lifetimes (default 50; --quick 12)")
    return p.parse_args(argv)


def run_profile(name: str, args: argparse.Namespace) -> dict:
    started = time.monotonic()
    profile = load_profile(name, args.link_gbps, args.token_budget)
    if profile.model is None:
        return {"simulated": True, "problems": profile.problems, "inputs": profile.inputs}
    model = profile.model
    lengths = Lengths(args.prompt_median, args.output_median, args.length_sigma)
    slos = default_slos(model, lengths)
    if args.slo_tight:
        slos[0] = SLO("tight", *args.slo_tight)
    if args.slo_loose:
        slos[1] = SLO("loose", *args.slo_loose)
    sweep_config = SweepConfig(num_gpus=args.gpus or (4 if args.quick else 8), lengths=lengths, itl_stat=args.itl_stat,
                               splits=args.splits)
    if args.quick:
        sweep_config = replace(sweep_config, rate_fractions=QUICK_FRACTIONS, window_lifetimes=1.0, warmup_lifetimes=0.5,
                               min_requests=100)
    if args.rates:
        sweep_config = replace(sweep_config, rate_fractions=args.rates)
    a = sweep(model, sweep_config, slos, args.seed)
    region_config = RegionsConfig(num_regions=args.regions, gpus_per_region=args.region_gpus or (2 if args.quick else 4),
                                  rtt_ms=args.rtt_ms, peak_over_capacity=args.region_peak, lengths=lengths,
                                  day_lifetimes=args.day_lifetimes or (12.0 if args.quick else 50.0))
    per_gpu = a["saturation"]["unified"]["req_s"] / sweep_config.num_gpus
    loose = slos[1]
    b = scenario(model, region_config, per_gpu, args.admit_backlog_s or 0.5 * loose.ttft_s, loose, args.seed)
    return {
        "simulated": True,
        "inputs": profile.inputs,
        "problems": profile.problems,
        "step_model": model.as_dict(),
        "workload": {"arrivals": "Poisson", "prompt_median": lengths.prompt_median, "output_median": lengths.output_median,
                     "lognormal_sigma": lengths.sigma, "prompt_max": lengths.prompt_max, "output_max": lengths.output_max},
        "slo_definition": f"a request meets an SLO pair when it finished, TTFT <= ttft_s and the {args.itl_stat} of its own "
                          "inter-token gaps <= itl_s; defaults are multiples (tight 3x, loose 10x, and the scale series "
                          f"{', '.join(f'{s:g}' for s in SLO_SCALES)}) of the median prompt's zero-load TTFT and of a batch-1 decode step",
        "goodput_definition": "DistServe's: goodput capacity = the highest offered rate at which >= 90 % of requests meet the "
                              "SLO (interpolated between swept rates); goodput at a rate = requests meeting it per second",
        "scenario_a": a,
        "scenario_b": b,
        "conclusions": {"scenario_a": scenario_a(a, model, lengths), "scenario_b": scenario_b(b)},
        "seconds": time.monotonic() - started,
    }


def rounded(value, digits: int = 5):
    """Floats to `digits` significant figures, so the committed JSON stays readable."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def targets(profiles: dict) -> dict:
    """The published directions, checked per profile (verdicts, not tuning goals)."""
    out = {}
    for name, p in profiles.items():
        if "conclusions" not in p:
            continue
        a, b = p["conclusions"]["scenario_a"], p["conclusions"]["scenario_b"]
        checks = {
            "tight_goodput_disagg_over_unified": (a["goodput_ratio_tight"], "> 1 (DistServe's direction)", a["goodput_ratio_tight"] > 1),
            "itl_p99_disagg_over_unified": (a["itl_p99_ratio_median"], "< 1 (vLLM: tail ITL improves)", a["tail_itl_improves"]),
            "saturated_throughput_disagg_over_unified": (a["throughput_ratio"], "<= 1.05 (vLLM: throughput does not improve)",
                                                          not a["throughput_improves"]),
            "region_peak_ttft_p99_on_over_off": (b["peak_ttft_p99_on_over_off_worst"], "< 1", b["overflow_helps_every_region"]),
        }
        for key, (value, target, met) in checks.items():
            out[f"{name}.{key}"] = {"value": value if math.isfinite(value) else float("nan"), "target": target, "met": bool(met)}
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    names = [n.strip() for n in args.profile.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        raise SystemExit(f"unknown profile(s) {unknown}; known: {sorted(PROFILES)}")
    started = time.monotonic()
    profiles = {name: run_profile(name, args) for name in names}
    default = next((n for n in names if not profiles[n].get("problems")), names[0])
    results = {
        "simulated": True,
        "label": LABEL,
        "command": " ".join(["python", "loadtest/sim_fleet.py", *(argv if argv is not None else sys.argv[1:])]),
        "seed": args.seed,
        "quick": args.quick,
        "default_profile": default,
        "default_profile_rule": "the first profile asked for whose inputs pass their sanity checks (problems empty)",
        "published": PUBLISHED,
        "profiles": profiles,
        "targets": targets(profiles),
        "seconds": time.monotonic() - started,
    }
    results = rounded(results)
    write_and_report(results, args.json, (lambda r, p: None) if args.no_plot else plot_results)
    for name, p in profiles.items():
        if "conclusions" in p:
            print(f"\n{name} (SIMULATED):")
            for line in p["conclusions"]["scenario_a"]["why"]:
                print(f"  {line}")
    return results


if __name__ == "__main__":
    main()
