"""The disaggregation benchmark's figures from one round's trace (disagg_round.py), their medians
over rounds, the ratios between layouts, and what they say about a CPU. Pure: no sockets."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np
from disagg_metrics import expected_prompt_bytes, handoff_figures, kv_bytes_per_block
from disagg_round import ChatTrace, RoundTrace

from shared.models.shapes import ModelConfig


def gaps_ms(traces: Sequence[ChatTrace], start: float, end: float) -> list[float]:
    """Each stream's inter-token gaps that ended inside [start, end], in ms."""
    gaps = []
    for trace in traces:
        times = trace.arrivals
        gaps += [(b - a) * 1000 for a, b in zip(times, times[1:]) if start <= b <= end]
    return gaps


def quantiles(values: Sequence[float], *qs: int) -> dict[str, float]:
    if not values:
        return {f"p{q}": math.nan for q in qs} | {"n": 0}
    array = np.asarray(values)
    return {f"p{q}": round(float(np.percentile(array, q)), 2) for q in qs} | {"n": len(values)}


def tokens_between(traces: Sequence[ChatTrace], start: float, end: float) -> int:
    return sum(start <= t <= end for trace in traces for t in trace.arrivals)


def round_figures(trace: RoundTrace, config: ModelConfig | None, block_size: int) -> dict:
    start, end = trace.window
    baseline_start = trace.decoding
    every = [*trace.streams, *trace.longs]
    ttfts = [(t.arrivals[0] - t.sent) * 1000 for t in trace.longs if t.arrivals]
    failed = [t.final for t in trace.longs if (t.final or {}).get("type") != "done"]
    window_s = end - start
    row = {
        "window_s": round(window_s, 2),
        "decode_itl_ms": quantiles(gaps_ms(trace.streams, start, end), 50, 99),
        "decode_itl_quiet_ms": quantiles(gaps_ms(trace.streams, baseline_start, start), 50, 99),
        "long_ttft_ms": quantiles(ttfts, 50, 99) | {"max": round(max(ttfts), 1) if ttfts else math.nan},
        "long_prompt_tokens": [t.prompt_tokens for t in trace.longs],
        "long_failed": failed,
        "long_failed_count": len(failed),
        "long_prompts_by_worker": [int(n) for n in trace.long_handoffs.requests_by_worker],  # taken from Kafka
        "stream_endings": _endings(trace.streams),
        # A stream that reached max_tokens before the window ended left fewer gaps to measure (raise --max-tokens).
        "streams_ended_before_window_end": sum(
            (t.final or {}).get("finish_reason") == "length" and bool(t.arrivals) and t.arrivals[-1] < end for t in trace.streams
        ),
        "tokens_per_s": round(tokens_between(every, start, end) / window_s, 2) if window_s > 0 else math.nan,
        "prefill_tokens_per_s": round(sum(t.prompt_tokens or 0 for t in trace.longs) / window_s, 1) if window_s > 0 else math.nan,
        "streams_decoding_after_s": round(trace.decoding - trace.started, 2),
        "long_handoffs": handoff_figures(trace.long_handoffs),
        "stream_handoffs": handoff_figures(trace.stream_handoffs),
    }
    if config is not None:
        prompts = [t.prompt_tokens for t in trace.longs if t.prompt_tokens]
        expected = statistics.mean(expected_prompt_bytes(n, config, block_size) for n in prompts) if prompts else math.nan
        measured = row["long_handoffs"]["bytes_per_handoff"]
        row["long_bytes_expected_per_request"] = expected
        row["long_bytes_measured_over_expected"] = measured / expected if expected and measured == measured else math.nan
        row["kv_bytes_per_block"] = per_block = kv_bytes_per_block(config, block_size)
        # The streams' short prompts share the chat template's first block, which the decode worker's prefix
        # cache may hold already (from the warm-up): a handoff moves only the blocks it lacks.
        stream_prompts = [t.prompt_tokens for t in trace.streams if t.prompt_tokens]
        row["stream_prompt_blocks_mean"] = statistics.mean(-(-n // block_size) for n in stream_prompts) if stream_prompts else math.nan
        row["stream_blocks_moved_per_handoff"] = row["stream_handoffs"]["bytes_per_handoff"] / per_block
    return row


def _endings(traces: Sequence[ChatTrace]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for trace in traces:
        final = trace.final or {}
        key = f"{final.get('type')}:{final.get('finish_reason') or final.get('code')}"
        counts[key] = counts.get(key, 0) + 1
    return counts


# The headline numbers: (name, path into a round's figures).
HEADLINES = {
    "decode_itl_p50_ms": ("decode_itl_ms", "p50"),
    "decode_itl_p99_ms": ("decode_itl_ms", "p99"),
    "decode_itl_quiet_p50_ms": ("decode_itl_quiet_ms", "p50"),
    "decode_itl_quiet_p99_ms": ("decode_itl_quiet_ms", "p99"),
    "long_ttft_p50_ms": ("long_ttft_ms", "p50"),
    "long_ttft_p99_ms": ("long_ttft_ms", "p99"),
    "tokens_per_s": ("tokens_per_s",),
    "prefill_tokens_per_s": ("prefill_tokens_per_s",),
    "long_failed": ("long_failed_count",),
    "bytes_per_handoff": ("long_handoffs", "bytes_per_handoff"),
    "handoff_seconds_mean": ("long_handoffs", "seconds_mean"),
    "handoff_seconds_p50": ("long_handoffs", "seconds_p50"),
    "handoff_seconds_p99": ("long_handoffs", "seconds_p99"),
}


def _dig(row: dict, path: tuple[str, ...]) -> float:
    for key in path:
        row = row[key]
    return float(row)


def medians(rounds: Sequence[dict]) -> dict[str, float]:
    """Each headline's median over the rounds (nan ones left out)."""
    out = {}
    for name, path in HEADLINES.items():
        values = [v for v in (_dig(r, path) for r in rounds) if not math.isnan(v)]
        out[name] = round(statistics.median(values), 4) if values else math.nan
    return out


def ratios(unified: dict[str, float], disaggregated: dict[str, float]) -> dict[str, float]:
    """disaggregated / unified, for the figures both layouts have."""
    keys = (
        "decode_itl_p50_ms", "decode_itl_p99_ms", "decode_itl_quiet_p50_ms", "decode_itl_quiet_p99_ms",
        "long_ttft_p50_ms", "long_ttft_p99_ms", "tokens_per_s", "prefill_tokens_per_s",
    )  # fmt: skip
    return {k: round(disaggregated[k] / unified[k], 3) if unified[k] else math.nan for k in keys}


def cpu_note(unified: dict[str, float], disaggregated: dict[str, float], ratio: dict[str, float], cores: int,
             threads: int, unified_shared: bool) -> str:  # fmt: skip
    """What the medians mean on one small CPU box, in words chosen by the data; `unified_shared`:
    the unified workers each took some of the long prompts in every round."""
    itl, ttft, tput = ratio["decode_itl_p99_ms"], ratio["long_ttft_p99_ms"], ratio["tokens_per_s"]
    if itl < 0.8:
        stall = f"the long prefills stalled the decode streams far less: decode ITL p99 {itl:.2f}x unified's"
    elif itl > 1.25:
        stall = f"the decode streams fared worse: decode ITL p99 {itl:.2f}x unified's"
    else:
        stall = f"the decode streams' ITL p99 was about the same ({itl:.2f}x unified's)"
    lead = "The price is the long prompts' TTFT" if ttft > 1.1 else "The long prompts' TTFT"
    where = "which the two unified workers shared" if unified_shared else "(the unified edge put them on one worker too)"
    why = f", since one prefill worker computes every long prompt {where}" if ttft > 1.1 else ""
    return (
        f"On one {cores}-core box both workers share the same cores, so disaggregation cannot add compute; what it "
        f"can show is whether a long prefill stops stalling the decode streams. With {threads} torch thread(s) per "
        f"worker, the disaggregated layout in effect gives prefill and decode a core each, where each unified worker "
        f"does both on its own. Disaggregated, {stall} ({disaggregated['decode_itl_p99_ms']:.0f} ms vs "
        f"{unified['decode_itl_p99_ms']:.0f} ms while the long prompts arrived; p50 "
        f"{disaggregated['decode_itl_p50_ms']:.0f} vs {unified['decode_itl_p50_ms']:.0f} ms). "
        f"{lead}: p99 {ttft:.2f}x unified's ({disaggregated['long_ttft_p99_ms'] / 1000:.1f} s vs "
        f"{unified['long_ttft_p99_ms'] / 1000:.1f} s){why}; each handoff adds {disaggregated['handoff_seconds_mean'] * 1000:.0f} ms (mean) to move "
        f"{disaggregated['bytes_per_handoff'] / 2**20:.1f} MiB of float32 KV. Output tokens/s over the window: "
        f"{tput:.2f}x unified's. Separate devices per role, as on a GPU fleet, are what this box cannot show."
    )
