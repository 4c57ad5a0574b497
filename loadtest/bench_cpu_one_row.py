"""How long one stream's products take per token with each weight format, as the engine's compiled
decode step multiplies them, against the token time llama.cpp measured in a run of `bench_peers.py`:
whether the one-stream target can be met with the kernels the engine gets.

A decoding stream multiplies one row by every weight once per token. Each format's products (every
layer's projections and the output layer, each over weights of its own, so that they are read from
memory as a step reads them, not from a cache that holds one layer) compile into one graph with the
options of the engine's graphs for one row (services/worker/engine/cpu_graphs.py: frozen weights,
inductor's GEMM templates timed against ATen's kernels, or inductor's alone for int8): float32 as
the few-rows module multiplies the dense weights, int8 and int4 as services/worker/engine/quantize.py
builds them (int4 with its int8 output layer). Beside each, the time its weights' bytes take to
read at this machine's read bandwidth (a sum over a tensor larger than the caches): a format well
above it is bound by its arithmetic. Attention, norms and the host's work are left out, so the
bound is generous. Rounds take turns between the formats; each figure is a median.

    python loadtest/bench_cpu_one_row.py --peers loadtest/results/peers_cpu_zen3_avx2_int8_one_row.json \\
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
from bench_report import print_and_write, pyplot
from torch import nn

from services.worker.engine.cpu_graphs import FEW_ROWS, compiling, quantized_plans, weights_digest
from services.worker.engine.quantize import Int4Linear, Int8Linear
from shared.models.spec import resolve_model

MEASURE_S = 1.0  # each round times a format's products for at least this long
READ_BYTES = 1 << 30  # the bandwidth probe's tensor: far larger than any cache
FORMATS = ("float32", "int8", "int4")


def dense(weight: torch.Tensor) -> nn.Linear:
    """A float32 projection as the few-rows graph traces it: the dense weight, packed by inductor."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def layer_kinds(scheme: str) -> tuple[Callable[[torch.Tensor], nn.Module], Callable[[torch.Tensor], nn.Module]]:
    """(the projections' module, the output layer's) for a format, as the engine builds them."""
    return {"float32": (dense, dense), "int8": (Int8Linear, Int8Linear), "int4": (Int4Linear, Int8Linear)}[scheme]


def weight_bytes(module: nn.Module) -> int:
    """What one product reads: the weight and its scales."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class Products(nn.Module):
    """Each layer's product of its own row: one decode step's products, as one graph."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        return [layer(x) for layer, x in zip(self.layers, rows, strict=True)]


def one_token(scheme: str, num_layers: int,
              shapes: dict[str, tuple[int, int, int]]) -> tuple[Callable[[], list[torch.Tensor]], int]:
    """A call that runs one row through every layer's products, compiled as the engine compiles them,
    and the bytes of weights it reads."""
    projection, output = layer_kinds(scheme)
    layers: list[nn.Module] = []
    rows: list[torch.Tensor] = []
    for name, (num_rows, inner, cols) in shapes.items():
        kind, copies = (output, 1) if name == "output" else (projection, num_layers)
        layers += [kind(torch.randn(cols, inner) * 0.02) for _ in range(copies)]
        rows += [torch.randn(num_rows, inner) for _ in range(copies)]
    products = Products(layers).eval()
    plan = FEW_ROWS if scheme == "float32" else quantized_plans(scheme)[0]
    compiled = torch.compile(products, dynamic=False)
    # Without autograd, as the engine's: only then are the weights frozen, and a call with autograd on
    # would compile a graph of its own.
    run = torch.no_grad()(lambda: compiled(rows))
    with compiling(plan, weights_digest(products)):
        run()
    return run, sum(weight_bytes(layer) for layer in layers)


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


def timed_ms(run: Callable[[], object]) -> float:
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
    measured = peers.get("workloads", {}).get("decode_1", {}).get("median", {})
    if args.peer not in measured:  # checked before minutes of compiling, not after
        parser.error(f"{args.peers} has no decode_1 figure for {args.peer!r}; it has {sorted(measured)}")
    threads = peers["meta"]["threads"]
    torch.set_num_threads(threads)
    config = resolve_model("smollm2").config
    shapes = model_products(config, rows=1)
    with torch.no_grad():
        tokens = {scheme: one_token(scheme, config.num_layers, shapes) for scheme in FORMATS}
        bandwidth = read_gb_s()
        per_round: dict[str, list[float]] = {scheme: [] for scheme in tokens}
        for _ in range(args.rounds):
            for scheme, (run, _) in tokens.items():
                per_round[scheme].append(timed_ms(run))
    peer_tok_s = measured[args.peer]
    budget_ms = 1e3 / (args.target * peer_tok_s)
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
                 "notes": "products only, compiled as the engine's one-row graphs: a generous bound"},
        "read_gb_s": bandwidth,
        "peer": args.peer,
        "peer_tok_s": peer_tok_s,
        "peer_ms_a_token": 1e3 / peer_tok_s,
        "target": args.target,
        "budget_ms_a_token": budget_ms,
        "formats": formats,
    }
    print_and_write(results, args.json, plot)


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
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
