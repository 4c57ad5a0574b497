"""The GPU decode scenario: single-stream decode against the HBM bandwidth bound, and what CUDA
graphs buy at 1, 64 and 256 streams (only meaningful on a GPU)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from engine_scenarios import (
    Sizes,
    drive,
    fixed,
    model_device,
    random_tokens,
    with_engine,
)

from services.worker.engine.engine import Engine
from services.worker.engine.model import LlamaModel
from services.worker.engine.request import Request
from services.worker.engine.settings import EngineSettings


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * nbytes * 10 / (time.perf_counter() - start)


def decode_tok_s(model: LlamaModel, concurrency: int, graphs: bool, new_tokens: int, overlap: str = "auto") -> float:
    """Output tok/s of `concurrency` streams decoding together, prefills excluded."""
    rng = np.random.default_rng(5)
    requests = [Request(str(i), random_tokens(rng, 128), fixed(new_tokens + 1)) for i in range(concurrency)]

    def run(engine: Engine) -> float:
        for request in requests:
            engine.add_request(request)
        while any(r.num_output_tokens == 0 for r in requests):
            engine.step()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return concurrency * new_tokens / (time.perf_counter() - start)

    settings = EngineSettings(
        max_num_seqs=max(concurrency, 8), cuda_graphs=graphs, kv_memory_fraction=0.8, overlap_scheduling=overlap
    )
    return with_engine(model, settings, run)


def graphs_agreement(model: LlamaModel, num_requests: int = 5, new_tokens: int = 32) -> float:
    """Share of greedy tokens the graph replay and the eager path agree on before they first
    part (five sequences: replays padded to 8, then smaller). bf16 near-ties may part them late."""
    rng = np.random.default_rng(6)
    prompts = [random_tokens(rng, int(rng.integers(3, 40))) for _ in range(num_requests)]

    def outputs(engine: Engine) -> list[list[int]]:
        requests = [Request(str(i), p, fixed(new_tokens)) for i, p in enumerate(prompts)]
        drive(engine, requests, time.perf_counter)
        return [r.output_token_ids for r in requests]

    runs = [with_engine(model, EngineSettings(max_num_seqs=8, cuda_graphs=g, kv_memory_fraction=0.5), outputs)
            for g in (True, False)]
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), new_tokens) for x, y in zip(*runs)]
    return sum(agreed) / (num_requests * new_tokens)


def decode(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    device = model_device(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # an untied embedding table is only gathered from, not read whole
        weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    bandwidth = copy_bandwidth(device)
    result: dict = {"weight_bytes": weight_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9}
    result["bound_tok_s"] = bandwidth / weight_bytes
    new_tokens = 128 if args.quick else 256
    # Steps overlapped (the default on a GPU), with graphs and without; and with graphs, in turn.
    variants = {"graphs": (True, "auto"), "eager": (False, "auto"), "graphs_in_turn": (True, "off")}
    for concurrency in (1, 64, 256):
        for name, (graphs, overlap) in variants.items():
            key = f"tok_s_{concurrency}_{name}"
            result[key] = decode_tok_s(model, concurrency, graphs, new_tokens, overlap)
            print(f"  decode {key}: {result[key]:.1f}", flush=True)
    result["single_stream_fraction_of_bound"] = result["tok_s_1_graphs"] / result["bound_tok_s"]
    result["graphs_token_agreement_with_eager"] = graphs_agreement(model)
    for concurrency in (1, 64, 256):
        graphs = result[f"tok_s_{concurrency}_graphs"]
        result[f"graphs_speedup_{concurrency}"] = graphs / result[f"tok_s_{concurrency}_eager"]
        result[f"overlap_speedup_{concurrency}"] = graphs / result[f"tok_s_{concurrency}_graphs_in_turn"]
    return result
