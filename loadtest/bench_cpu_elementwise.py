"""The C++ elementwise kernels of eager float32 CPU steps (kernels/cpu_elementwise.cpp) against the
PyTorch references they replace, at SmolLM2-135M's shapes: a layer's worth of them (SwiGLU's gate, two
residual adds with their RMSNorms, RoPE of q and of k) by rows, and prompts through an eager engine of
SmolLM2's own weights, every step from the first to the last: the peer benchmark's 64 chats, and its
2,000-token prompt. Each with the kernels and with the references, rounds taking turns, medians, the
ratio paired per round.

    python loadtest/bench_cpu_elementwise.py --json loadtest/results/cpu_elementwise.json
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import kernel_bench
import torch

from kernels import cpu_elementwise
from kernels.rms_norm import add_rms_norm
from kernels.rope import apply_rope
from kernels.silu_mul import silu_mul
from shared.models.shapes import SHAPES

SMOLLM2 = replace(SHAPES["tiny"], hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                  num_kv_heads=3, head_dim=64, rope_theta=100000.0)
LAYER_ROWS = [1, 64, 512, 2000]


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


def main() -> int:
    args = kernel_bench.arguments(__doc__, "cpu_elementwise.json")
    if not cpu_elementwise.available():
        raise SystemExit("the elementwise kernels do not build here")
    layer = [{"rows": rows, **kernel_bench.paired_kernels(a_layers_elementwise(rows), cpu_elementwise, args.rounds,
                                                           args.repeats)} for rows in LAYER_ROWS]
    prompt = kernel_bench.through_an_engine(cpu_elementwise, args.rounds)
    for case in layer:
        print(f"a layer's elementwise, {case['rows']} rows: {case['references_ms']:.3f} -> {case['kernels_ms']:.3f} ms "
              f"({case['kernels_over_references']:.2f})")
    kernel_bench.report(args, layer, [f"a layer's\n{c['rows']} rows" for c in layer], prompt,
                        "elementwise.worst_kernels_over_references", ("PyTorch's operations", "C++ kernels"),
                        "eager float32 elementwise on the CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
