"""The C++ panel projection (kernels/cpu_panel_linear.cpp) against oneDNN's packed products
(services/worker/engine/cpu_linear.py), as a step multiplies: SmolLM2's four products a layer, in
the model's order, over 30 layers' weights in turn (far more than any cache of the processor holds),
at a decode step's rows and a prompt chunk's, in float32 or bfloat16. Rounds take turns; medians, the
ratio paired per round.

    python loadtest/bench_cpu_panel_linear.py --json loadtest/results/cpu_panel_linear.json
    python loadtest/bench_cpu_panel_linear.py --dtype bfloat16 --json loadtest/results/cpu_panel_linear_bf16.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

import torch
from bench_report import median_seconds, paired_bars, write_and_report

from kernels import cpu_panel_linear
from services.worker.engine.cpu_linear import pack, project

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = 30
PRODUCTS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # SmolLM2's (N, K)
ROWS = (1, 16, 64, 512)
TARGET = 1.0  # at every row count, no slower than oneDNN: the kernel replaces it


def measure(rows: int, rounds: int, repeats: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(rows)
    dense = [[(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for n, k in PRODUCTS.values()]
             for _ in range(LAYERS)]
    onednn = [[pack(w) for w in layer] for layer in dense]
    panels = [[cpu_panel_linear.pack(w) for w in layer] for layer in dense]
    del dense
    inputs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in PRODUCTS.values()]
    columns = [n for n, _ in PRODUCTS.values()]

    def through_onednn() -> None:
        for layer in onednn:
            for x, w in zip(inputs, layer):
                project(x, w)

    def through_panels() -> None:
        for layer in panels:
            for x, w, n in zip(inputs, layer, columns):
                cpu_panel_linear.project(x, w, n)

    times: dict[str, list[float]] = {"onednn": [], "panels": []}
    for r in range(rounds):
        for name in (("onednn", "panels") if r % 2 == 0 else ("panels", "onednn")):
            times[name].append(median_seconds(through_onednn if name == "onednn" else through_panels, repeats))
    ratios = [p / o for p, o in zip(times["panels"], times["onednn"])]
    flops = 2 * rows * sum(n * k for n, k in PRODUCTS.values()) * LAYERS
    return {"rows": rows,
            "onednn_ms_per_layer": 1e3 * statistics.median(times["onednn"]) / LAYERS,
            "panels_ms_per_layer": 1e3 * statistics.median(times["panels"]) / LAYERS,
            "onednn_gflops": flops / statistics.median(times["onednn"]) / 1e9,
            "panels_gflops": flops / statistics.median(times["panels"]) / 1e9,
            "panels_over_onednn": statistics.median(ratios), "ratios": ratios}


def plot(results: dict, path: Path) -> Path | None:
    cases = results["cases"]
    return paired_bars(path, [f"{c['rows']} rows" for c in cases],
                       {"oneDNN, packed": [c["onednn_gflops"] for c in cases],
                        "panel kernel": [c["panels_gflops"] for c in cases]},
                       "GFLOPS", f"SmolLM2's products in {results['meta']['dtype']}, {LAYERS} layers in turn "
                       f"({results['meta']['threads']} threads)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=5, help="calls over every layer timed per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--json", type=Path, default=RESULTS / "cpu_panel_linear.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not cpu_panel_linear.available(dtype):
        parser.error(f"the panel kernel does not multiply {args.dtype} here")
    torch.set_num_threads(args.threads)
    cases = [measure(rows, args.rounds, args.repeats, dtype) for rows in ROWS]
    for case in cases:
        print(f"{case['rows']} rows: {case['panels_ms_per_layer']:.3f} ms a layer against oneDNN's "
              f"{case['onednn_ms_per_layer']:.3f} ({case['panels_over_onednn']:.3f}; {case['panels_gflops']:.0f} "
              f"against {case['onednn_gflops']:.0f} GFLOPS)")
    worst = max(case["panels_over_onednn"] for case in cases)
    results = {
        "meta": {"dtype": args.dtype, "threads": args.threads, "rounds": args.rounds, "repeats": args.repeats, "layers": LAYERS,
                 "cpu": platform.processor(), "capability": torch.backends.cpu.get_cpu_capability(),
                 "torch": torch.__version__},
        "cases": cases,
        "targets": {"panels.worst_over_onednn": {"value": worst, "target": f"<= {TARGET}", "met": worst <= TARGET}},
    }
    write_and_report(results, args.json, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
