"""Decode steps of SmolLM2 on the CPU with the projections as PyTorch's linear computes them (x W^T)
and as services/worker/engine/cpu_linear.py does (W x^T for 2..128 rows), side by side in one
process, rounds interleaved; the greedy text must be the same both ways.

    python loadtest/bench_cpu_linear.py --json loadtest/results/cpu_linear.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from services.worker.engine import cpu_linear
from services.worker.engine.llm_engine import LLMEngine, build_llm_engine
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import EngineRequest, Message
from shared.models.spec import resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
MEASURED_STEPS = 12


def decode_steps(llm: LLMEngine, batch: int, tag: str) -> tuple[float, list[str]]:
    """Mean seconds of a step with `batch` requests decoding, and each request's text."""
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        llm.add_request(EngineRequest(f"{tag}{i}", "t", [Message("user", f"Story number {i} about the sea.")], sampling))
    texts: dict[str, list[str]] = {}
    scheduler = llm.engine.scheduler

    def step() -> None:
        for output in llm.step():
            texts.setdefault(output.request_id, []).append(output.text)

    while scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        step()  # prefill: not measured
    start = time.perf_counter()
    for _ in range(MEASURED_STEPS):
        step()
    seconds = (time.perf_counter() - start) / MEASURED_STEPS
    while llm.has_unfinished_requests():
        step()
    return seconds, ["".join(texts[f"{tag}{i}"]) for i in range(batch)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "cpu_linear.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = resolve_model("smollm2", max_model_len=1024)
    llm = build_llm_engine(spec, EngineSettings(num_kv_blocks=1200), "cpu")  # float32: projections are CpuLinear
    results: dict = {"command": " ".join(sys.argv), "threads": args.threads, "rounds": args.rounds, "batches": {}}
    for batch in map(int, args.batches.split(",")):
        times: dict[str, list[float]] = {"linear": [], "cpu_linear": []}
        texts: dict[str, list[str]] = {}
        for round_ in range(args.rounds):
            for name, max_rows in (("linear", 0), ("cpu_linear", cpu_linear.MAX_ROWS)):
                cpu_linear.MAX_ROWS = max_rows  # 0: every product goes through F.linear, as before
                seconds, texts[name] = decode_steps(llm, batch, f"{name}{round_}b{batch}_")
                times[name].append(seconds)
        linear, ours = statistics.median(times["linear"]), statistics.median(times["cpu_linear"])
        results["batches"][batch] = {
            "step_ms_linear": linear * 1e3, "step_ms_cpu_linear": ours * 1e3, "linear_over_cpu_linear": linear / ours,
            "same_text": texts["linear"] == texts["cpu_linear"], "rounds_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
        }  # fmt: skip
        print(f"batch {batch}: linear {linear * 1e3:.1f} ms, cpu_linear {ours * 1e3:.1f} ms, {linear / ours:.2f}x, "
              f"same text {texts['linear'] == texts['cpu_linear']}", flush=True)  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
