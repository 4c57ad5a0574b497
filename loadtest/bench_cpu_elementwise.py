"""The C++ elementwise kernels of eager float32 CPU steps (kernels/cpu_elementwise.cpp) against the
PyTorch references they replace, at SmolLM2-135M's shapes: a layer's worth of them (SwiGLU's gate, two
residual adds with their RMSNorms, RoPE of q and of k) by rows, and prompts through an eager engine of
SmolLM2's own weights, every step from the first to the last: the peer benchmark's 64 chats, and its
2,000-token prompt. Each with the kernels and with the references, rounds taking turns, medians, the
ratio paired per round.

    python loadtest/bench_cpu_elementwise.py --json loadtest/results/cpu_elementwise.json
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from bench_report import paired_bars, paired_kernels, write_and_report
from peers_drivetrain import prompts_through_an_engine
from peers_workloads import prompts_for, workloads

from kernels import cpu_elementwise
from kernels.rms_norm import add_rms_norm
from kernels.rope import apply_rope
from kernels.silu_mul import silu_mul
from shared.models.shapes import SHAPES
from shared.models.smollm2 import smollm2_folder
from shared.models.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
SMOLLM2 = replace(SHAPES["tiny"], hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                  num_kv_heads=3, head_dim=64, rope_theta=100000.0)
LAYER_ROWS = [1, 64, 512, 2000]
PROMPTS = ["concurrent_64", "ttft_2k"]  # the peer benchmark's 64 chats, and its long prompt


def a_layers_elementwise(rows: int) -> Callable[[], object]:
    config, gen = SMOLLM2, torch.Generator().manual_seed(rows)
    x, delta, weight = (torch.randn(shape, generator=gen) for shape in ((rows, 576), (rows, 576), (576,)))
    qkv = torch.randn(rows, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, generator=gen)
    q = qkv[:, : config.num_heads * config.head_dim].view(rows, config.num_heads, config.head_dim)
    k = qkv[:, config.num_heads * config.head_dim :][:, : config.num_kv_heads * config.head_dim]
    k = k.view(rows, config.num_kv_heads, config.head_dim)
    cos, sin = torch.randn(rows, config.head_dim, generator=gen).unsqueeze(1).chunk(2, dim=-1)
    gate_up = torch.randn(rows, 2 * config.intermediate_size, generator=gen)

    def layer() -> None:
        add_rms_norm(x, delta, weight, 1e-5)
        apply_rope(q, cos, sin)
        apply_rope(k, cos, sin)
        add_rms_norm(x, delta, weight, 1e-5)
        silu_mul(gate_up)

    return layer


def plot(results: dict, path: Path) -> Path | None:
    cases = results["layer"] + results["prompt"]
    labels = [f"a layer's\n{c['rows']} rows" for c in results["layer"]] + \
             [f"{c['prompts']} prompt(s),\nan engine" for c in results["prompt"]]
    return paired_bars(path, labels, {"PyTorch's operations": [1.0] * len(cases),
                                      "C++ kernels": [c["kernels_over_references"] for c in cases]},
                       "time, of PyTorch's operations'",
                       f"eager float32 elementwise on the CPU ({results['meta']['threads']} threads)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5, help="calls timed per round (the median kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "cpu_elementwise.json")
    args = parser.parse_args()
    if not cpu_elementwise.available():
        parser.error("the elementwise kernels do not build here")
    torch.set_num_threads(args.threads)
    layer = [{"rows": rows, **paired_kernels(a_layers_elementwise(rows), cpu_elementwise, args.rounds, args.repeats)} for rows in LAYER_ROWS]
    tokenizer = Tokenizer.from_folder(smollm2_folder())
    prompt = []
    for name in PROMPTS:
        prompts = prompts_for(workloads(quick=False)[name], tokenizer)
        prompt.append({"prompts": len(prompts), "tokens": sum(map(len, prompts)),
                       **paired_kernels(prompts_through_an_engine(prompts), cpu_elementwise, args.rounds, 1)})
    for case in layer:
        print(f"a layer's elementwise, {case['rows']} rows: {case['references_ms']:.3f} -> {case['kernels_ms']:.3f} ms "
              f"({case['kernels_over_references']:.2f})")
    for case in prompt:
        print(f"{case['prompts']} prompt(s), {case['tokens']} tokens in all, through an engine: "
              f"{case['references_ms']:.0f} -> {case['kernels_ms']:.0f} ms "
              f"({case['kernels_over_references']:.2f})")
    worst = max(case["kernels_over_references"] for case in layer + prompt)
    results = {
        "meta": {"threads": args.threads, "rounds": args.rounds, "repeats": args.repeats, "cpu": platform.processor(),
                 "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__},
        "layer": layer,
        "prompt": prompt,
        # The kernels are worth their code only where nothing gets slower.
        "targets": {"elementwise.worst_kernels_over_references": {"value": worst, "target": "<= 1.0", "met": worst <= 1.0}},
    }
    write_and_report(results, args.json, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
