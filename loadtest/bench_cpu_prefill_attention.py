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

import math
from collections.abc import Callable

import kernel_bench
import torch

from kernels import cpu_prefill_attention
from kernels.cpu_attention import CpuAttentionPlan, paged_attention_cpu

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
STEP_BUDGET = 512  # the engine's CPU step budget: a long prompt's chunk
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


def main() -> int:
    args = kernel_bench.arguments(__doc__, "cpu_prefill_attention.json")
    if not cpu_prefill_attention.available():
        raise SystemExit("the prompt attention kernel does not build or run here")
    lengths = {name: [len(p) for p in prompts] for name, prompts in kernel_bench.peer_prompts().items()}
    lengths["8k_prompt"] = [LONGEST]
    layer = [{"name": name, "tokens": sum(each),
              **kernel_bench.paired_kernels(a_layers_prompt_steps(each), cpu_prefill_attention, args.rounds,
                                            args.repeats)}
             for name, each in lengths.items()]
    prompt = kernel_bench.through_an_engine(cpu_prefill_attention, args.rounds)
    for case in layer:
        print(f"a layer's prompt attention, {case['name']} ({case['tokens']} tokens): {case['references_ms']:.2f} -> "
              f"{case['kernels_ms']:.2f} ms ({case['kernels_over_references']:.2f})")
    kernel_bench.report(args, layer, [f"a layer,\n{c['name']}" for c in layer], prompt,
                        "prefill_attention.worst_kernel_over_fused", ("PyTorch's fused attention", "C++ kernel"),
                        "float32 prompt attention on the CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
