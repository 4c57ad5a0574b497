"""The C++ decode attention kernel (kernels/cpu_paged_decode.cpp) reading its caches from memory: SmolLM2's
heads over 30 layers' paged caches in turn, as a step reads them (far more than any cache of the processor
holds), each sequence's blocks shuffled through its layer's cache. The kernel's keys and values read per
second against a plain read (a sum) of the same caches, rounds taking turns, medians, the ratio paired per
round.

    python loadtest/bench_cpu_attention_memory.py --json loadtest/results/cpu_attention_memory.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

import torch
from bench_cpu_attention import batch
from bench_report import median_seconds, paired_bars, write_and_report

from kernels import cpu_paged_decode

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = 30  # SmolLM2's
CASES = [(64, 112), (64, 400), (8, 500), (1, 4000)]  # streams, context each
TARGET = 0.6  # of a plain read's rate: what is left is the arithmetic and the blocks' scattering


def measure(streams: int, context: int, dtype: torch.dtype, rounds: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    layers = [batch([context] * streams, gen) for _ in range(LAYERS)]
    layers = [(q, k.to(dtype), v.to(dtype), slots, lens) for q, k, v, slots, lens in layers]
    read_bytes = LAYERS * streams * context * 2 * layers[0][1][0, 0].numel() * layers[0][1].element_size()

    def attend() -> None:
        for args in layers:
            cpu_paged_decode.paged_decode_attention(*args, 0.125)

    def plain_read() -> None:  # every block of every layer's caches once: the same bytes, in order
        for _, k_cache, v_cache, _, _ in layers:
            k_cache.sum()
            v_cache.sum()

    cache_bytes = sum(k.numel() * k.element_size() * 2 for _, k, _, _, _ in layers)
    kernel_gbs, plain_gbs = [], []
    for r in range(rounds):
        for name in (("kernel", "plain") if r % 2 == 0 else ("plain", "kernel")):
            if name == "kernel":
                kernel_gbs.append(read_bytes / median_seconds(attend, repeats) / 1e9)
            else:
                plain_gbs.append(cache_bytes / median_seconds(plain_read, repeats) / 1e9)
    ratios = [k / p for k, p in zip(kernel_gbs, plain_gbs)]
    return {"streams": streams, "context": context, "cache_dtype": str(dtype).removeprefix("torch."),
            "kernel_ms": 1000 * read_bytes / 1e9 / statistics.median(kernel_gbs),
            "kernel_gb_s": statistics.median(kernel_gbs), "plain_read_gb_s": statistics.median(plain_gbs),
            "kernel_over_plain": statistics.median(ratios), "ratios": ratios}


def plot(results: dict, path: Path) -> Path | None:
    cases = results["cases"]
    return paired_bars(path, [f"{c['streams']} x {c['context']}\n{c['cache_dtype']}" for c in cases],
                       {"plain read of the caches": [c["plain_read_gb_s"] for c in cases],
                        "decode attention kernel": [c["kernel_gb_s"] for c in cases]},
                       "GB/s of keys and values",
                       f"decode attention from memory, {LAYERS} layers in turn ({results['meta']['threads']} threads)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5, help="calls over every layer timed per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "cpu_attention_memory.json")
    args = parser.parse_args()
    if not cpu_paged_decode.available():
        parser.error("the decode attention kernel does not build here")
    torch.set_num_threads(args.threads)
    cases = [measure(streams, context, dtype, args.rounds, args.repeats)
             for dtype in (torch.float32, torch.float16) for streams, context in CASES]
    for case in cases:
        print(f"{case['streams']} x {case['context']} {case['cache_dtype']}: {case['kernel_ms']:.2f} ms, "
              f"{case['kernel_gb_s']:.1f} GB/s against a plain read's {case['plain_read_gb_s']:.1f} "
              f"({case['kernel_over_plain']:.2f})")
    worst = min(case["kernel_over_plain"] for case in cases)
    results = {
        "meta": {"threads": args.threads, "rounds": args.rounds, "repeats": args.repeats, "layers": LAYERS,
                 "cpu": platform.processor(), "capability": torch.backends.cpu.get_cpu_capability(),
                 "torch": torch.__version__},
        "cases": cases,
        "targets": {"memory.worst_kernel_over_plain_read": {"value": worst, "target": f">= {TARGET}",
                                                            "met": worst >= TARGET}},
    }
    write_and_report(results, args.json, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
