"""Disaggregated prefill/decode vs unified workers, real processes on this machine.

Each round starts a fresh fleet (1 edge, 1 router, 2 workers) in one of two layouts: two unified
workers, or one prefill worker handing KV caches over the KV link to one decode worker. Rounds
alternate layouts (unified, disaggregated, unified, ...), since a shared machine is noisy; each
figure is quoted as the median over a layout's rounds. A round (disagg_round.py): `--streams`
chats decode `--max-tokens` tokens each (greedy, EOS ignored); once all of them decode and a
quiet stretch has passed, `--long-prompts` raw prompts of `--long-tokens` tokens arrive every
`--long-interval-s`. Measured: the streams' inter-token gaps while the long prompts arrive (and
in the quiet stretch), the long prompts' TTFT, output tokens/s in that window, and per handoff
the KV bytes moved and the time from connect to commit (the workers' own counters), with the
bytes checked against the KV size of the prompt's blocks.

    python loadtest/bench_disagg.py                  # smollm2, defaults: about 10 minutes on 2 cores
    python loadtest/bench_disagg.py --model tiny --streams 8 --rounds 1   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import disagg_figures
from bench_report import write_and_report
from disagg_plot import plot_results
from disagg_prompts import tokenizer_of
from disagg_round import RoundTrace, Workload, run_round

from services.launcher.fleet import Fleet
from services.launcher.spec import FleetSpec
from services.worker.decoder_choice import KV_ADDRESS
from services.worker.engine.settings import EngineSettings
from shared.chat_client import ChatSocket
from shared.infra.command import drop_topics, fresh_topics
from shared.infra.settings import InfraSettings
from shared.membership import MembershipSettings, query_members
from shared.models.spec import resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = {"unified": 0, "disaggregated": 1}  # layout -> decode workers of the two
DESCRIPTIONS = {"unified": "two unified workers", "disaggregated": "worker-0 prefill, worker-1 decode"}
GOSSIP_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="smollm2", help="smollm2 (real weights) or a shape such as tiny")
    add("--rounds", type=int, default=2, help="rounds per layout, interleaved")
    add("--streams", type=int, default=32, help="chats decoding throughout")
    add("--max-tokens", type=int, default=256, help="each stream's length (cancelled once the long prompts are done)")
    add("--long-prompts", type=int, default=4)
    add("--long-tokens", type=int, default=2000, help="each long prompt's tokens, by the model's tokenizer")
    add("--long-max-tokens", type=int, default=16)
    add("--long-interval-s", type=float, default=2.0)
    add("--baseline-s", type=float, default=5.0, help="quiet decoding before the first long prompt")
    add("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per worker")
    add("--timeout-s", type=float, default=300.0, help="longest wait for any one phase of a round")
    add("--progress-timeout-s", type=float, default=300.0,
        help="the edge's: a long prompt queued behind others on one CPU can be silent past the default 30 s")  # fmt: skip
    add("--base-port", type=int, default=int(os.environ.get("DRIVETRAIN_TEST_BASE_PORT", "25000")))
    add("--json", type=Path, default=RESULTS / "disagg_cpu.json")
    return parser.parse_args(argv)


@contextlib.contextmanager
def running_fleet(layout: str, args: argparse.Namespace, log_dir: Path) -> Iterator[Fleet]:
    """A fresh fleet on fresh topics; stopped and its topics dropped however the round ends."""
    topics = fresh_topics("bench-disagg")
    fleet: Fleet | None = None
    try:
        spec = FleetSpec.at(
            args.base_port, edges=1, routers=1, workers=2, decode_workers=LAYOUTS[layout], model=args.model,
            extra_env={"DRIVETRAIN_TOPICS_PREFIX": topics.prefix},
            role_env={"worker": {"OMP_NUM_THREADS": str(args.threads)},
                      "edge": {"DRIVETRAIN_PROGRESS_TIMEOUT_S": str(args.progress_timeout_s)}},
        )  # fmt: skip
        fleet = Fleet(spec, log_dir=log_dir, echo_logs=False)
        fleet.start(ready_timeout_s=180)  # stops what it started if it fails
        asyncio.run(members_ready(spec, topics.prefix, LAYOUTS[layout] > 0))
        yield fleet
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave children behind
        try:
            if fleet is not None:
                fleet.stop()
            drop_topics(topics)
        finally:
            signal.signal(signal.SIGINT, previous)


async def members_ready(spec: FleetSpec, prefix: str, needs_decoder: bool) -> None:
    """The edge knows both workers alive (and, disaggregated, the decode worker's KV link address)."""
    config = MembershipSettings(cluster_name=prefix)
    deadline = time.monotonic() + GOSSIP_TIMEOUT_S
    while time.monotonic() < deadline:
        rows = await query_members(("127.0.0.1", spec.base_gossip_port), config)
        workers = [r for r in rows if r["role"] == "worker" and r["status"] == "alive"]
        if len(workers) == spec.workers and (not needs_decoder or any(r["addresses"].get(KV_ADDRESS) for r in workers)):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError("the edge did not see both workers in gossip in time")


async def warm_up(url: str) -> None:
    """A few short chats, so the round does not pay for the first steps' allocations."""
    sock = await ChatSocket.open(url)
    try:
        for i in range(2):
            await sock.send({"type": "chat", "id": f"w{i}", "messages": [{"role": "user", "content": f"Warm up {i}."}],
                             "max_tokens": 4, "temperature": 0, "ignore_eos": True})  # fmt: skip
        for i in range(2):
            await sock.collect(f"w{i}", timeout=120)
    finally:
        await sock.close()


def handoff_log_lines(log_dir: Path, limit: int = 5) -> list[str]:
    """The workers' lines about handoffs that did not land (what to read when some decoded_here)."""
    lines = []
    for path in sorted(log_dir.glob("worker-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "handoff of" in line or ("KV link" in line and "listening" not in line) or "decodes here" in line:
                lines.append(f"{path.stem}: {line.strip()[:300]}")
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def one_round(layout: str, index: int, args: argparse.Namespace, work: Workload, tokenizer, logs: Path) -> tuple[dict, RoundTrace]:
    log_dir = logs / f"{layout}-r{index}"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    print(f"round {index} {layout}: starting the fleet (logs in {log_dir})", flush=True)
    with running_fleet(layout, args, log_dir) as fleet:
        spec = fleet.spec
        ports = [spec.worker_metrics_port(i) for i in range(spec.workers)]
        asyncio.run(warm_up(spec.chat_url(0)))
        trace = asyncio.run(run_round(spec.chat_url(0), ports, tokenizer, work, f"r{index}-{layout}"))
    config = resolve_model(args.model).config
    row = {"round": index, "layout": layout} | disagg_figures.round_figures(trace, config, EngineSettings().block_size)
    if layout == "disaggregated":
        row["handoff_log"] = handoff_log_lines(log_dir)
    if row["streams_ended_before_window_end"]:
        print(f"round {index} {layout}: {row['streams_ended_before_window_end']} stream(s) ended before the window did; "
              "raise --max-tokens", flush=True)  # fmt: skip
    print(f"round {index} {layout}: decode ITL {row['decode_itl_ms']}, long TTFT {row['long_ttft_ms']}, "
          f"{row['tokens_per_s']} tok/s, handoffs {row['long_handoffs']['outcomes']}, "
          f"long prompts by worker {row['long_prompts_by_worker']}, {len(row['long_failed'])} failed", flush=True)  # fmt: skip
    return row, trace


def timeline(trace: RoundTrace) -> dict:
    """One round's gaps over time, from the quiet stretch to the window's end, for the plot."""
    start, end = trace.window
    points = [(b - start, (b - a) * 1000) for s in trace.streams for a, b in zip(s.arrivals, s.arrivals[1:]) if trace.decoding <= b <= end]
    points.sort()
    return {"t_s": [round(t, 3) for t, _ in points], "gap_ms": [round(g, 1) for _, g in points],
            "long_sent_s": [round(t.sent - start, 3) for t in trace.longs]}  # fmt: skip


def kv_check(args: argparse.Namespace, rows: list[dict], disaggregated: dict[str, float]) -> dict:
    config, block_size = resolve_model(args.model).config, EngineSettings().block_size
    prompts = [n for r in rows if r["layout"] == "disaggregated" for n in r["long_prompt_tokens"] if n]
    expected = [r["long_bytes_expected_per_request"] for r in rows if r["layout"] == "disaggregated"]
    measured = disaggregated["bytes_per_handoff"]
    return {
        "model_shape": {"layers": config.num_layers, "kv_heads": config.num_kv_heads, "head_dim": config.head_dim},
        "dtype": "float32", "block_size": block_size,
        "kv_bytes_per_block": disagg_figures.kv_bytes_per_block(config, block_size),
        "prompt_tokens": sorted(set(prompts)), "blocks_per_prompt": sorted({-(-n // block_size) for n in prompts}),
        "expected_bytes_per_request": sum(expected) / len(expected) if expected else float("nan"),
        "measured_bytes_per_request": measured,
        "formula": "ceil(prompt_tokens / block_size) x layers x 2 (K, V) x block_size x kv_heads x head_dim x 4 bytes",
    }  # fmt: skip


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # a kill cleans up as Ctrl-C does
    work = Workload(args.streams, args.max_tokens, args.long_prompts, args.long_tokens, args.long_max_tokens,
                    args.long_interval_s, args.baseline_s, args.timeout_s)  # fmt: skip
    tokenizer = tokenizer_of(args.model)
    logs = Path(InfraSettings().infra_dir) / "logs" / "bench-disagg"
    began, load_start = time.monotonic(), os.getloadavg()
    rows, traces = [], {}
    for index in range(args.rounds):
        for layout in LAYOUTS:
            row, traces[layout] = one_round(layout, index, args, work, tokenizer, logs)
            rows.append(row)
    per_round = {layout: [disagg_figures.medians([r]) for r in rows if r["layout"] == layout] for layout in LAYOUTS}
    median = {layout: disagg_figures.medians([r for r in rows if r["layout"] == layout]) for layout in LAYOUTS}
    ratio = disagg_figures.ratios(median["unified"], median["disaggregated"])
    check = kv_check(args, rows, median["disaggregated"])
    check["measured_over_expected"] = check["measured_bytes_per_request"] / check["expected_bytes_per_request"]
    cores = os.cpu_count() or 0
    unified_shared = all(min(r["long_prompts_by_worker"], default=0) > 0 for r in rows if r["layout"] == "unified")
    fallbacks = sum(r["long_handoffs"]["outcomes"].get("decoded_here", 0) + r["stream_handoffs"]["outcomes"].get("decoded_here", 0)
                    for r in rows if r["layout"] == "disaggregated")  # fmt: skip
    results = {
        "command": "python loadtest/bench_disagg.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model, "cores": cores, "layouts": DESCRIPTIONS,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json",)} | {"block_size": EngineSettings().block_size},
        "measured": "ITL: gaps between a stream's token frames as this process read them, those ending while the long "
                    "prompts arrived (first sent .. last done); 'quiet': the stretch before. TTFT: send to first token. "
                    "tokens/s: output tokens of every chat in that window. Handoffs: the workers' counters over the window.",
        "rounds": rows, "headlines_per_round": per_round, "median": median,
        "ratio_disaggregated_over_unified": ratio, "kv_check": check,
        "handoff_per_request": {k: median["disaggregated"][k] for k in ("bytes_per_handoff", "handoff_seconds_mean", "handoff_seconds_p50", "handoff_seconds_p99")},
        "handoffs_decoded_here": fallbacks,
        "note": disagg_figures.cpu_note(median["unified"], median["disaggregated"], ratio, cores, args.threads, unified_shared),
        "noise": {"load_average_start": load_start, "load_average_end": os.getloadavg(),
                  "note": "a shared machine: other processes' load moves every figure; compare the rounds"},
        "timelines": {layout: timeline(trace) for layout, trace in traces.items()},
        "seconds": round(time.monotonic() - began, 1),
        "targets": {
            "decode_itl_p99_disaggregated_over_unified": {"value": ratio["decode_itl_p99_ms"], "target": "< 1", "met": ratio["decode_itl_p99_ms"] < 1},
            "kv_bytes_measured_over_expected": {"value": check["measured_over_expected"], "target": "= 1 (+-1 %)", "met": abs(check["measured_over_expected"] - 1) <= 0.01},
        },
    }  # fmt: skip
    write_and_report(results, args.json, plot_results)
    print(results["note"])
    return results


if __name__ == "__main__":
    main()
