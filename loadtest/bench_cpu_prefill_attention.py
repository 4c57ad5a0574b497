"""The C++ prompt attention kernel (kernels/cpu_prefill_attention.cpp) against PyTorch's fused CPU
attention, which float32 prompt steps used before it, at SmolLM2-135M's heads (9 query heads over 3 KV
heads of 64): one layer's attention over the engine's own plans (a 2,000-token prompt in its four
chunks of 512, the peer benchmark's 64 chats' prompts in their groups, and an 8,000-token prompt, the
model's context, in sixteen chunks), and prompts through an eager
engine of SmolLM2's own weights, every step from the first to the last: the 64 chats, and the
2,000-token prompt whose first token the peer benchmark times. Each with the kernel and with the fused
attention, rounds taking turns, medians, the ratio paired per round.

    python loadtest/bench_cpu_prefill_attention.py --json loadtest/results/cpu_prefill_attention.json
"""

from __future__ import annotations

import argparse
import math
import platform
from collections.abc import Callable
from pathlib import Path

import torch
from bench_report import paired_bars, paired_kernels, write_and_report
from peers_drivetrain import prompts_through_an_engine
from peers_workloads import prompts_for, workloads

from kernels import cpu_prefill_attention
from kernels.cpu_attention import CpuAttentionPlan, paged_attention_cpu
from shared.models.smollm2 import smollm2_folder
from shared.models.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
STEP_BUDGET = 512  # the engine's CPU step budget: a long prompt's chunk
PROMPTS = ["concurrent_64", "ttft_2k"]  # the peer benchmark's 64 chats, and its long prompt
LONGEST = 8000  # a prompt near SmolLM2's context of 8,192


def a_layers_prompt_steps(lengths: list[int]) -> Callable[[], object]:
    """One layer's attention in every step that prompts of these lengths take, each step's plan built as
    the engine builds it (all prompts start together, each step takes STEP_BUDGET tokens of them)."""
    gen = torch.Generator().manual_seed(len(lengths))
    tables = torch.arange(sum(math.ceil(n / BLOCK_SIZE) for n in lengths) + 1)[1:]
    cache_shape = (len(tables) + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen)
    block_tables, first = [], 0
    for n in lengths:
        block_tables.append(tables[first:first + math.ceil(n / BLOCK_SIZE)])
        first += math.ceil(n / BLOCK_SIZE)
    block_tables = torch.nn.utils.rnn.pad_sequence(block_tables, batch_first=True)
    steps, done = [], [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        budget, chunks = STEP_BUDGET, []
        for seq, n in enumerate(lengths):
            take = min(n - done[seq], budget)
            chunks.append(take)
            budget -= take
            done[seq] += take
        cu = torch.tensor([0, *chunks]).cumsum(0)
        plan = CpuAttentionPlan.build(torch.full((int(cu[-1]),), -1), block_tables, cu,
                                      torch.tensor([d if c else 0 for d, c in zip(done, chunks, strict=True)]),
                                      BLOCK_SIZE)
        steps.append((torch.randn(int(cu[-1]), NUM_Q_HEADS, HEAD_DIM, generator=gen), plan))
    return lambda: [paged_attention_cpu(q, k_cache, v_cache, plan, HEAD_DIM ** -0.5) for q, plan in steps]


def plot(results: dict, path: Path) -> Path | None:
    cases = results["layer"] + results["prompt"]
    labels = [f"a layer,\n{c['name']}" for c in results["layer"]] + \
             [f"{c['prompts']} prompt(s),\nan engine" for c in results["prompt"]]
    return paired_bars(path, labels, {"PyTorch's fused attention": [1.0] * len(cases),
                                      "C++ kernel": [c["kernels_over_references"] for c in cases]},
                       "time, of the fused attention's",
                       f"float32 prompt attention on the CPU ({results['meta']['threads']} threads)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5, help="calls timed per round (the median kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "cpu_prefill_attention.json")
    args = parser.parse_args()
    if not cpu_prefill_attention.available():
        parser.error("the prompt attention kernel does not build or run here")
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_folder(smollm2_folder())
    named = {name: prompts_for(workloads(quick=False)[name], tokenizer) for name in PROMPTS}
    lengths = {name: [len(p) for p in prompts] for name, prompts in named.items()} | {"8k_prompt": [LONGEST]}
    layer = [{"name": name, "tokens": sum(each),
              **paired_kernels(a_layers_prompt_steps(each), cpu_prefill_attention, args.rounds, args.repeats)}
             for name, each in lengths.items()]
    prompt = [{"prompts": len(prompts), "tokens": sum(map(len, prompts)),
               **paired_kernels(prompts_through_an_engine(prompts), cpu_prefill_attention, args.rounds, 1)}
              for prompts in named.values()]
    for case in layer:
        print(f"a layer's prompt attention, {case['name']} ({case['tokens']} tokens): {case['references_ms']:.2f} -> "
              f"{case['kernels_ms']:.2f} ms ({case['kernels_over_references']:.2f})")
    for case in prompt:
        print(f"{case['prompts']} prompt(s), {case['tokens']} tokens in all, through an engine: "
              f"{case['references_ms']:.0f} -> {case['kernels_ms']:.0f} ms ({case['kernels_over_references']:.2f})")
    worst = max(case["kernels_over_references"] for case in layer + prompt)
    results = {
        "meta": {"threads": args.threads, "rounds": args.rounds, "repeats": args.repeats, "cpu": platform.processor(),
                 "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__},
        "layer": layer,
        "prompt": prompt,
        # The kernel is worth its code only where nothing gets slower.
        "targets": {"prefill_attention.worst_kernel_over_fused": {"value": worst, "target": "<= 1.0",
                                                                  "met": worst <= 1.0}},
    }
    write_and_report(results, args.json, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
