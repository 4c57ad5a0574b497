"""The engine benchmark's scenarios, each idea measured against its absence in one process:
continuous vs static batching, chunked vs whole prefill, paged vs reserved KV, prefix caching
(GPU decode is in engine_decode.py), and the helpers every scenario runs an engine with."""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from engine_baseline import hf_static_batches

from services.worker.engine.engine import Engine, RequestUpdate
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.model import LlamaModel
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import FinishReason

T = TypeVar("T")
Clock = Callable[[], float]


@dataclass
class Sizes:
    """Every scenario's size, by device and --quick."""

    skewed_requests: int
    skewed_batch: int
    skewed_mean: int
    skewed_cap: int
    long_prompt: int
    prefix_requests: int
    prefix_len: int


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    if device.type == "cuda":
        return Sizes(256 if quick else 512, 64, 128, 1024, 8192, 100 if quick else 200, 2048)
    if quick:
        return Sizes(256, 32, 64, 512, 2048, 64, 2048)
    return Sizes(512, 32, 128, 1024, 2048, 200, 2048)


def fixed(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 30000, n).tolist()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def with_engine(model: LlamaModel, settings: EngineSettings, use: Callable[[Engine], T], max_model_len: int = 0) -> T:
    """use(engine) on a fresh engine, gone before the next one: on a GPU each sizes its KV pool
    from the memory that is free when it starts."""
    engine = Engine(model, settings, max_model_len, eos_token_ids=())  # fixed output lengths: EOS never ends a request
    try:
        return use(engine)
    finally:
        del engine
        free_memory()


def drive(
    engine: Engine,
    requests: list[Request],
    clock: Clock,
    on_step: Callable[[list[RequestUpdate]], None] | None = None,
) -> float:
    """Run every request to the end; seconds taken. on_step(updates) after each step."""
    for request in requests:
        engine.add_request(request)
    start = clock()
    while engine.has_unfinished_requests():
        updates = engine.step()
        if on_step is not None:
            on_step(updates)
    return clock() - start


def model_device(model: LlamaModel) -> torch.device:
    return next(model.parameters()).device


# --- skewed output lengths: continuous vs static batching -------------------------------------------


def skewed(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(1)
    n, batch = sizes.skewed_requests, sizes.skewed_batch
    lengths = np.clip(np.ceil(rng.exponential(sizes.skewed_mean, n)), 1, sizes.skewed_cap).astype(int)
    prompts = [random_tokens(rng, 64) for _ in range(n)]
    useful = int(lengths.sum())
    # Static batching as Hugging Face generate does it: a batch's rows all run to its longest
    # output, the extra tokens wasted. The static scheduler admits requests in arrival order,
    # `batch` at a time, so batch k is requests [k*batch, (k+1)*batch).
    batch_max = np.repeat([lengths[i : i + batch].max() for i in range(0, n, batch)], batch)[:n]

    def seconds(static: bool, max_tokens: np.ndarray) -> float:
        blocks = batch * cdiv(64 + sizes.skewed_cap, 16) + 1
        settings = EngineSettings(max_num_seqs=batch, num_kv_blocks=blocks, static_batching=static)
        requests = [Request(str(i), p, fixed(int(m))) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        return with_engine(model, settings, lambda engine: drive(engine, requests, args.clock))

    continuous, static, static_release = seconds(False, lengths), seconds(True, batch_max), seconds(True, lengths)
    result = {
        "requests": n, "batch": batch, "prompt_tokens": 64,
        "output_distribution": f"exponential mean {sizes.skewed_mean}, cap {sizes.skewed_cap}",
        "output_mean": float(lengths.mean()), "output_max": int(lengths.max()),
        "useful_fraction_of_static_work": useful / float(batch_max.sum()),
        "continuous_tok_s": useful / continuous,
        "static_tok_s": useful / static,
        "static_release_tok_s": useful / static_release,
        "continuous_over_static": static / continuous,
        "continuous_over_static_release": static_release / continuous,
        "static_note": "static: every row of a batch runs to the batch's longest output (as HF generate); "
        "static_release: the same batches, but finished rows leave the batch",
    }
    if args.baseline == "hf":
        result["hf"] = hf_static_batches(
            model.config, prompts, lengths, batch, model_device(model), args.quick, args.clock
        )
        free_memory()
    return result


# --- a long prompt arriving while 32 streams decode: chunked vs whole prefill ------------------------


def decode_gaps_during_prefill(engine: Engine, streams: list[list[int]], long: list[int], clock: Clock) -> dict:
    """Gaps between the streams' tokens from the long prompt's arrival until its first token, and each
    step's time in that window."""
    for i, prompt in enumerate(streams):
        engine.add_request(Request(f"s{i}", prompt, fixed(512)))
    for _ in range(8):  # every stream past its prompt and decoding
        engine.step()
    last: dict[str, float] = {}
    gaps: list[float] = []
    steps_ms: list[float] = []
    arrival = clock()
    engine.add_request(Request("long", long, fixed(4)))
    while True:
        began = clock()
        updates = engine.step()
        now = clock()
        steps_ms.append(1e3 * (now - began))
        for update in updates:
            if update.request_id != "long":
                gaps.append(now - last.get(update.request_id, arrival))
                last[update.request_id] = now
        if any(u.request_id == "long" for u in updates):
            break  # its prefill is done: the window closes
    return {
        "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)), "itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)),
        "prefill_window_s": clock() - arrival, "decode_tokens_in_window": len(gaps), "steps_ms": steps_ms,
    }


