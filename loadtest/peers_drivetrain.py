"""Drivetrain's engine as a peer: the model loaded as `drivetrain generate` loads it, one Engine
per variant, stepped in this process. A variant is a name for engine settings (dtype, quantization)."""

from __future__ import annotations

import dataclasses
import time

import torch
from peers_workloads import Run

from services.worker.engine.engine import Engine
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.llm_engine import load_engine_model
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from shared.models.spec import SMOLLM2, resolve_model

# A new weight format joins the benchmark as one entry here: its name -> the engine settings it sets.
VARIANTS: dict[str, dict] = {
    "float32": dict(dtype="float32"),
    "float32+compile": dict(dtype="float32", cpu_compile="on"),
    # The compiled graphs' decode attention as tensor operations, not the C++ kernel: the kernel's baseline.
    "float32+compile+tensor_attention": dict(dtype="float32", cpu_compile="on", cpu_attention_kernel=False),
    # Every logit of a greedy row in float32, not the bfloat16 screen and its rescoring: the screen's baseline.
    "float32+compile+full_output": dict(dtype="float32", cpu_compile="on", cpu_output_screen=False),
    # The projections through oneDNN's packs, not the panel kernel: the kernel's baseline.
    "float32+compile+onednn": dict(dtype="float32", cpu_compile="on", cpu_panel_products=False),
    # Float32 weights over a float16 KV cache: llama.cpp's own default pairing (f32 weights, f16 cache).
    "float32+compile+f16_kv": dict(dtype="float32", cpu_compile="on", kv_cache_dtype="float16"),
    "float32+compile+bf16_kv": dict(dtype="float32", cpu_compile="on", kv_cache_dtype="bfloat16"),
    "bfloat16": dict(dtype="bfloat16"),
    "bfloat16+compile": dict(dtype="bfloat16", cpu_compile="on"),
    # Bfloat16 projections through oneDNN's products (frozen into the graphs), not the panel kernel.
    "bfloat16+compile+onednn": dict(dtype="bfloat16", cpu_compile="on", cpu_panel_products=False),
    "int8": dict(dtype="float32", quantization="int8"),
    "int8+compile": dict(dtype="float32", quantization="int8", cpu_compile="on"),
    "int4": dict(dtype="float32", quantization="int4"),
    "int4+compile": dict(dtype="float32", quantization="int4", cpu_compile="on"),
    "w8a8": dict(dtype="float32", quantization="w8a8"),
    "w8a8+compile": dict(dtype="float32", quantization="w8a8", cpu_compile="on"),
}
BLOCK_SIZE = 16


def parse_variants(text: str) -> list[str]:
    """'float32,bfloat16' -> the names, each one known; ValueError naming the known ones otherwise."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"unknown Drivetrain variant(s) {unknown or text!r}; known: {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def kv_blocks_for(streams: list[tuple[int, int]]) -> int:
    """KV blocks that hold one workload's streams, (prompt tokens, new tokens) each, all at once."""
    return sum(cdiv(prompt + new, BLOCK_SIZE) for prompt, new in streams) + 1  # + the null block


class DrivetrainPeer:
    """Prefix caching off: every round must compute its prompts, as the peers do."""

    def __init__(self, variant: str, max_model_len: int, num_kv_blocks: int, max_num_seqs: int,
                 variant_settings: dict | None = None) -> None:
        """variant_settings: the engine settings the variant's name stands for; None: VARIANTS' entry."""
        self.name = f"drivetrain:{variant}"
        spec = resolve_model(SMOLLM2, max_model_len)
        settings = EngineSettings(
            max_num_seqs=max(max_num_seqs, 8), block_size=BLOCK_SIZE, enable_prefix_caching=False,
            num_kv_blocks=max(num_kv_blocks, cdiv(max_model_len, BLOCK_SIZE) + 1),
            **(VARIANTS[variant] if variant_settings is None else variant_settings),
        )
        model, self.tokenizer = load_engine_model(spec, settings, torch.device("cpu"))
        quantized = "" if settings.quantization == "none" else f"+{settings.quantization}"
        self.dtype = str(next(model.parameters()).dtype) + quantized
        # eos_token_ids=(): fixed output lengths, as every peer is asked for.
        self.engine = Engine(model, settings, spec.max_model_len, eos_token_ids=())
        self.settings = settings
        self._count = 0

    def run(self, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0,
            sampling: list[SamplingParams] | None = None) -> Run:
        """temperature: 0, greedy, as every peer is asked for; above it, sampled (bench_sampler.py).
        sampling: each prompt's own settings instead (their max_tokens set to new_tokens)."""
        if sampling is None:
            sampling = [SamplingParams(max_tokens=new_tokens, temperature=temperature)] * len(prompts)
        requests = []
        for prompt, params in zip(prompts, sampling, strict=True):
            self._count += 1
            requests.append(Request(f"r{self._count}", prompt, dataclasses.replace(params, max_tokens=new_tokens)))
        first_token_s = None
        start = time.perf_counter()
        for request in requests:
            self.engine.add_request(request)
        while self.engine.has_unfinished_requests():
            updates = self.engine.step()
            if first_token_s is None and any(u.new_token_ids for u in updates):
                first_token_s = time.perf_counter() - start
        seconds = time.perf_counter() - start
        return Run(seconds, first_token_s or seconds, [r.output_token_ids for r in requests])

