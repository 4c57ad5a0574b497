"""The C++ decode attention kernel (kernels/cpu_paged_decode.cpp) at SmolLM2's heads over one layer's
paged cache, a batch of skewed contexts against a batch of even ones holding the same positions in all:
one long context among short ones, or alone, should cost what its positions cost, not leave one thread
waiting out the other. Rounds interleaved, medians, the ratio paired per round.

    python loadtest/bench_cpu_attention.py --json loadtest/results/cpu_attention_skew.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from bench_report import paired_bars, write_and_report
from engine_kernels import BLOCK_SIZE, Heads, random_caches, shuffled_tables

from kernels import cpu_paged_decode

RESULTS = Path(__file__).resolve().parent / "results"
HEADS = Heads(num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32, device=torch.device("cpu"))  # SmolLM2
TARGET = 1.15  # skewed over even, the same positions: a thread waits out the other little


def batch(context_lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q, caches and read slots for these contexts, each sequence's blocks shuffled through the cache."""
    lens = torch.tensor(context_lens)
    num_blocks = int(((lens + BLOCK_SIZE - 1) // BLOCK_SIZE).sum()) + 1
    k_cache, v_cache = random_caches(HEADS, num_blocks, gen)
    tables = shuffled_tables(lens, num_blocks, gen).long()
    read_slots = (tables[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten(1).contiguous()
    q = torch.randn(len(context_lens), HEADS.num_q_heads, HEADS.head_dim, generator=gen)
    return q, k_cache, v_cache, read_slots, lens


def median_ms(args: tuple[torch.Tensor, ...], calls: int) -> float:
    cpu_paged_decode.paged_decode_attention(*args, 0.125)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        cpu_paged_decode.paged_decode_attention(*args, 0.125)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(skewed_lens: list[int], even_streams: int, rounds: int, calls: int) -> dict:
    """A batch of these contexts against `even_streams` contexts of as many positions in all."""
    gen = torch.Generator().manual_seed(0)
    even_lens = [round(sum(skewed_lens) / even_streams)] * even_streams
    skewed, even = batch(skewed_lens, gen), batch(even_lens, gen)
    per_round: dict[str, list[float]] = {"skewed_ms": [], "even_ms": []}
    for r in range(rounds):
        for name, args in ((("skewed_ms", skewed), ("even_ms", even)) if r % 2 == 0 else
                           (("even_ms", even), ("skewed_ms", skewed))):
            per_round[name].append(median_ms(args, calls))
    ratios = [s / e for s, e in zip(per_round["skewed_ms"], per_round["even_ms"])]
    shorts = skewed_lens[1:]
    described = f"1 x {skewed_lens[0]}" + (f", {len(shorts)} x {shorts[0]}" if shorts else " alone")
    return {"streams": len(skewed_lens), "skewed_contexts": described, "even_streams": even_streams,
            "even_context": even_lens[0], "positions": sum(skewed_lens), "per_round": per_round,
            "skewed_ms": statistics.median(per_round["skewed_ms"]), "even_ms": statistics.median(per_round["even_ms"]),
            "skewed_over_even": statistics.median(ratios), "ratios": ratios}


def plot(results: dict, path: Path) -> Path | None:
    cases = results["cases"]
    return paired_bars(path, [c["skewed_contexts"].replace(", ", "\n") for c in cases],
                       {"even contexts": [c["even_ms"] for c in cases],
                        "one long context among short": [c["skewed_ms"] for c in cases]},
                       "ms a call (median)",
                       f"decode attention, the same positions skewed or even ({results['meta']['threads']} threads)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=40, help="calls timed per round and batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "cpu_attention_skew.json")
    args = parser.parse_args()
    if not cpu_paged_decode.available():
        parser.error("the decode attention kernel does not build here")
    torch.set_num_threads(args.threads)
    cases = [measure([2000] + [100] * 63, 64, args.rounds, args.calls),
             measure([600] + [40] * 63, 64, args.rounds, args.calls),
             measure([2000] + [100] * 7, 8, args.rounds, args.calls),
             measure([4000], 16, args.rounds, args.calls)]
    for case in cases:
        print(f"{case['skewed_contexts']}: {case['skewed_ms']:.3f} ms against {case['even_ms']:.3f} for "
              f"{case['even_streams']} x {case['even_context']} ({case['skewed_over_even']:.2f}x)")
    worst = max(case["skewed_over_even"] for case in cases)
    results = {
        "meta": {"threads": args.threads, "rounds": args.rounds, "calls": args.calls, "cpu": platform.processor(),
                 "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
                 "heads": {"q": HEADS.num_q_heads, "kv": HEADS.num_kv_heads, "head_dim": HEADS.head_dim}},
        "cases": cases,
        "targets": {"skew.worst_skewed_over_even": {"value": worst, "target": f"<= {TARGET}", "met": worst <= TARGET}},
    }
    write_and_report(results, args.json, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
