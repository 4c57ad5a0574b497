"""What the engine's design buys, each idea measured against its absence in one process:
continuous vs static batching, chunked vs whole prefill, paged vs reserved KV, prefix caching,
and (on a GPU) decode speed against the memory-bandwidth bound, with and without CUDA graphs.

    python loadtest/bench_engine.py --model tiny --device cpu --quick --json loadtest/results/engine_cpu.json
    python loadtest/bench_engine.py --model llama-8b --device cuda --baseline hf --json loadtest/results/engine_gpu.json

Needs only torch (+ transformers for --baseline hf, matplotlib for the plot): no Kafka, no Redis.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.worker.engine.config import SHAPES, ModelConfig
from services.worker.engine.engine import Engine, EngineConfig, RequestUpdate
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.model import LlamaModel
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.weights import _init_random_, _materialise

T = TypeVar("T")
Clock = Callable[[], float]
# On a shared CPU box, wall time measures the neighbours as much as the engine: there the
# default clock is this process's CPU time (one torch thread, so it is the work done).
CLOCKS: dict[str, Clock] = {"wall": time.perf_counter, "cpu": time.process_time}
RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {  # CPU targets from the design brief
    "skewed.continuous_over_static": (">=", 3.0),
    "long_prompt.itl_p99_chunked_over_unchunked": ("<=", 1 / 3),
    "memory.paged_over_reserved": (">=", 10.0),
    "prefix.prefill_saved_fraction": (">=", 0.9),
}


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


def random_model(shape: str, device: torch.device) -> LlamaModel:
    # Seeded random weights for a named shape, without the tokenizer load_model also builds:
    # benchmarks need only token ids, and the GPU machine has no tokenizer files.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _materialise(SHAPES[shape], device, dtype)
    _init_random_(model, seed=0)
    return model.eval()


def fixed(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 30000, n).tolist()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def with_engine(model: LlamaModel, config: EngineConfig, use: Callable[[Engine], T]) -> T:
    """use(engine) on a fresh engine, gone before the next one: on a GPU each sizes its KV pool
    from the memory that is free when it starts."""
    engine = Engine(model, config, eos_token_ids=())  # fixed output lengths: EOS never ends a request
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
        config = EngineConfig(max_num_seqs=batch, num_kv_blocks=blocks, static_batching=static)
        requests = [Request(str(i), p, fixed(int(m))) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        return with_engine(model, config, lambda engine: drive(engine, requests, args.clock))

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
    return result


# --- a long prompt arriving while 32 streams decode: chunked vs whole prefill ------------------------


def decode_gaps_during_prefill(engine: Engine, streams: list[list[int]], long: list[int], clock: Clock) -> dict:
    """Gaps between the streams' tokens from the long prompt's arrival until its first token."""
    for i, prompt in enumerate(streams):
        engine.add_request(Request(f"s{i}", prompt, fixed(512)))
    for _ in range(8):  # every stream past its prompt and decoding
        engine.step()
    last: dict[str, float] = {}
    gaps: list[float] = []
    arrival = clock()
    engine.add_request(Request("long", long, fixed(4)))
    while True:
        updates = engine.step()
        now = clock()
        for update in updates:
            if update.request_id != "long":
                gaps.append(now - last.get(update.request_id, arrival))
                last[update.request_id] = now
        if any(u.request_id == "long" for u in updates):
            break  # its prefill is done: the window closes
    return {
        "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)), "itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)),
        "prefill_window_s": clock() - arrival, "decode_tokens_in_window": len(gaps),
    }


def long_prompt(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(2)
    streams = [random_tokens(rng, 32) for _ in range(32)]
    long = random_tokens(rng, sizes.long_prompt)
    result: dict = {"streams": 32, "long_prompt_tokens": sizes.long_prompt, "chunk_budget_tokens": args.chunk_tokens}
    for name, chunked in (("chunked", True), ("unchunked", False)):
        config = EngineConfig(
            max_num_seqs=64, max_batch_tokens=args.chunk_tokens, enable_chunked_prefill=chunked,
            enable_prefix_caching=False, num_kv_blocks=32 * 40 + cdiv(sizes.long_prompt + 64, 16) + 1,
            max_model_len=sizes.long_prompt + 64,
        )
        result[name] = with_engine(model, config, lambda engine: decode_gaps_during_prefill(engine, streams, long, args.clock))
    result["itl_p99_chunked_over_unchunked"] = result["chunked"]["itl_p99_ms"] / result["unchunked"]["itl_p99_ms"]
    return result


# --- paged KV vs reserving max length: requests admitted in one budget -------------------------------


def concurrency_with_early_stops(engine: Engine, requests: list[Request], real: np.ndarray, clock: Clock) -> dict:
    """Run requests that each stop (as at an EOS) after real[i] tokens; running counts while some wait."""
    running: list[int] = []

    def on_step(updates: list[RequestUpdate]) -> None:
        for update in updates:
            request = engine.get_request(update.request_id)
            if request is not None and request.num_output_tokens >= real[int(update.request_id)]:
                engine.finish_request(update.request_id, "stop")
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
    config = EngineConfig(max_num_seqs=1024, max_batch_tokens=4096, num_kv_blocks=num_blocks, cuda_graphs=False)
    paged = with_engine(model, config, lambda engine: concurrency_with_early_stops(engine, requests, real, args.clock))
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
        result[name] = with_engine(model, EngineConfig(enable_prefix_caching=caching, num_kv_blocks=num_blocks), run)
    result["prefill_saved_fraction"] = result["cached"]["prefill_saved_fraction"]
    result["throughput_cached_over_uncached"] = result["uncached"]["seconds"] / result["cached"]["seconds"]
    return result


# --- GPU decode: single stream vs the bandwidth bound; CUDA graphs at 64 and 256 -------------------


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


def decode_tok_s(model: LlamaModel, concurrency: int, graphs: bool, new_tokens: int) -> float:
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

    config = EngineConfig(max_num_seqs=max(concurrency, 8), cuda_graphs=graphs, kv_memory_fraction=0.8)
    return with_engine(model, config, run)


def graphs_agreement(model: LlamaModel, num_requests: int = 5, new_tokens: int = 32) -> float:
    """Share of greedy tokens the graph replay and the eager path agree on before they first
    part (five sequences: replays padded to 8, then smaller). bf16 near-ties may part them late."""
    rng = np.random.default_rng(6)
    prompts = [random_tokens(rng, int(rng.integers(3, 40))) for _ in range(num_requests)]

    def outputs(engine: Engine) -> list[list[int]]:
        requests = [Request(str(i), p, fixed(new_tokens)) for i, p in enumerate(prompts)]
        drive(engine, requests, time.perf_counter)
        return [r.output_token_ids for r in requests]

    runs = [with_engine(model, EngineConfig(max_num_seqs=8, cuda_graphs=g, kv_memory_fraction=0.5), outputs)
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
    for concurrency in (1, 64, 256):
        for graphs in (True, False):
            key = f"tok_s_{concurrency}_{'graphs' if graphs else 'eager'}"
            result[key] = decode_tok_s(model, concurrency, graphs, new_tokens)
            print(f"  decode {key}: {result[key]:.1f}", flush=True)
    result["single_stream_fraction_of_bound"] = result["tok_s_1_graphs"] / result["bound_tok_s"]
    result["graphs_token_agreement_with_eager"] = graphs_agreement(model)
    for concurrency in (1, 64, 256):
        result[f"graphs_speedup_{concurrency}"] = (
            result[f"tok_s_{concurrency}_graphs"] / result[f"tok_s_{concurrency}_eager"]
        )
    return result


# --- Hugging Face generate on the same shape and batches (static batching by construction) --------


def hf_static_batches(
    config: ModelConfig, prompts: list[list[int]], lengths: np.ndarray, batch: int, device: torch.device,
    quick: bool, clock: Clock,
) -> dict:
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError:
        return {"skipped": "transformers is not importable"}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**config.to_hf()), dtype=dtype).eval()
    # The static cache makes generate compile its forward: worth it on a GPU only.
    modes = ["eager", "static_cache"] if device.type == "cuda" else ["eager"]
    # Full batches only; --quick: the first two (tok/s is per batch anyway).
    num_batches = min(2, len(prompts) // batch) if quick else len(prompts) // batch
    longest = [int(lengths[k * batch : (k + 1) * batch].max()) for k in range(num_batches)]
    result: dict = {"batches": num_batches, "batch": batch}
    for mode in modes:
        kwargs = {"cache_implementation": "static"} if mode == "static_cache" else {}
        # Warm-up; a static cache is compiled for the longest batch, which the others then reuse.
        _hf_generate(hf, prompts[:batch], max(longest) if kwargs else 8, device, kwargs, clock)
        useful, seconds = 0, 0.0
        for k in range(num_batches):
            seconds += _hf_generate(hf, prompts[k * batch : (k + 1) * batch], longest[k], device, kwargs, clock)
            useful += int(lengths[k * batch : (k + 1) * batch].sum())
        result[f"{mode}_tok_s"] = useful / seconds
    del hf
    free_memory()
    return result


def _hf_generate(
    hf, prompts: list[list[int]], new_tokens: int, device: torch.device, kwargs: dict, clock: Clock
) -> float:
    ids = torch.tensor(prompts, device=device)  # (B, P): equal lengths, no padding needed
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = clock()
    with torch.no_grad():
        hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, **kwargs,
        )  # min_new_tokens: every row runs its full length, EOS or not
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - start


# --- plot ------------------------------------------------------------------------------------------


def plot_results(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = []
    if "skewed" in results:
        r = results["skewed"]
        bars = {"continuous": r["continuous_tok_s"], "static": r["static_tok_s"], "static\n(release)": r["static_release_tok_s"]}
        bars.update({f"HF {k[:-6]}": v for k, v in r.get("hf", {}).items() if k.endswith("_tok_s")})
        panels.append(("skewed lengths: useful output tok/s", bars))
    if "long_prompt" in results:
        r = results["long_prompt"]
        panels.append(("long prompt: decode ITL p99 (ms)", {k: r[k]["itl_p99_ms"] for k in ("chunked", "unchunked")}))
    if "memory" in results:
        r = results["memory"]
        panels.append(("requests running at once", {"paged": r["paged_concurrent_median"], "reserved": r["reserved_concurrent"]}))
    if "prefix" in results:
        r = results["prefix"]
        panels.append(("shared prefix: requests/s", {k: r[k]["requests_per_s"] for k in ("cached", "uncached")}))
    if "decode" in results:
        r = results["decode"]
        bars = {"bound\n1": r["bound_tok_s"]}
        bars.update({k[6:].replace("_", "\n"): v for k, v in r.items() if k.startswith("tok_s_")})
        panels.append(("decode output tok/s", bars))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (title, bars) in zip(axes[0], panels):
        ax.bar(list(bars), list(bars.values()), color="#4472c4")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    meta = results["meta"]
    fig.suptitle(f"engine: {meta['model']} on {meta['gpu'] or meta['device']}{' (quick)' if meta['quick'] else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- main ----------------------------------------------------------------------------------------


SCENARIOS = {"skewed": skewed, "long_prompt": long_prompt, "memory": memory, "prefix": prefix, "decode": decode}


def check_targets(results: dict) -> dict:
    verdicts = {}
    for key, (op, bound) in TARGETS.items():
        scenario, name = key.split(".")
        if scenario in results:
            value = results[scenario][name]
            verdicts[key] = {"value": value, "target": f"{op} {bound:.3g}",
                             "met": value >= bound if op == ">=" else value <= bound}
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="smaller scenarios (sizes in the JSON)")
    parser.add_argument("--baseline", choices=["none", "hf"], default="none", help="also run HF generate")
    parser.add_argument("--scenarios", default="skewed,long_prompt,memory,prefix,decode")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="token budget per step when chunking")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads (the box may be shared)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), help="default: cpu on a CPU, wall on a GPU")
    parser.add_argument("--json", type=Path, default=RESULTS / "engine.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.clock_name = args.clock or ("wall" if device.type == "cuda" else "cpu")
    args.clock = CLOCKS[args.clock_name]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    sizes = sizes_for(device, args.quick)
    model = random_model(args.model, device)
    results: dict = {"meta": {
        "model": args.model, "device": str(device), "dtype": str(next(model.parameters()).dtype),
        "quick": args.quick, "clock": args.clock_name, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "sizes": vars(sizes), "command": " ".join(sys.argv),
    }}
    for name in args.scenarios.split(","):
        if name == "decode" and device.type != "cuda":
            continue  # CUDA graphs and the bandwidth bound mean something only on a GPU
        start = time.perf_counter()
        print(f"{name} ...", flush=True)
        results[name] = SCENARIOS[name](model, sizes, args)
        results[name]["scenario_seconds"] = time.perf_counter() - start
        print(f"{name}: {json.dumps(results[name], default=float)[:400]}", flush=True)
    results["targets"] = check_targets(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, default=float))
    plot_path = plot_results(results, args.json.with_suffix(".png"))
    print("\nkey figures:")
    for key, verdict in results["targets"].items():
        print(f"  {key} = {verdict['value']:.3f} (target {verdict['target']}: {'met' if verdict['met'] else 'MISSED'})")
    print(f"wrote {args.json}" + (f" and {plot_path}" if plot_path else " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
