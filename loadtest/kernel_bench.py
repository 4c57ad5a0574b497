"""What the C++ CPU kernels' benchmarks share (bench_cpu_elementwise.py, bench_cpu_prefill_attention.py):
each case timed with a kernel module's C++ kernels and with the PyTorch operations they replace, rounds
taking turns; the peer benchmark's prompts through an eager engine of SmolLM2's own weights; and the
results' frame, printed, plotted and written."""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import unittest.mock
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from bench_report import median_seconds, paired_bars, write_and_report
from peers_drivetrain import DrivetrainPeer, kv_blocks_for
from peers_workloads import prompts_for, workloads

from shared.models.smollm2 import smollm2_folder
from shared.models.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["concurrent_64", "ttft_2k"]  # the peer benchmark's 64 chats, and its long prompt


def arguments(doc: str, json_name: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5, help="calls timed per round (the median kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / json_name)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def paired_kernels(call: Callable[[], object], kernels: ModuleType, rounds: int, repeats: int) -> dict:
    """`call` with the C++ kernels of the module `kernels` and with the references they replace (its
    `serves` saying no), taking turns; medians and the ratio paired per round."""
    timed: dict[str, list[float]] = {"kernels": [], "references": []}
    for r in range(rounds):
        for name in (("kernels", "references") if r % 2 == 0 else ("references", "kernels")):
            if name == "kernels":
                timed[name].append(median_seconds(call, repeats))
            else:
                # A plain function: a mock would keep every call's tensors, and the references' time
                # would be the allocator's, mapping fresh memory for each (it doubled it).
                with unittest.mock.patch.object(kernels, "serves", new=lambda *tensors: False):
                    timed[name].append(median_seconds(call, repeats))
    ratios = [k / r for k, r in zip(timed["kernels"], timed["references"], strict=True)]
    return {"kernels_ms": 1000 * statistics.median(timed["kernels"]),
            "references_ms": 1000 * statistics.median(timed["references"]),
            "kernels_over_references": statistics.median(ratios), "ratios": ratios}


def peer_prompts() -> dict[str, list[list[int]]]:
    """The peer benchmark's prompts, by workload: the 64 chats', and the 2,000-token one."""
    tokenizer = Tokenizer.from_folder(smollm2_folder())
    return {name: prompts_for(workloads(quick=False)[name], tokenizer) for name in PROMPTS}


def through_an_engine(kernels: ModuleType, rounds: int) -> list[dict]:
    """Each workload's prompts through an eager float32 engine of SmolLM2's own weights, one token out
    of each: every step it takes on them (chunks of its CPU step budget, 512 tokens), first to last."""
    cases = []
    for prompts in peer_prompts().values():
        streams = [(len(prompt), 1) for prompt in prompts]
        peer = DrivetrainPeer("float32", max(map(len, prompts)) + 16, kv_blocks_for(streams), len(prompts))
        cases.append({"prompts": len(prompts), "tokens": sum(map(len, prompts)),
                      **paired_kernels(functools.partial(peer.run, prompts, 1), kernels, rounds, 1)})
    return cases


def meta(args: argparse.Namespace) -> dict:
    """What a result was measured on and with: the arguments `arguments` parsed, the CPU, PyTorch."""
    return {"threads": args.threads, "rounds": args.rounds, "repeats": args.repeats, "cpu": platform.processor(),
            "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def report(args: argparse.Namespace, layer: list[dict], layer_labels: list[str], prompt: list[dict], target: str,
           legend: tuple[str, str], title: str) -> None:
    """Print the engine cases, then write the results (the layer cases, labelled, and the engine's) with
    their plot; the target: no case slower with the kernels, or they are not worth their code."""
    for case in prompt:
        print(f"{case['prompts']} prompt(s), {case['tokens']} tokens in all, through an engine: "
              f"{case['references_ms']:.0f} -> {case['kernels_ms']:.0f} ms ({case['kernels_over_references']:.2f})")
    worst = max(case["kernels_over_references"] for case in layer + prompt)
    results = {
        "meta": meta(args),
        "layer": layer,
        "prompt": prompt,
        "targets": {target: {"value": worst, "target": "<= 1.0", "met": worst <= 1.0}},
    }

    def plot(results: dict, path: Path) -> Path | None:
        cases = results["layer"] + results["prompt"]
        labels = layer_labels + [f"{c['prompts']} prompt(s),\nan engine" for c in results["prompt"]]
        return paired_bars(path, labels, {legend[0]: [1.0] * len(cases),
                                          legend[1]: [c["kernels_over_references"] for c in cases]},
                           f"time, of {legend[0]}'s", f"{title} ({results['meta']['threads']} threads)")

    write_and_report(results, args.json, plot)
