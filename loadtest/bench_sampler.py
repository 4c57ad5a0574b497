"""The sampler on a CPU (services/worker/engine/sampler.py): one uniform number a row and the inverse-CDF
kernel, against an exponential race (the sampler before it: a softmax, then an exponential draw for
every token and the argmax of weight / draw). SmolLM2's vocabulary at 1, 16 and 64 rows, at the chat
page's temperature (0.7) alone and with top-p 0.9; then the peer benchmark's one chat and its 64 chats,
128 tokens each, through a compiled float32 engine of SmolLM2's own weights, sampled at 0.7, with either
sampler. Rounds taking turns, medians, the ratio paired per round.

    python loadtest/bench_sampler.py --json loadtest/results/sampler_cpu.json
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import kernel_bench
import torch
from bench_report import median_seconds, paired_bars, write_and_report
from peers_drivetrain import DrivetrainPeer, kv_blocks_for
from peers_workloads import prompts_for, workloads

from services.worker.engine.sampler import Sampler, argmax_rows
from services.worker.engine.sampling_params import SamplingParams
from shared.models.smollm2 import smollm2_folder
from shared.models.tokenizer import Tokenizer

VOCAB = 49152  # SmolLM2's
ROWS = [1, 16, 64]
CHAT_TEMPERATURE = 0.7  # the chat page's and the WebSocket protocol's default
ENGINE_NEW_TOKENS = 128  # the peer benchmark's
ENGINE_PROMPTS = ["decode_1", "concurrent_64"]  # its workloads: one chat, 64 at once


class ExponentialRace:
    """The baseline: argmax(p / E), E ~ Exp(1) drawn for every token of every row."""

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
        greedy = argmax_rows(logits)
        if all(p.temperature == 0.0 for p in params):
            return greedy
        temperature = torch.tensor([p.temperature or 1.0 for p in params])
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        order = None
        if any(p.top_p < 1.0 for p in params):
            probs, order = probs.sort(dim=-1, descending=True)
            top_p = torch.tensor([p.top_p for p in params])
            probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in enumerate(generators or []):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        picked = argmax_rows(probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny))
        if order is not None:
            picked = order.gather(1, picked[:, None]).squeeze(1)
        return torch.where(torch.tensor([p.temperature == 0.0 for p in params]), greedy, picked)


def paired(calls: dict[str, Callable[[], object]], rounds: int, repeats: int) -> dict:
    """Each of the two calls timed, taking turns; medians and the inverse CDF's ratio paired per round."""
    timed: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            timed[name].append(median_seconds(calls[name], repeats))
    ratios = [i / e for i, e in zip(timed["inverse_cdf"], timed["exponential_race"], strict=True)]
    return {"exponential_race_ms": 1000 * statistics.median(timed["exponential_race"]),
            "inverse_cdf_ms": 1000 * statistics.median(timed["inverse_cdf"]),
            "inverse_cdf_over_exponential_race": statistics.median(ratios), "ratios": ratios}


def sampler_cases(rounds: int, repeats: int) -> list[dict]:
    cases = []
    for top_p in (1.0, 0.9):
        for rows in ROWS:
            logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 3
            params = [SamplingParams(temperature=CHAT_TEMPERATURE, top_p=top_p)] * rows
            calls = {"exponential_race": lambda x=logits, p=params: ExponentialRace()(x, p),
                     "inverse_cdf": lambda x=logits, p=params: Sampler()(x, p)}
            cases.append({"rows": rows, "top_p": top_p, **paired(calls, rounds, repeats)})
    return cases


def engine_case(prompts: list[list[int]], rounds: int) -> dict:
    """The chats, ENGINE_NEW_TOKENS tokens each, sampled: the run's seconds, prompts included."""
    streams = [(len(prompt), ENGINE_NEW_TOKENS) for prompt in prompts]
    # Every logit in float32: the output screen would draw these rows itself (bench_cpu_screened_output.py).
    peer = DrivetrainPeer("float32+compile+full_output", max(map(len, prompts)) + ENGINE_NEW_TOKENS + 16,
                          kv_blocks_for(streams), len(prompts))
    peer.engine.runner.decode_graphs.wait()
    samplers = {"exponential_race": ExponentialRace(), "inverse_cdf": Sampler()}

    def run_with(name: str) -> Callable[[], object]:
        def run() -> None:
            peer.engine.runner.sampler = samplers[name]
            peer.run(prompts, ENGINE_NEW_TOKENS, temperature=CHAT_TEMPERATURE)
        return run

    case = paired({name: run_with(name) for name in samplers}, rounds, 1)
    tokens = len(prompts) * ENGINE_NEW_TOKENS
    return {"streams": len(prompts), "new_tokens": ENGINE_NEW_TOKENS, **case,
            "exponential_race_tok_s": tokens / case["exponential_race_ms"] * 1000,
            "inverse_cdf_tok_s": tokens / case["inverse_cdf_ms"] * 1000}


def main() -> int:
    args = kernel_bench.arguments(__doc__, "sampler_cpu.json")
    cases = sampler_cases(args.rounds, args.repeats)
    for case in cases:
        print(f"{case['rows']} rows, top-p {case['top_p']}: exponential race {case['exponential_race_ms']:.2f} ms, "
              f"inverse CDF {case['inverse_cdf_ms']:.2f} ms ({case['inverse_cdf_over_exponential_race']:.3f})")
    tokenizer = Tokenizer.from_folder(smollm2_folder())
    table = workloads(quick=False)
    engine = [engine_case(prompts_for(table[name], tokenizer), max(3, args.rounds // 2)) for name in ENGINE_PROMPTS]
    for case in engine:
        print(f"{case['streams']} sampled chat(s) through an engine: {case['exponential_race_tok_s']:.1f} -> "
              f"{case['inverse_cdf_tok_s']:.1f} tok/s ({case['inverse_cdf_over_exponential_race']:.3f} of the time)")
    worst = max(case["inverse_cdf_over_exponential_race"] for case in cases)
    results = {
        "meta": kernel_bench.meta(args),
        "sampler": cases,
        "engine": engine,
        "targets": {"inverse_cdf_over_exponential_race_worst": {"value": worst, "target": "<= 1.0", "met": worst <= 1.0}},
    }

    def plot(results: dict, path: Path) -> Path | None:
        cases = results["sampler"]
        labels = [f"{c['rows']} row(s)" + ("" if c["top_p"] == 1.0 else ",\ntop-p 0.9") for c in cases]
        return paired_bars(path, labels, {"exponential race": [c["exponential_race_ms"] for c in cases],
                                          "inverse CDF": [c["inverse_cdf_ms"] for c in cases]},
                           "ms per call", f"Sampling SmolLM2's vocabulary at {CHAT_TEMPERATURE} "
                                          f"({results['meta']['threads']} threads)")

    write_and_report(results, args.json, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
