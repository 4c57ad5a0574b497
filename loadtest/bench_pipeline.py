"""What the pipeline costs: edge -> Kafka -> worker -> Kafka -> router -> edge vs a direct echo socket.

Both sides serve the echo model at the same pace (one piece per `--delay-ms`), to
the same clients in this process, one socket per stream. A token's latency is its
arrival minus when the model's schedule says it was due, (k+1) * delay after the
chat was sent, so the difference between the two sides is what the path adds. That
splits into the first token's extra wait (admission: route write, request through
Kafka, the start on record) and each token's lag behind the stream's first token. The
lag is the token path's variation (jitter, a backlog building up), less what the first
token alone paid (its start on record): a path that took the same time for every token
would show none. What the token path itself takes per token is measured by the fleet:

Each pipeline row carries `hops`, where the time went hop by hop, from the services' own
hop histograms (loadtest/pipeline_hops.py), and `token_path_ms`, the token path's hops
(token_kafka, route, link, socket_write) added up: their means add to the path's mean;
their p50s and p99s add to a conservative figure, not the path's own quantiles.
`worker_start` includes one model step (`delay_ms`), which the direct socket waits too.
With `--rounds N` each figure is the median of N rounds, direct and pipeline taking
turns, since a shared machine is noisy.

    python loadtest/bench_pipeline.py --rounds 3 --json loadtest/results/pipeline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pipeline_hops
from websockets.asyncio.server import serve

from services.launcher.fleet import Fleet
from services.launcher.spec import FleetSpec
from shared.chat_client import ChatSocket
from shared.infra.command import drop_topics, fresh_topics
from shared.infra.settings import InfraSettings
from shared.models.echo import split_pieces
from shared.service_settings import EventLoop
from shared.topics import TopicLayout

RESULTS = Path(__file__).resolve().parent / "results"
DIRECT_PORT = 28999


async def direct_echo_server(delay_s: float):
    """The baseline: the same protocol and pacing, straight from one process to the socket."""

    async def handler(ws) -> None:
        async for text in ws:
            frame = json.loads(text)
            asyncio.get_running_loop().create_task(stream(ws, frame))

    async def stream(ws, frame) -> None:
        chat_id = frame["id"]
        await ws.send(json.dumps({"type": "accepted", "id": chat_id, "request_id": uuid.uuid4().hex}))
        pieces = split_pieces(frame["messages"][-1]["content"])
        start = time.perf_counter()
        for seq, piece in enumerate(pieces):
            # Keep to the schedule like the engine's steps do, without drift from sends.
            await asyncio.sleep(max(0.0, start + (seq + 1) * delay_s - time.perf_counter()))
            await ws.send(json.dumps({"type": "token", "id": chat_id, "seq": seq, "text": piece}))
        usage = {"prompt_tokens": len(pieces), "cached_tokens": 0, "completion_tokens": len(pieces)}
        await ws.send(json.dumps({"type": "done", "id": chat_id, "finish_reason": "stop", "usage": usage}))

    return await serve(handler, "127.0.0.1", DIRECT_PORT, compression=None, max_queue=None)


async def run_streams(url: str, streams: int, words: int, delay_s: float) -> dict:
    text = " ".join(f"w{i}" for i in range(words))
    sockets = await asyncio.gather(*(ChatSocket.open(url) for _ in range(streams)))
    try:
        t0 = time.perf_counter()

        async def one(sock: ChatSocket) -> tuple[float, object]:
            sent = time.perf_counter()
            await sock.chat("c", text, max_tokens=words)
            return sent, await sock.collect("c", timeout=300)

        runs = await asyncio.gather(*(one(s) for s in sockets))
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(s.close() for s in sockets), return_exceptions=True)
    latencies, lags, ttfts, tokens, bad = [], [], [], 0, Counter()
    for sent, result in runs:
        token_times = [t for f, t in zip(result.frames, result.arrivals) if f["type"] == "token"]
        if result.text != text or result.final["type"] != "done":
            final = result.final or {}
            bad[f'{final.get("type")}:{final.get("code") or final.get("finish_reason")}'] += 1
        if not token_times:
            continue
        tokens += len(token_times)
        # From the send: everything, admission included. From the first token: the token path alone.
        latencies += [(t - sent - (k + 1) * delay_s) * 1000 for k, t in enumerate(token_times)]
        lags += [(t - token_times[0] - k * delay_s) * 1000 for k, t in enumerate(token_times)]
        ttfts.append((token_times[0] - sent - delay_s) * 1000)
    lat, lag, ttft = np.array(latencies), np.array(lags), np.array(ttfts)
    return {
        "streams": streams,
        "tokens": tokens,
        "incomplete_streams": sum(bad.values()),
        "incomplete_by_ending": dict(bad),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "latency_ms_p50": round(float(np.percentile(lat, 50)), 2),
        "latency_ms_p99": round(float(np.percentile(lat, 99)), 2),
        "token_lag_ms_p50": round(float(np.percentile(lag, 50)), 2),
        "token_lag_ms_p99": round(float(np.percentile(lag, 99)), 2),
        "first_token_ms_p50": round(float(np.percentile(ttft, 50)), 2),
        "first_token_ms_p99": round(float(np.percentile(ttft, 99)), 2),
    }


def start_fleet(delay_ms: float, event_loop: EventLoop) -> tuple[Fleet, Path, TopicLayout]:
    layout = fresh_topics("bench", partitions=8)
    log_dir = Path(InfraSettings().infra_dir) / "logs" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = FleetSpec(
        edges=1, workers=1, routers=1, model="echo", echo_delay_ms=delay_ms,
        base_port=28080, base_internal_port=29180, base_gossip_port=30280,
        extra_env={"DRIVETRAIN_TOPICS_PREFIX": layout.prefix, "DRIVETRAIN_EVENT_LOOP": event_loop},
    )
    fleet = Fleet(spec, log_dir=log_dir, echo_logs=False)
    fleet.start()
    return fleet, log_dir, layout


def fleet_metrics_urls(spec: FleetSpec) -> list[str]:
    edges = [f"http://127.0.0.1:{spec.base_port + i}/metrics" for i in range(spec.edges)]
    workers = [f"http://127.0.0.1:{spec.worker_metrics_port(i)}/metrics" for i in range(spec.workers)]
    routers = [f"http://127.0.0.1:{spec.router_metrics_port(i)}/metrics" for i in range(spec.routers)]
    return edges + workers + routers


def median_row(rounds: list[dict]) -> dict:
    """Each number the median of the rounds' (an odd count gives one round's own value)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {key: median_row([r[key] for r in rounds if key in r]) for key in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return round(statistics.median(rounds), 3)
    return first


async def measure_round(args: argparse.Namespace, streams: int, pipeline_url: str, metrics_urls: list[str]) -> dict:
    delay_s = args.delay_ms / 1000
    direct = await run_streams(f"ws://127.0.0.1:{DIRECT_PORT}/v1/chat", streams, args.words, delay_s)
    before = await asyncio.to_thread(pipeline_hops.scrape, metrics_urls)
    pipeline = await run_streams(pipeline_url, streams, args.words, delay_s)
    pipeline["hops"] = pipeline_hops.breakdown(before, await asyncio.to_thread(pipeline_hops.scrape, metrics_urls))
    pipeline["token_path_ms"] = pipeline_hops.token_path(pipeline["hops"])
    return {
        "streams": streams,
        "direct": direct,
        "pipeline": pipeline,
        "added_latency_ms_p50": round(pipeline["latency_ms_p50"] - direct["latency_ms_p50"], 2),
        "added_latency_ms_p99": round(pipeline["latency_ms_p99"] - direct["latency_ms_p99"], 2),
        "added_token_lag_ms_p50": round(pipeline["token_lag_ms_p50"] - direct["token_lag_ms_p50"], 2),
        "added_token_lag_ms_p99": round(pipeline["token_lag_ms_p99"] - direct["token_lag_ms_p99"], 2),
        "added_first_token_ms_p50": round(pipeline["first_token_ms_p50"] - direct["first_token_ms_p50"], 2),
        "throughput_ratio": round(pipeline["tokens_per_s"] / direct["tokens_per_s"], 3),
    }


async def measure(args: argparse.Namespace, pipeline_url: str, metrics_urls: list[str]) -> list[dict]:
    delay_s = args.delay_ms / 1000
    server = await direct_echo_server(delay_s)
    rows = []
    try:
        for streams in args.streams:
            for _ in range(args.warmup):
                await run_streams(pipeline_url, min(streams, 20), 5, delay_s)
            rounds = [await measure_round(args, streams, pipeline_url, metrics_urls) for _ in range(args.rounds)]
            row = median_row(rounds) | {"rounds": args.rounds}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        server.close()
        await server.wait_closed()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = [str(r["streams"]) for r in rows]
    fig, (left, right, hops) = plt.subplots(1, 3, figsize=(17, 4))
    x = np.arange(len(rows))
    left.bar(x - 0.3, [r["added_latency_ms_p50"] for r in rows], 0.2, label="per token, from send, p50")
    left.bar(x - 0.1, [r["added_latency_ms_p99"] for r in rows], 0.2, label="per token, from send, p99")
    token_paths = [r["pipeline"].get("token_path_ms", {}) for r in rows]
    left.bar(x + 0.1, [t.get("mean_ms", 0.0) for t in token_paths], 0.2, label="token path (hops), mean")
    left.bar(x + 0.3, [t.get("p99_sum_ms", 0.0) for t in token_paths], 0.2, label="token path (hops), p99s added")
    left.set(xticks=x, xticklabels=streams, xlabel="concurrent streams", ylabel="ms", title="latency the path adds")
    left.set_yscale("symlog")
    left.legend()
    right.bar(x - 0.2, [r["direct"]["tokens_per_s"] for r in rows], 0.4, label="direct echo socket")
    right.bar(x + 0.2, [r["pipeline"]["tokens_per_s"] for r in rows], 0.4, label="through Kafka + router")
    right.set(xticks=x, xticklabels=streams, xlabel="concurrent streams", ylabel="tokens/s", title="tokens delivered")
    right.legend()
    # Each hop's share of the hops' summed means, the sum written above its bar.
    means = {h: np.array([r["pipeline"].get("hops", {}).get(h, {}).get("mean_ms", 0.0) for r in rows])
             for h in dict.fromkeys(h for r in rows for h in r["pipeline"].get("hops", {}))}  # fmt: skip
    total = sum(means.values(), np.zeros(len(rows)))
    bottom = np.zeros(len(rows))
    for hop, ms in means.items():
        share = np.divide(100 * ms, total, out=np.zeros(len(rows)), where=total > 0)
        hops.bar(x, share, 0.5, bottom=bottom, label=hop)
        bottom += share
    for i, ms in enumerate(total):
        hops.text(x[i], 101, f"{ms:.0f} ms", ha="center", va="bottom", fontsize="small")
    hops.set(xticks=x, xticklabels=streams, xlabel="concurrent streams", ylabel="% of the hops' mean time", ylim=(0, 112),
             title="where the time goes, hop by hop")  # fmt: skip
    hops.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))  # in path order
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 100, 1000])
    parser.add_argument("--words", type=int, default=50, help="tokens per stream")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="echo model pace: one piece per step")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="rounds per stream count; each figure is their median")
    parser.add_argument("--event-loop", type=EventLoop, choices=list(EventLoop), default=EventLoop.UVLOOP,
                        help="the loop the fleet's services run on (the clients and the direct server stay on asyncio's)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=RESULTS / "pipeline.json")
    args = parser.parse_args()
    fleet, log_dir, layout = start_fleet(args.delay_ms, args.event_loop)
    try:
        rows = asyncio.run(measure(args, fleet.spec.chat_url(0), fleet_metrics_urls(fleet.spec)))
    finally:
        fleet.stop()
        drop_topics(layout)  # the broker keeps none of ours
    args.json.parent.mkdir(parents=True, exist_ok=True)
    command = "python loadtest/bench_pipeline.py " + " ".join(sys.argv[1:])
    result = {"command": command.strip(), "event_loop": args.event_loop, "delay_ms": args.delay_ms, "words": args.words}
    args.json.write_text(json.dumps(result | {"rows": rows}, indent=2))
    plot(rows, args.json.with_suffix(".png"))
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}; fleet logs in {log_dir}")


if __name__ == "__main__":
    main()
