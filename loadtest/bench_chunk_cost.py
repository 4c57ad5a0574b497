"""A long prompt arriving among decoding chats, SmolLM2-135M's own weights on the CPU with the engine's
default settings: its chunks counted by their work, attention over the prompt before them included
(the default, services/worker/engine/chunk_cost.py), against their tokens alone. Each step's time from
the prompt's arrival to its first token, the chats' gaps between tokens in that window (p50, p99), and
the prompt's time to its first token. Rounds taking turns, medians, ratios paired per round.

    python loadtest/bench_chunk_cost.py --json loadtest/results/chunk_cost_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_report import pyplot, write_and_report
from engine_scenarios import decode_gaps_during_prefill, with_engine
from peers_workloads import chat_prompts, long_prompt

from services.worker.engine.chunk_cost import attention_parity
from services.worker.engine.engine import Engine
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.llm_engine import load_engine_model
from services.worker.engine.settings import EngineSettings
from shared.models.spec import SMOLLM2, resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
WAYS = {"by_work": True, "by_tokens": False}  # count_chunk_attention
TARGET = 1.25  # the slowest step in the window over the first, counted by work


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--streams", type=int, default=16, help="chats decoding when the prompt arrives")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "chunk_cost_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    max_model_len = args.prompt_tokens + 64
    spec = resolve_model(SMOLLM2, max_model_len)
    model, tokenizer = load_engine_model(spec, EngineSettings(), torch.device("cpu"))
    long = long_prompt(tokenizer, args.prompt_tokens)
    chats = chat_prompts(tokenizer, args.streams)
    blocks = sum(cdiv(len(p) + 512, 16) for p in chats) + cdiv(max_model_len, 16) + 1

    def gaps(engine: Engine) -> dict:
        return decode_gaps_during_prefill(engine, chats, long, time.perf_counter)

    per_round: dict[str, list[dict]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in (list(WAYS) if r % 2 == 0 else list(reversed(WAYS))):
            settings = EngineSettings(count_chunk_attention=WAYS[way], enable_prefix_caching=False, num_kv_blocks=blocks)
            per_round[way].append(with_engine(model, settings, gaps, max_model_len=max_model_len))
            last = per_round[way][-1]
            print(f"round {r} {way}: {len(last['steps_ms'])} steps, ITL p99 {last['itl_p99_ms']:.0f} ms, "
                  f"first token {last['prefill_window_s']:.2f} s", flush=True)

    def median(way: str, key: str) -> float:
        return statistics.median(run[key] for run in per_round[way])

    def slowest_over_first(run: dict) -> float:
        return max(run["steps_ms"][:-1]) / run["steps_ms"][0]  # the last step holds the prompt's tail only

    ways = {way: {"itl_p50_ms": median(way, "itl_p50_ms"), "itl_p99_ms": median(way, "itl_p99_ms"),
                  "first_token_s": median(way, "prefill_window_s"),
                  "steps": statistics.median(len(run["steps_ms"]) for run in per_round[way]),
                  "slowest_step_over_first": statistics.median(slowest_over_first(run) for run in per_round[way])}
            for way in WAYS}

    def paired(key: str) -> float:
        return statistics.median(w[key] / t[key] for w, t in zip(per_round["by_work"], per_round["by_tokens"], strict=True))

    spread = ways["by_work"]["slowest_step_over_first"]
    results = {
        "meta": {"command": " ".join(["python", *sys.argv]), "threads": args.threads, "torch": torch.__version__, "model": spec.name,
                 "attention_parity": attention_parity(model.config), "budget_tokens": 512},
        "prompt_tokens": len(long), "streams": args.streams, "ways": ways, "per_round": per_round,
        "itl_p99_by_work_over_by_tokens": paired("itl_p99_ms"),
        "first_token_by_work_over_by_tokens": paired("prefill_window_s"),
        "targets": {"by_work.slowest_step_over_first": {"value": spread, "target": f"<= {TARGET}", "met": spread <= TARGET}},
    }
    write_and_report(results, args.json, plot)
    return 0


def plot(results: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for way, runs in results["per_round"].items():
        steps = runs[0]["steps_ms"]
        ax.plot(range(1, len(steps) + 1), [s / 1000 for s in steps], marker="o", label=f"chunks counted {way.replace('_', ' ')}")
    ax.set_xlabel("step after the prompt's arrival")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"{results['prompt_tokens']}-token prompt among {results['streams']} decoding chats (round 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