def long_prompt(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(2)
    streams = [random_tokens(rng, 32) for _ in range(32)]
    long = random_tokens(rng, sizes.long_prompt)
    result: dict = {"streams": 32, "long_prompt_tokens": sizes.long_prompt, "chunk_budget_tokens": args.chunk_tokens}
    # chunked: the default, a chunk's attention over its prefix counted against the budget (chunk_cost.py);
    # chunked_by_tokens: its tokens alone.
    for name, chunked, by_work in (("chunked", True, True), ("chunked_by_tokens", True, False),
                                   ("unchunked", False, False)):
        settings = EngineSettings(
            max_num_seqs=64, max_batch_tokens=args.chunk_tokens, enable_chunked_prefill=chunked,
            count_chunk_attention=by_work, enable_prefix_caching=False,
            num_kv_blocks=32 * 40 + cdiv(sizes.long_prompt + 64, 16) + 1,
        )
        run = lambda engine: decode_gaps_during_prefill(engine, streams, long, args.clock)  # noqa: E731
        result[name] = with_engine(model, settings, run, max_model_len=sizes.long_prompt + 64)
    for name in ("chunked", "chunked_by_tokens"):
        result[f"itl_p99_{name}_over_unchunked"] = result[name]["itl_p99_ms"] / result["unchunked"]["itl_p99_ms"]
    return result


# --- paged KV vs reserving max length: requests admitted in one budget -------------------------------


def concurrency_with_early_stops(engine: Engine, requests: list[Request], real: np.ndarray, clock: Clock) -> dict:
    """Run requests that each stop (as at an EOS) after real[i] tokens; running counts while some wait."""
    running: list[int] = []

    def on_step(updates: list[RequestUpdate]) -> None:
        for update in updates:
            request = engine.get_request(update.request_id)
            if request is not None and request.num_output_tokens >= real[int(update.request_id)]:
                engine.finish_request(update.request_id, FinishReason.STOP)
        if engine.scheduler.num_waiting:
            running.append(engine.scheduler.num_running)

    seconds = drive(engine, requests, clock, on_step)
    return {"median": float(np.median(running)), "peak": max(running),
            "preemptions": engine.scheduler.num_preemptions, "seconds": seconds}


def memory(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(3)
    prompt_len, max_tokens, num_reserved, n = 64, 4096, 4, 600
    per_reservation = cdiv(prompt_len + max_tokens, 16)  # blocks an up-front reservation takes
    num_blocks = num_reserved * per_reservation + 1
    real = rng.integers(48, 81, n)  # what each request really generates (~64) before its EOS
    requests = [Request(str(i), random_tokens(rng, prompt_len), fixed(max_tokens)) for i in range(n)]
    settings = EngineSettings(max_num_seqs=1024, max_batch_tokens=4096, num_kv_blocks=num_blocks, cuda_graphs=False)
    paged = with_engine(model, settings, lambda engine: concurrency_with_early_stops(engine, requests, real, args.clock))
    return {
        "kv_blocks": num_blocks - 1, "block_size": 16, "prompt_tokens": prompt_len, "max_tokens": max_tokens,
        "real_output_tokens": "uniform 48..80", "requests": n,
        "reserved_concurrent": num_reserved, "paged_concurrent_median": paged["median"],
        "paged_concurrent_peak": paged["peak"], "preemptions": paged["preemptions"], "seconds": paged["seconds"],
        "paged_over_reserved": paged["median"] / num_reserved,
        "note": "reserved: the pool holds exactly 4 reservations of prompt + max_tokens; "
        "paged: median requests running while others wait",
    }


# --- a shared 2k-token prefix: prefill skipped, throughput with and without the cache ---------------


def prefix(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(4)
    shared = random_tokens(rng, sizes.prefix_len)
    prompts = [shared + random_tokens(rng, int(rng.integers(12, 25))) for _ in range(sizes.prefix_requests)]
    result: dict = {"requests": len(prompts), "prefix_tokens": sizes.prefix_len, "question_tokens": "12..24"}

    def run(engine: Engine) -> dict:
        seconds = drive(engine, [Request(str(i), p, fixed(8)) for i, p in enumerate(prompts)], args.clock)
        manager = engine.kv_cache_manager
        return {
            "seconds": seconds, "requests_per_s": len(prompts) / seconds, "output_tok_s": 8 * len(prompts) / seconds,
            "prefill_saved_fraction": manager.num_prefix_hit_tokens / max(1, manager.num_prefix_queries_tokens),
        }

    num_blocks = 4096 if model_device(model).type == "cpu" else 0
    for name, caching in (("cached", True), ("uncached", False)):
        result[name] = with_engine(model, EngineSettings(enable_prefix_caching=caching, num_kv_blocks=num_blocks), run)
    result["prefill_saved_fraction"] = result["cached"]["prefill_saved_fraction"]
    result["throughput_cached_over_uncached"] = result["uncached"]["seconds"] / result["cached"]["seconds"]
    return result


SCENARIOS = {"skewed": skewed, "long_prompt": long_prompt, "memory": memory, "prefix": prefix}
