"""SmolLM2 on the CPU with its float32 projections as PyTorch's linear computes them (MKL) and as
services/worker/engine/cpu_linear.py does (oneDNN, packed weights), side by side in one process,
rounds interleaved: decode steps at several batch sizes, and one prompt's prefill in 512-token
chunks. The greedy text must be the same both ways.

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

from services.worker.engine.engine import Engine
from services.worker.engine.llm_engine import LLMEngine, build_llm_engine
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import EngineRequest, Message
from services.worker.engine.weights import load_model
from shared.models.spec import ModelSpec, resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
MEASURED_STEPS = 12
WAYS = ("linear", "cpu_linear")


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


def prefill_seconds(llm: LLMEngine, words: int, tag: str) -> tuple[float, str]:
    """Seconds from a long prompt's arrival to its first token (its chunks' steps), and that token."""
    notes = " ".join(f"note{i % 97} on the river" for i in range(words // 4))
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.add_request(EngineRequest(tag, "t", [Message("user", f"Summarise: {notes}")], sampling))
    start = time.perf_counter()
    text = []
    while llm.has_unfinished_requests():
        text += [o.text for o in llm.step()]
    return time.perf_counter() - start, "".join(text)


def plain_linear_engine(spec: ModelSpec, settings: EngineSettings) -> LLMEngine:
    """The same model as loaded, its projections left as torch's Linear (requests ignore EOS)."""
    model, tokenizer = load_model(spec, torch.device("cpu"), torch.float32)
    return LLMEngine(Engine(model, settings, spec.max_model_len), tokenizer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--prefill-words", type=int, default=1600,
                        help="the long prompt's words (1,600: 2,384 SmolLM2 tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "cpu_linear.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = resolve_model("smollm2", max_model_len=4096)
    settings = EngineSettings(num_kv_blocks=1200, enable_prefix_caching=False)
    packed = build_llm_engine(spec, settings, "cpu")  # float32: projections are CpuLinear
    engines = {"linear": plain_linear_engine(spec, settings), "cpu_linear": packed}
    results: dict = {"command": " ".join(sys.argv), "threads": args.threads, "rounds": args.rounds, "rows": {}}
    cases = [("decode", batch) for batch in map(int, args.batches.split(","))] + [("prefill", args.prefill_words)]
    for kind, size in cases:
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        texts: dict[str, object] = {}
        for round_ in range(args.rounds):
            for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
                tag = f"{way}{round_}{kind}{size}_"
                if kind == "decode":
                    seconds, texts[way] = decode_steps(engines[way], size, tag)
                else:
                    seconds, texts[way] = prefill_seconds(engines[way], size, tag)
                times[way].append(seconds)
        linear, ours = statistics.median(times["linear"]), statistics.median(times["cpu_linear"])
        same = texts["linear"] == texts["cpu_linear"]
        key = f"decode_{size}" if kind == "decode" else "prefill"
        row = {"ms_linear": linear * 1e3, "ms_cpu_linear": ours * 1e3, "linear_over_cpu_linear": linear / ours,
               "same_text": same, "rounds_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}}  # fmt: skip
        results["rows"][key] = row
        print(f"{key}: linear {linear * 1e3:.1f} ms, cpu_linear {ours * 1e3:.1f} ms, {linear / ours:.2f}x, "
              f"same text {same}", flush=True)  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
