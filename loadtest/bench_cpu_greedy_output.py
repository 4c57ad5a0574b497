"""The greedy output layer on a CPU (services/worker/engine/greedy_output.py): SmolLM2-135M's own output
layer (its embedding, 49,152 x 576) for 1, 16 and 64 rows, every logit in float32 through oneDNN then
the argmax, against the bfloat16 screen and the float32 rescoring of the tokens it leaves. States drawn
at the norm of SmolLM2's final ones (~47); rounds taking turns, medians, the ratio paired per round.
The tokens of both are compared on every call timed.

    python loadtest/bench_cpu_greedy_output.py --json loadtest/results/cpu_greedy_output.json
"""

from __future__ import annotations

import statistics
from pathlib import Path

import kernel_bench
import torch
from bench_report import median_seconds, paired_bars, write_and_report
from safetensors.torch import load_file

from kernels import cpu_greedy_output
from services.worker.engine.cpu_linear import pack, project
from services.worker.engine.greedy_output import GreedyOutput
from services.worker.engine.sampler import argmax_rows
from shared.models.smollm2 import smollm2_folder

ROWS = [1, 16, 64]
STATE_NORM = 47.0  # SmolLM2's final states, over its own answers


def output_weight() -> torch.Tensor:
    tensors = load_file(smollm2_folder() / "model.safetensors")
    return next(t for name, t in tensors.items() if name.endswith("embed_tokens.weight")).float().contiguous()


def measure(weight: torch.Tensor, rows: int, rounds: int, repeats: int) -> dict:
    full, screened = pack(weight), GreedyOutput(weight)
    states = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    states *= STATE_NORM / states.norm(dim=1, keepdim=True)

    def every_logit() -> torch.Tensor:
        return argmax_rows(project(states, full))

    assert torch.equal(every_logit(), screened.tokens(states)), "the screen picked another token"
    timed: dict[str, list[float]] = {"every_logit": [], "screened": []}
    for r in range(rounds):
        for name in (("every_logit", "screened") if r % 2 == 0 else ("screened", "every_logit")):
            call = every_logit if name == "every_logit" else lambda: screened.tokens(states)
            timed[name].append(median_seconds(call, repeats))
    ratios = [s / f for s, f in zip(timed["screened"], timed["every_logit"], strict=True)]
    return {"rows": rows, "every_logit_ms": 1000 * statistics.median(timed["every_logit"]),
            "screened_ms": 1000 * statistics.median(timed["screened"]),
            "screened_over_every_logit": statistics.median(ratios), "ratios": ratios}


def main() -> int:
    args = kernel_bench.arguments(__doc__, "cpu_greedy_output.json")
    if not cpu_greedy_output.available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("the greedy output kernel does not build here, or this CPU's oneDNN has no bfloat16")
    weight = output_weight()
    cases = [measure(weight, rows, args.rounds, args.repeats) for rows in ROWS]
    for case in cases:
        print(f"{case['rows']} rows: every logit {case['every_logit_ms']:.2f} ms, "
              f"screened {case['screened_ms']:.2f} ms ({case['screened_over_every_logit']:.2f})")
    worst = max(case["screened_over_every_logit"] for case in cases)
    results = {
        "meta": kernel_bench.meta(args),
        "cases": cases,
        "targets": {"screened_over_every_logit_worst": {"value": worst, "target": "<= 0.75", "met": worst <= 0.75}},
    }

    def plot(results: dict, path: Path) -> Path | None:
        cases = results["cases"]
        return paired_bars(path, [f"{c['rows']} row(s)" for c in cases],
                           {"every logit in float32": [c["every_logit_ms"] for c in cases],
                            "bfloat16 screen + float32 rescoring": [c["screened_ms"] for c in cases]},
                           "ms per call", f"SmolLM2's output layer, greedy rows ({results['meta']['threads']} threads)")

    write_and_report(results, args.json, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
