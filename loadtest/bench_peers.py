"""Drivetrain's engine side by side with the engines a user would pick instead, on the CPU and on the
same SmolLM2-135M-Instruct weights, greedy, the same thread count each: Hugging Face `generate`
(padded static batch) and continuous batching, and llama.cpp on the shipped Q4_1 GGUF and on it
dequantized to float32.

    python loadtest/bench_peers.py --quick --rounds 1
    python loadtest/bench_peers.py --rounds 3
    python loadtest/bench_peers.py --drivetrain float32,bfloat16,int8,int4 --engines drivetrain,hf_generate

llama.cpp runs in its own process under --llama-python (`make peers` builds .venv-peers). Each
workload runs in interleaved rounds (round r runs every engine once, in a rotating order); the
JSON holds every round, the medians, and Drivetrain-over-peer ratios paired within a round.
Engines: peers_drivetrain.py, peers_hf.py, peers_llama.py; workloads: peers_workloads.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
from bench_report import write_and_report
from peers_agreement import agreement
from peers_drivetrain import DrivetrainPeer, kv_blocks_for, parse_variants
from peers_gguf import f32_gguf, shipped_gguf
from peers_hf import HFContinuous, HFGenerate
from peers_llama import CONCURRENCY_NOTE, LlamaPeer, llama_python_problem
from peers_plot import plot_results
from peers_stats import round_order, summarise
from peers_workloads import (
    Peer,
    Workload,
    chat_prompts,
    describe,
    metric,
    prompts_for,
    workloads,
)

from shared.models.smollm2 import smollm2_folder
from shared.models.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
PEERS = ("hf_generate", "hf_continuous", "llama_q4_1", "llama_f32")
# Eager float32 as the baseline, then each weight format through compiled decode graphs.
DEFAULT_VARIANTS = "float32,float32+compile,int8+compile,int4+compile,w8a8+compile"
FLOAT32 = ("float32", "float32+compile")  # the float32 weights, stepped eagerly or through compiled graphs
# key: (workload, ours: the Drivetrain variants it is met by the best of (None: any), peer, op, bound),
# from the design brief
TARGETS = {
    "decode_1.float32_over_llama_f32": ("decode_1", FLOAT32, "llama_f32", ">=", 1.0),
    "decode_1.best_over_llama_q4_1": ("decode_1", None, "llama_q4_1", ">=", 0.7),
    "concurrent_64.float32_over_llama_f32": ("concurrent_64", FLOAT32, "llama_f32", ">=", 1.5),
    "concurrent_64.best_over_llama_f32": ("concurrent_64", None, "llama_f32", ">=", 1.5),
    "ttft_2k.float32_over_hf_generate": ("ttft_2k", FLOAT32, "hf_generate", "<=", 1.0),
}
AGREEMENT_PROMPTS = 4


def check_targets(results: dict, variants: list[str]) -> dict:
    verdicts = {}
    for key, (workload, ours, peer, op, bound) in TARGETS.items():
        ratios = results["workloads"].get(workload, {}).get("ratio", {})
        candidates = [v for v in variants if ours is None or v in ours]
        found = {v: ratios[f"drivetrain:{v}/{peer}"] for v in candidates if f"drivetrain:{v}/{peer}" in ratios}
        if found:
            best = max(found, key=found.get) if op == ">=" else min(found, key=found.get)
            value = found[best]
            verdicts[key] = {"value": value, "variant": best, "target": f"{op} {bound:.3g}",
                             "met": value >= bound if op == ">=" else value <= bound}
    return verdicts


def build_peers(args: argparse.Namespace, streams: list[list[tuple[int, int]]], notes: list[str]) -> list[Peer]:
    """Every engine asked for that can run here; why one cannot goes into notes."""
    wanted = set(args.engines.split(","))
    max_len = max(p + n for w in streams for p, n in w) + 16
    max_seqs = max(len(w) for w in streams)
    peers: list[Peer] = []
    if "drivetrain" in wanted:
        blocks = max(kv_blocks_for(w) for w in streams)
        for variant in args.variants:  # a compiled variant's build is its compile: minutes, recorded
            started = time.perf_counter()
            peers.append(DrivetrainPeer(variant, max_len, blocks, max_seqs))
            args.build_seconds[peers[-1].name] = time.perf_counter() - started
    if "hf_generate" in wanted:
        peers.append(HFGenerate(smollm2_folder()))
    if "hf_continuous" in wanted:
        peers.append(HFContinuous(smollm2_folder(), max(HFContinuous.pages_for(w) for w in streams) + 1, max_seqs))
    llamas = [(name, gguf) for name, gguf in (("llama_q4_1", shipped_gguf), ("llama_f32", f32_gguf)) if name in wanted]
    problem = llama_python_problem(args.llama_python) if llamas else None
    if problem:
        notes.append(f"llama.cpp skipped: {problem}")
    else:
        peers += [LlamaPeer(name, args.llama_python, gguf(), args.threads) for name, gguf in llamas]
        if llamas:
            notes.append(CONCURRENCY_NOTE)
    return peers


def measure(peers: list[Peer], prompts: list[list[int]], workload: Workload, rounds: int) -> dict:
    names = [p.name for p in peers]
    by_name = {p.name: p for p in peers}
    per_round: dict[str, list[float]] = {name: [] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(names, r):
            run = by_name[name].run(prompts, workload.new_tokens)
            if any(len(tokens) != workload.new_tokens for tokens in run.tokens) or len(run.tokens) != len(prompts):
                raise RuntimeError(f"{name} did not return {len(prompts)} x {workload.new_tokens} tokens")
            per_round[name].append(metric(workload, run))
            seconds[name].append(run.seconds)
            print(f"  round {r} {name}: {per_round[name][-1]:.3f} {workload.metric} ({run.seconds:.2f} s)", flush=True)
    ours = [name for name in names if name.startswith("drivetrain:")]
    return {**describe(workload, prompts), "per_round": per_round, "seconds": seconds, **summarise(per_round, ours)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drivetrain", default=DEFAULT_VARIANTS, help="Drivetrain variants, comma-separated")
    parser.add_argument("--engines", default="drivetrain," + ",".join(PEERS), help="a subset, comma-separated")
    parser.add_argument("--workloads", default=",".join(workloads(False)), help="a subset, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="every engine's CPU threads")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (recorded in the JSON)")
    parser.add_argument("--concurrent-new-tokens", type=int, default=0,
                        help="tokens per stream in the 16- and 64-stream workloads (0: 8 quick, else 128)")
    parser.add_argument("--agreement-tokens", type=int, default=32, help="greedy tokens compared; 0 = no check")
    parser.add_argument("--llama-python", type=Path, default=REPO / ".venv-peers" / "bin" / "python")
    parser.add_argument("--json", type=Path, default=RESULTS / "peers_cpu.json")
    args = parser.parse_args(argv)
    table = workloads(args.quick, args.concurrent_new_tokens)
    unknown = set(args.engines.split(",")) - {"drivetrain", *PEERS}
    unknown_workloads = [name for name in args.workloads.split(",") if name not in table]
    if unknown or unknown_workloads:
        parser.error(f"unknown engine(s) {sorted(unknown)} or workload(s) {unknown_workloads}; "
                     f"engines: drivetrain, {', '.join(PEERS)}; workloads: {', '.join(table)}")
    try:
        args.variants = parse_variants(args.drivetrain)
    except ValueError as exc:
        parser.error(str(exc))
    chosen = [table[name] for name in args.workloads.split(",")]
    args.build_seconds = {}
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_folder(smollm2_folder())
    prompts = {w.name: prompts_for(w, tokenizer) for w in chosen}
    notes = ["every stream generates exactly new_tokens (EOS ignored); prefix caching off in every engine",
             "llama.cpp keeps its default f16 KV cache; Drivetrain and HF keep theirs in the weights' dtype",
             "one warm-up run per engine before the rounds; wall clock"]
    if args.quick:
        args.agreement_tokens = min(args.agreement_tokens, 16)
    # Every engine is sized for the largest workload, the agreement check's prompts included.
    streams = [[(len(p), w.new_tokens) for p in prompts[w.name]] for w in chosen]
    streams.append([(len(p), max(args.agreement_tokens, 4)) for p in chat_prompts(tokenizer, AGREEMENT_PROMPTS)])
    peers = build_peers(args, streams, notes)
    started, load_start = time.perf_counter(), os.getloadavg()
    try:
        for peer in peers:
            peer.run(chat_prompts(tokenizer, 1), 4)
        results: dict = {"meta": {}, "workloads": {}}
        for workload in chosen:
            print(f"{workload.name} ...", flush=True)
            results["workloads"][workload.name] = measure(peers, prompts[workload.name], workload, args.rounds)
        results["agreement"] = check_agreement(peers, tokenizer, args)
    finally:
        for peer in peers:
            if isinstance(peer, LlamaPeer):
                peer.close()
    llama_info = next((p.info for p in peers if isinstance(p, LlamaPeer)), {})
    results["meta"] = {
        "command": " ".join(sys.argv), "quick": args.quick, "rounds": args.rounds, "threads": args.threads,
        "engines": [p.name for p in peers], "torch": torch.__version__, "transformers": version("transformers"),
        "llama_cpp": llama_info.get("llama_cpp"), "llama_cpp_system": llama_info.get("system"),
        "machine": platform.machine(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
        "benchmark_seconds": time.perf_counter() - started, "build_seconds": args.build_seconds, "notes": notes,
        # A shared machine's neighbours show here: 1-minute load averages when the runs began and ended.
        "load_average_start": load_start[0], "load_average_end": os.getloadavg()[0],
    }
    results["targets"] = check_targets(results, args.variants)
    write_and_report(results, args.json, plot_results)
    return 0


def check_agreement(peers: list[Peer], tokenizer: Tokenizer, args: argparse.Namespace) -> list[dict]:
    """Drivetrain's float32 variants vs HF generate float32; bfloat16 ones vs HF in bfloat16; llama.cpp F32
    vs HF float32 (the dequantized file is the same model); Drivetrain's quantized variants vs HF
    float32, and int4 (Q4_1's layout) vs llama.cpp on the Q4_1 file."""
    by_name = {p.name: p for p in peers}
    if args.agreement_tokens <= 0 or "hf_generate" not in by_name:
        return []
    new_tokens = args.agreement_tokens
    prompts = chat_prompts(tokenizer, AGREEMENT_PROMPTS)
    checks = []
    bfloat16 = [variant for variant in args.variants if variant.startswith("bfloat16")]
    for variant in args.variants:
        if variant not in bfloat16:
            checks.append(agreement(by_name[f"drivetrain:{variant}"], by_name["hf_generate"], prompts, new_tokens))
        if variant.startswith("int4") and "llama_q4_1" in by_name:
            checks.append(agreement(by_name[f"drivetrain:{variant}"], by_name["llama_q4_1"], prompts, new_tokens))
    if bfloat16:
        hf_bf16 = HFGenerate(smollm2_folder(), torch.bfloat16)
        checks += [agreement(by_name[f"drivetrain:{variant}"], hf_bf16, prompts, new_tokens) for variant in bfloat16]
        del hf_bf16
    if "llama_f32" in by_name:
        checks.append(agreement(by_name["llama_f32"], by_name["hf_generate"], prompts, new_tokens))
    for check in checks:
        print(f"agreement {check['engine']} vs {check['reference']}: {check['matching_tokens_per_prompt']}", flush=True)
    return checks


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


if __name__ == "__main__":
    sys.exit(main())
