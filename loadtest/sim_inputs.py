"""The simulator's calibration: each profile's step model, every number with where it came from.

`cpu-smollm2` reads the measured results committed under loadtest/results (SmolLM2-135M,
float32, 2 shared cores); `h200-llama8b` derives GPU-scale costs from stated facts. Every
input lands in the results JSON with its source, so a reader can check or replace it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from sim_model import StepModel

from shared.models.shapes import SHAPES

RESULTS = Path(__file__).resolve().parent / "results"
ENGINE_SETTINGS = "services/worker/engine/settings.py"
PEER = "drivetrain:float32"  # the engine's own row in peers_cpu.json


@dataclass
class Profile:
    name: str
    model: StepModel | None = None  # None: the inputs could not give a model (see problems)
    inputs: dict[str, dict] = field(default_factory=dict)  # name -> {value, unit, source}
    problems: list[str] = field(default_factory=list)  # why its numbers may not make sense

    def note(self, name: str, value: float, unit: str, source: str) -> float:
        self.inputs[name] = {"value": value, "unit": unit, "source": source}
        return value


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return layers * kv_heads * head_dim * 2 * dtype_bytes  # 2: K and V


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares t = a + c*b over (b, t) points: (a, c, r squared)."""
    b, t = np.array(points, dtype=float).T
    c, a = np.polyfit(b, t, 1)
    residual = t - (a + c * b)
    r2 = 1.0 - float(residual @ residual) / float(((t - t.mean()) ** 2).sum()) if len(t) > 2 else 1.0
    return float(a), float(c), r2


