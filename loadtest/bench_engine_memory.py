"""What a worker's SmolLM2 engine holds in memory once its CPU decode graphs are ready, per weight
format, each start in a fresh process: the resident set (`VmRSS`) and its peak, the KV cache's part
of it, and the weights: every distinct tensor of the model and of its graphs' libraries counted once,
beside what the libraries alone would add with a copy each (before services/worker/engine/
shared_weights.py). The first start of a format on a machine builds its libraries; later ones load
them, which is what a worker's every start after the first does.

    .venv/bin/python loadtest/bench_engine_memory.py --variants float32+compile,int8+compile \\
        --json loadtest/results/engine_memory_zen3_avx2.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_report import print_and_write, pyplot
from peers_drivetrain import VARIANTS, DrivetrainPeer, kv_blocks_for, parse_variants

from services.worker.engine import cpu_graph_store
from services.worker.engine.cpu_graphs import tensors_of

RESULTS = Path(__file__).resolve().parent / "results"
STREAMS, PROMPT, NEW = 64, 45, 128  # the KV cache the peers' 64-stream workload sizes


def status_mb(field: str) -> float:
    """A field of /proc/self/status in MB (Linux)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a tensor's values live in: what two tensors sharing it have alike."""
    if tensor.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
    return tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()


def one_start(variant: str) -> dict:
    """Build the engine as the peers' benchmark does, then measure it (the graphs are ready by then)."""
    store = cpu_graph_store.default_store()
    stored = set(store.iterdir()) if store.is_dir() else set()
    started = time.perf_counter()
    peer = DrivetrainPeer(variant, 2048, kv_blocks_for([(PROMPT, NEW)] * STREAMS), STREAMS)
    ready_s = time.perf_counter() - started
    runner = peer.engine.runner
    graphs = runner.decode_graphs
    libraries = [library for plan in (graphs.libraries if graphs else []) for library in plan]
    model = {storage(tensor) for tensor in tensors_of(runner.model)}
    per_library = [{storage(tensor) for tensor in library.weights.values()} for library in libraries]
    held = set().union(model, *per_library)
    tokens = peer.run([list(range(10, 10 + PROMPT))], 16).tokens
    return {
        "variant": variant,
        "ready_s": ready_s,
        "graphs": "libraries" if libraries else "torch.compile" if graphs and graphs.compiled else "none",
        "libraries_built": len(set(store.iterdir()) - stored) if store.is_dir() else 0,
        "vm_rss_mb": status_mb("VmRSS"),
        "vm_hwm_mb": status_mb("VmHWM"),
        "kv_cache_mb": sum(t.nbytes for cache in runner.kv_caches for t in cache) / 2**20,
        "weights_held_mb": sum(size for _, size in held) / 2**20,
        "weights_with_a_copy_per_library_mb": (sum(size for _, size in model)
                                               + sum(size for lib in per_library for _, size in lib)) / 2**20,
        "tokens_digest": hashlib.blake2b(json.dumps(tokens).encode(), digest_size=8).hexdigest(),
    }


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    starts = results["starts"]
    labels = [f"{s['variant']}\n{'built' if s['libraries_built'] else 'loaded'}" for s in starts]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(starts)), 4))
    x = list(range(len(starts)))
    weights = [s["weights_held_mb"] / 1024 for s in starts]
    cache = [s["kv_cache_mb"] / 1024 for s in starts]
    rest = [s["vm_rss_mb"] / 1024 - w - c for s, w, c in zip(starts, weights, cache)]
    ax.bar(x, weights, label="weights held")
    ax.bar(x, cache, bottom=weights, label="KV cache")
    ax.bar(x, rest, bottom=[w + c for w, c in zip(weights, cache)], label="the rest of VmRSS")
    ax.scatter(x, [s["weights_with_a_copy_per_library_mb"] / 1024 for s in starts], marker="_", s=900, color="black",
               label="weights with a copy per library")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("GiB")
    ax.set_title("SmolLM2 engine's memory once its CPU graphs are ready")
    ax.set_ylim(0, 1.45 * max(s["vm_rss_mb"] / 1024 for s in starts))
    ax.legend(fontsize=8, ncols=2, loc="upper center")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="float32+compile,int8+compile", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--starts", type=int, default=2, help="fresh processes per variant, one after another")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "engine_memory.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(one_start(args.child)))
        return 0
    starts = []
    for variant in parse_variants(args.variants):
        for start in range(1, args.starts + 1):
            child = subprocess.run([sys.executable, __file__, "--child", variant, "--threads", str(args.threads)],
                                   capture_output=True, text=True, check=True)
            starts.append({**json.loads(child.stdout.splitlines()[-1]), "start": start})
            print(json.dumps(starts[-1]), file=sys.stderr)
    print_and_write({"torch": torch.__version__, "threads": args.threads, "starts": starts}, args.json, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
