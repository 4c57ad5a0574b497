"""How fast a workload of the peer benchmark could run on this CPU if every float32 multiply ran at
the fastest product rate timed here, against what Drivetrain and llama.cpp measured in a run of
`bench_peers.py`.

The products of a step are the model's weights times its rows: 2 x weights FLOPs a row (the output
layer only for rows that are sampled). Attention, norms and the host's work are left out, so the
bound is generous. The rate is the fastest product timed here, with the benchmark's threads
(medians of at least a second of repeats): a square one through PyTorch's matmul (MKL) and
through oneDNN's packed kernels, and the model's own at the workload's rows through the packed
kernels, as the engine multiplies them (services/worker/engine/cpu_linear.py).

    python loadtest/bench_cpu_bound.py --peers loadtest/results/peers_cpu_f32_64_zen5.json \\
        --json loadtest/results/cpu_bound_64.json
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
from bench_report import print_and_write, pyplot

from services.worker.engine.cpu_linear import pack, project
from shared.models.shapes import ModelConfig
from shared.models.spec import resolve_model

REPEATS = 15
MEASURE_S = 1.0  # at least this long per product: 15 repeats of a sub-millisecond one caught the cores cold
SQUARE = 2048


def weights_per_row(config: ModelConfig) -> tuple[int, int]:
    """(multiplies of one row through the layers, multiplies of one row through the output layer)."""
    hidden, inner = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = hidden * (q_out + 2 * kv_out) + q_out * hidden + 3 * hidden * inner
    return config.num_layers * per_layer, hidden * config.vocab_size


def model_products(config: ModelConfig, rows: int) -> dict[str, tuple[int, int, int]]:
    """The model's products at `rows` rows: (rows, inner, columns) each, as the engine fuses them."""
    hidden, inner = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "qkv": (rows, hidden, q_out + 2 * kv_out),
        "o": (rows, q_out, hidden),
        "gate_up": (rows, hidden, 2 * inner),
        "down": (rows, inner, hidden),
        "output": (rows, hidden, config.vocab_size),
    }


def gflops(rows: int, inner: int, cols: int, packed: bool) -> float:
    """One product's rate, through oneDNN's packed kernels or PyTorch's matmul."""
    x, weight = torch.randn(rows, inner), torch.randn(cols, inner)
    product: Callable[[], torch.Tensor]
    if packed:
        packed_weight = pack(weight)
        product = lambda: project(x, packed_weight)  # noqa: E731
    else:
        dense = weight.t().contiguous()
        product = lambda: x @ dense  # noqa: E731
    for _ in range(3):
        product()
    times: list[float] = []
    while len(times) < REPEATS or sum(times) < MEASURE_S:
        start = time.perf_counter()
        product()
        times.append(time.perf_counter() - start)
    return 2 * rows * inner * cols / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=Path, required=True, help="a bench_peers.py JSON with a concurrent workload")
    parser.add_argument("--workload", default="concurrent_64")
    parser.add_argument("--peer", default="llama_f32")
    parser.add_argument("--target", type=float, default=1.5, help="the ratio over the peer asked for")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    peers = json.loads(args.peers.read_text())
    threads = peers["meta"]["threads"]
    run = peers["workloads"][args.workload]
    config = resolve_model("smollm2").config
    body, head = weights_per_row(config)
    streams, new_tokens = run["streams"], run["new_tokens"]
    prompt = (run["prompt_tokens_min"] + run["prompt_tokens_max"]) / 2  # the prompts' mean length, near enough
    # Every stream's prompt and its new tokens but the last pass through the layers; each new token is sampled.
    flop = 2 * streams * ((prompt + new_tokens - 1) * body + new_tokens * head)
    torch.set_num_threads(threads)
    rates = {
        "square_matmul": gflops(SQUARE, SQUARE, SQUARE, packed=False),
        "square_packed": gflops(SQUARE, SQUARE, SQUARE, packed=True),
    }
    rates |= {f"{name}_packed": gflops(*shape, packed=True) for name, shape in model_products(config, streams).items()}
    peak = max(rates.values())
    bound_tok_s = streams * new_tokens / (flop / (peak * 1e9))
    medians = run["median"]
    peer = medians[args.peer]
    results = {
        "meta": {"command": " ".join(["loadtest/bench_cpu_bound.py", *sys.argv[1:]]), "threads": threads,
                 "torch": torch.__version__, "peers_run": peers["meta"]["command"]},
        "workload": args.workload,
        "tflop": flop / 1e12,
        "gflops": rates,
        "peak_gflops": peak,
        "bound_tok_s": bound_tok_s,
        "measured_tok_s": medians,
        "needed_tok_s": args.target * peer,
        "bound_over_peer": bound_tok_s / peer,
        "target_within_bound": bound_tok_s >= args.target * peer,
        "share_of_bound": {engine: tok_s / bound_tok_s for engine, tok_s in medians.items()},
    }
    print_and_write(results, args.json, plot)


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    bound = {"float32 products only": results["bound_tok_s"], "target": results["needed_tok_s"]}
    bars = {**results["measured_tok_s"], **bound}
    colors = ["#4472c4" if name.startswith("drivetrain") else "#a5a5a5" for name in results["measured_tok_s"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.bar(list(bars), list(bars.values()), color=[*colors, "#70ad47", "#ed7d31"])
    ax.set_ylabel("useful tok/s")
    ax.set_title(f"{results['workload']}: measured, the products' bound, the target")
    ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