def cpu_profile(results: Path = RESULTS) -> Profile:
    """SmolLM2-135M on this machine's CPU, from peers_cpu.json (the engine's float32 row)."""
    peers = json.loads((results / "peers_cpu.json").read_text())
    engine = json.loads((results / "engine_cpu.json").read_text())
    work = peers["workloads"]
    src = f"loadtest/results/peers_cpu.json ({PEER}, medians of {peers['meta']['rounds']} rounds, "
    src += f"load average {peers['meta']['load_average_start']:.1f}-{peers['meta']['load_average_end']:.1f} on 2 shared cores)"
    profile = Profile("cpu-smollm2")
    step_1 = 1.0 / work["decode_1"]["median"][PEER]
    # Prefill per token: the TTFT slope between the short chat prompt and the 2,000-token one.
    short, long = work["ttft_1"], work["ttft_2k"]
    short_tokens = (short["prompt_tokens_min"] + short["prompt_tokens_max"]) / 2
    p = (long["median"][PEER] - short["median"][PEER]) / (long["long_prompt_tokens"] - short_tokens)
    profile.note("prefill_token_s", p, "s/token", src + ": (ttft_2k - ttft_1) / (2000 - 38 tokens)")
    # Decode at batch 16 and 64: the run's seconds less its prefill, over its decode steps.
    points = [(1.0, step_1)]
    for name in ("concurrent_16", "concurrent_64"):
        w = work[name]
        seconds = w["streams"] * w["new_tokens"] / w["median"][PEER]
        prompt = w["streams"] * (w["prompt_tokens_min"] + w["prompt_tokens_max"]) / 2
        points.append((float(w["streams"]), (seconds - step_1 - p * prompt) / (w["new_tokens"] - 1)))
    a, c, r2 = fit_line(points)
    profile.inputs["decode_points"] = {
        "value": [[b, t] for b, t in points], "unit": "[batch, s/step]",
        "source": src + ": decode_1 as 1/decode_tok_s; concurrent_N as (N*new_tokens/useful_tok_s - t(1)"
        " - prefill_token_s*prompt tokens) / (new_tokens - 1)",
    }
    profile.note("decode_fixed_s", a, "s/step", f"least-squares line through decode_points (r2 {r2:.3f})")
    profile.note("decode_per_seq_s", c, "s/seq/step", "slope of the same line")
    kv = kv_bytes_per_token(30, 3, 64, 4)
    profile.note("kv_bytes_per_token", kv, "B", "SmolLM2-135M config: 30 layers x 3 KV heads x 64 x 2 (K,V) x 4 B"
                 " (float32 KV, as drivetrain:float32 keeps it)")
    copy_bw = profile.note("memory_bytes_s", 100e9, "B/s", "FIELD-NOTES.md: ~100 GB/s for a copy on this AMD EPYC")
    profile.note("kv_read_token_s", kv / copy_bw, "s/token/step", "kv_bytes_per_token / memory_bytes_s")
    link = profile.note("link_bytes_s", 1.25e9, "B/s", "ASSUMED: 10 Gbit/s Ethernet between CPU hosts")
    budget = int(profile.note("token_budget", engine["long_prompt"]["chunk_budget_tokens"], "tokens",
                              f"loadtest/results/engine_cpu.json long_prompt.chunk_budget_tokens (CPU_MAX_BATCH_TOKENS, {ENGINE_SETTINGS})"))
    seqs = int(profile.note("max_num_seqs", 64, "seqs", "ASSUMED: the largest batch measured (concurrent_64)"))
    capacity = int(profile.note("kv_capacity_tokens", 16 * 2**30 // kv, "tokens", "ASSUMED: 16 GiB of host memory for KV per worker"))
    profile.inputs["engine_cpu_timings"] = {
        "value": None, "unit": "",
        "source": "loadtest/results/engine_cpu.json times the `tiny` shape, not SmolLM2: its step times are not used",
    }
    if a <= 0 or c <= 0 or p <= 0:
        profile.problems.append(f"fitted costs not positive: a={a:.4g} c={c:.4g} p={p:.4g}")
    if r2 < 0.8:
        profile.problems.append(f"decode line fits poorly (r2 {r2:.2f})")
    if not all(t1 / b1 > t2 / b2 for (b1, t1), (b2, t2) in zip(points, points[1:])):
        profile.problems.append("per-sequence decode cost does not fall with batch size: batching would not help")
    if a > 0 and p > 0:
        profile.model = StepModel(a, max(c, 0.0), p, kv / copy_bw, kv, link, budget, seqs, capacity)
    return profile


def h200_profile() -> Profile:
    """Llama-3.1-8B shape in bf16 on one H200: costs derived from stated facts, not measured here."""
    profile = Profile("h200-llama8b")
    shape = SHAPES["llama-8b"]
    params = shape.num_params()
    hbm = profile.note("hbm_bytes_s", 4.28e12, "B/s", "FIELD-NOTES.md: H200 copy bandwidth measured 4.28 TB/s")
    weights = profile.note("weight_bytes", 2 * params, "B", f"llama-8b shape ({params / 1e9:.2f} B params, shared/models/shapes.py) x 2 B bf16")
    a = profile.note("decode_fixed_s", weights / hbm, "s/step", "ASSUMED weight-read bound: weight_bytes / hbm_bytes_s (~3.75 ms)")
    flops = profile.note("effective_flop_s", 600e12, "FLOP/s", "ASSUMED: ~600 TFLOP/s effective bf16 on the H200")
    p = profile.note("prefill_token_s", 2 * params / flops, "s/token", "ASSUMED compute bound: 2 x params FLOP per token / effective_flop_s (~0.027 ms)")
    c = profile.note("decode_per_seq_s", 2 * params / flops, "s/seq/step", "ASSUMED: a decoding sequence costs one token's compute, as a prompt token does")
    kv = profile.note("kv_bytes_per_token", kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, 2), "B",
                      "32 layers x 8 KV heads x 128 x 2 (K,V) x 2 B bf16 = 128 KiB")
    profile.note("kv_read_token_s", kv / hbm, "s/token/step", "ASSUMED: decodes read their KV at hbm_bytes_s")
    link = profile.note("link_bytes_s", 50e9, "B/s", "ASSUMED: 50 GB/s between prefill and decode GPUs")
    budget = int(profile.note("token_budget", 8192, "tokens", f"GPU_MAX_BATCH_TOKENS in {ENGINE_SETTINGS}"))
    seqs = int(profile.note("max_num_seqs", 256, "seqs", f"EngineSettings.max_num_seqs default in {ENGINE_SETTINGS}"))
    hbm_bytes = profile.note("hbm_capacity_bytes", 141e9, "B", "ASSUMED: the H200's rated 141 GB")
    capacity = int(profile.note("kv_capacity_tokens", int((0.9 * hbm_bytes - weights) // kv), "tokens",
                                f"(kv_memory_fraction 0.9 x hbm_capacity_bytes - weight_bytes) / kv_bytes_per_token ({ENGINE_SETTINGS})"))
    profile.model = StepModel(a, c, p, kv / hbm, int(kv), link, budget, seqs, capacity)
    return profile


PROFILES = {"cpu-smollm2": cpu_profile, "h200-llama8b": h200_profile}


def load_profile(name: str, link_gb_s: float | None = None, token_budget: int | None = None) -> Profile:
    """The named profile, with the command line's overrides noted as their own source."""
    profile = PROFILES[name]()
    if profile.model is None:
        return profile
    if link_gb_s is not None:
        profile.note("link_bytes_s", link_gb_s * 1e9, "B/s", "--link-gbps on the command line (GB/s)")
        profile.model = replace(profile.model, link_bytes_s=link_gb_s * 1e9)
    if token_budget is not None:
        profile.note("token_budget", token_budget, "tokens", "--token-budget on the command line")
        profile.model = replace(profile.model, token_budget=token_budget)
    return profile
