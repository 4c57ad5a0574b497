"""How long one stream's products take per token with each weight format's CPU kernel, against the
token time llama.cpp measured in a run of `bench_peers.py`: whether the one-stream target can be met
with the kernels the engine multiplies with.

A decoding stream multiplies one row by every weight once per token. Each format here is timed as
the engine's compiled step calls it, over a copy of every layer's weights (cold, as a step reads
them from memory, not from a cache that holds one layer): float32 through oneDNN's packed kernels
(services/worker/engine/cpu_linear.py; a compiled graph's own kernels, where it picks them, read
the same bytes), int8 and int4 through PyTorch's packed-weight kernels with
bfloat16 rows (services/worker/engine/quantize.py; int4 with its int8 output layer, as the engine
quantizes). Beside each, the time the weights' bytes take to read at this machine's read bandwidth
(a sum over a tensor larger than the caches): a kernel well above it is bound by its arithmetic.
Attention, norms and the host's work are left out, so the bound is generous. Rounds take turns
between the formats; each figure is a median.

    python loadtest/bench_cpu_one_row.py --peers loadtest/results/peers_cpu_zen3_avx2_quantized.json \\
        --json loadtest/results/cpu_one_row_zen3_avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_cpu_bound import model_products
from torch import nn

from services.worker.engine.cpu_linear import pack, project
from services.worker.engine.quantize import Int4Linear, Int8Linear
from shared.models.spec import resolve_model

MEASURE_S = 1.0  # each round times a format's products for at least this long
READ_BYTES = 1 << 30  # the bandwidth probe's tensor: far larger than any cache
ROW_DTYPES = {"float32": torch.float32, "int8": torch.bfloat16, "int4": torch.bfloat16}


class Packed(nn.Module):
    """A float32 weight packed for oneDNN, multiplied as the engine's CpuLinear does."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.packed = pack(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.packed)


def layer_kinds(scheme: str) -> tuple[type[nn.Module], type[nn.Module]]:
    """(the projections' module, the output layer's) for a format, as the engine builds them."""
    return {"float32": (Packed, Packed), "int8": (Int8Linear, Int8Linear), "int4": (Int4Linear, Int8Linear)}[scheme]


def weight_bytes(module: nn.Module) -> int:
    """What one product reads: the weight and its scales."""
    tensors = [*module.buffers(), *(t for t in vars(module).values() if isinstance(t, torch.Tensor))]
    return sum(t.numel() * t.element_size() if not t.is_mkldnn else 4 * t.numel() for t in tensors)


def kernel_call(module: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The module's product as the compiled step calls it: the kernel alone, not the module's
    reshapes and casts around it (a compiled graph fuses those into its neighbours)."""
    if isinstance(module, Int4Linear):
        codes, group, scales = module.weight, module.group, module.scales_and_zeros
        return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, group, scales)
    if isinstance(module, Int8Linear):
        return lambda: torch.ops.aten._weight_int8pack_mm(x, module.weight, module.scale)
    return lambda: module(x)


def one_token(scheme: str, num_layers: int, shapes: dict[str, tuple[int, int, int]]) -> tuple[Callable[[], None], int]:
    """A call that runs one row through every layer's projections and the output layer, and the bytes
    of weights it reads."""
    projection, output = layer_kinds(scheme)
    products: list[tuple[nn.Module, torch.Tensor]] = []
    for name, (rows, inner, cols) in shapes.items():
        kind, copies = (output, 1) if name == "output" else (projection, num_layers)
        x = torch.randn(rows, inner).to(ROW_DTYPES[scheme])
        products += [(kind(torch.randn(cols, inner) * 0.02), x) for _ in range(copies)]

    calls = [kernel_call(module, x) for module, x in products]

    def run() -> None:
        for call in calls:
            call()

    return run, sum(weight_bytes(module) for module, _ in products)


def read_gb_s() -> float:
    """The machine's read bandwidth with the benchmark's threads: a sum over a tensor no cache holds."""
    big = torch.ones(READ_BYTES // 4)
    big.sum()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - start)
    return READ_BYTES / statistics.median(times) / 1e9


def timed_ms(run: Callable[[], None]) -> float:
    """The median time of a call over at least MEASURE_S of calls, in ms."""
    run()
    times: list[float] = []
    while sum(times) < MEASURE_S or len(times) < 3:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=Path, required=True, help="a bench_peers.py JSON with a decode_1 workload")
    parser.add_argument("--peer", default="llama_q4_1")
    parser.add_argument("--target", type=float, default=0.7, help="the ratio of the peer's tok/s asked for")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    peers = json.loads(args.peers.read_text())
    threads = peers["meta"]["threads"]
    torch.set_num_threads(threads)
    config = resolve_model("smollm2").config
    shapes = model_products(config, rows=1)
    with torch.no_grad():
        tokens = {scheme: one_token(scheme, config.num_layers, shapes) for scheme in ROW_DTYPES}
        bandwidth = read_gb_s()
        per_round: dict[str, list[float]] = {scheme: [] for scheme in tokens}
        for _ in range(args.rounds):
            for scheme, (run, _) in tokens.items():
                per_round[scheme].append(timed_ms(run))
    peer_tok_s = peers["workloads"]["decode_1"]["median"][args.peer]
    budget_ms = 1e3 / (args.target * peer_tok_s)
    measured = peers["workloads"]["decode_1"]["median"]
    formats = {}
    for scheme, (_, nbytes) in tokens.items():
        ms = statistics.median(per_round[scheme])
        formats[scheme] = {
            "products_ms": ms, "per_round_ms": per_round[scheme], "weight_mb": nbytes / 1e6,
            "read_ms": nbytes / bandwidth / 1e6, "kernel_gb_s": nbytes / ms / 1e6,
            "products_only_tok_s": 1e3 / ms,
            # What the budget leaves for attention, norms and the host, against what the engine took.
            "budget_left_for_the_rest_ms": budget_ms - ms,
        }
        engine_tok_s = measured.get(f"drivetrain:{scheme}+compile")
        if engine_tok_s:
            formats[scheme] |= {"engine_ms_a_token": 1e3 / engine_tok_s, "engine_rest_ms": 1e3 / engine_tok_s - ms}
    results = {
        "meta": {"command": " ".join(["loadtest/bench_cpu_one_row.py", *sys.argv[1:]]), "threads": threads,
                 "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "peers_run": peers["meta"]["command"], "rounds": args.rounds,
                 "notes": "float32 through oneDNN's packed kernels, the eager step's; a compiled graph's autotuned "
                          "kernels may beat them at one row. Products only: a generous bound."},
        "read_gb_s": bandwidth,
        "peer": args.peer,
        "peer_tok_s": peer_tok_s,
        "peer_ms_a_token": 1e3 / peer_tok_s,
        "target": args.target,
        "budget_ms_a_token": budget_ms,
        "formats": formats,
    }
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        plot(results, args.json.with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    formats = results["formats"]
    names = list(formats)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.bar([n + ": products" for n in names], [formats[n]["products_ms"] for n in names], color="#4472c4")
    ax.bar([n + ": reading" for n in names], [formats[n]["read_ms"] for n in names], color="#a5a5a5")
    budget = f"a whole token at {results['target']}x {results['peer']}"
    ax.axhline(results["budget_ms_a_token"], color="#ed7d31", label=budget)
    ax.axhline(results["peer_ms_a_token"], color="#70ad47", label=f"{results['peer']}'s whole token")
    ax.set_ylabel("ms a token, one stream")
    ax.set_title(f"one row's products per weight format ({results['meta']['cpu_capability']})")
    ax.tick_params(axis="x", labelrotation=25)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
