"""One round of the disaggregation benchmark against a running fleet: streams that decode long,
a quiet stretch, then long prompts arriving at an interval while the streams run on; what every
chat received, when, and the workers' KV link counters around each phase.

Arrival times are when this process reads each frame (time.perf_counter), one event loop for all
chats. Once the last long prompt is done the streams are cancelled: what follows is not measured.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import disagg_metrics
from disagg_metrics import WorkerCounters
from disagg_prompts import long_prompt, stream_question

from shared.chat_client import ChatSocket
from shared.models.tokenizer import Tokenizer

DECODING_AFTER_TOKENS = 2  # the second token comes from the decode worker, once the handoff landed


@dataclass(frozen=True)
class Workload:
    streams: int
    max_tokens: int
    long_prompts: int
    long_tokens: int
    long_max_tokens: int
    long_interval_s: float
    baseline_s: float
    timeout_s: float


@dataclass
class ChatTrace:
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # one per token frame
    final: dict[str, Any] | None = None
    decoding: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def prompt_tokens(self) -> int | None:
        usage = (self.final or {}).get("usage")
        return usage["prompt_tokens"] if usage else None


@dataclass
class RoundTrace:
    streams: list[ChatTrace]
    longs: list[ChatTrace]
    started: float  # the first stream sent
    decoding: float  # every stream past its first token
    window: tuple[float, float]  # the first long prompt sent .. the last one done
    stream_handoffs: WorkerCounters  # the streams' handoffs (disaggregated)
    long_handoffs: WorkerCounters  # during the window: the long prompts'


async def _follow(sock: ChatSocket, chat_id: str, trace: ChatTrace, timeout_s: float) -> None:
    while trace.final is None:
        frame = await sock.next_frame(chat_id, timeout_s)
        now = time.perf_counter()
        if frame["type"] == "token":
            trace.arrivals.append(now)
            if len(trace.arrivals) == DECODING_AFTER_TOKENS:
                trace.decoding.set()
        elif frame["type"] in ("done", "error", "closed"):
            trace.final = frame
            trace.decoding.set()


def _chat(chat_id: str, max_tokens: int, **body: Any) -> dict[str, Any]:
    return {"type": "chat", "id": chat_id, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **body}


async def run_round(url: str, worker_ports: list[int], tokenizer: Tokenizer, work: Workload, tag: str) -> RoundTrace:
    prompts = [long_prompt(tokenizer, work.long_tokens, f"{tag}-{i}") for i in range(work.long_prompts)]
    sockets = list(await asyncio.gather(*(ChatSocket.open(url) for _ in range(work.streams + work.long_prompts))))
    followers: list[asyncio.Task] = []
    try:
        before = await asyncio.to_thread(disagg_metrics.scrape, worker_ports)
        streams = [ChatTrace() for _ in range(work.streams)]
        started = time.perf_counter()
        for i, (sock, trace) in enumerate(zip(sockets, streams)):
            trace.sent = time.perf_counter()
            await sock.send(_chat(f"s{i}", work.max_tokens, messages=[{"role": "user", "content": stream_question(i)}]))
            followers.append(asyncio.create_task(_follow(sock, f"s{i}", trace, work.timeout_s)))
        await asyncio.wait_for(asyncio.gather(*(t.decoding.wait() for t in streams)), work.timeout_s)
        decoding = time.perf_counter()
        ended = [t.final for t in streams if t.final is not None]
        if ended:
            raise RuntimeError(f"{len(ended)} stream(s) ended before the long prompts came, e.g. {ended[0]}")
        after_streams = await asyncio.to_thread(disagg_metrics.scrape, worker_ports)
        await asyncio.sleep(work.baseline_s)

        longs = [ChatTrace() for _ in prompts]
        window_start = time.perf_counter()
        for i, (sock, trace, prompt) in enumerate(zip(sockets[work.streams :], longs, prompts)):
            await asyncio.sleep(max(0.0, window_start + i * work.long_interval_s - time.perf_counter()))
            trace.sent = time.perf_counter()
            await sock.send(_chat(f"l{i}", work.long_max_tokens, prompt=prompt))
            followers.append(asyncio.create_task(_follow(sock, f"l{i}", trace, work.timeout_s)))
        await asyncio.wait_for(asyncio.gather(*followers[work.streams :]), work.timeout_s)
        window_end = max(t.arrivals[-1] if t.arrivals else t.sent for t in longs)
        after_longs = await asyncio.to_thread(disagg_metrics.scrape, worker_ports)

        for i, (sock, trace) in enumerate(zip(sockets, streams)):
            if trace.final is None:
                await sock.send({"type": "cancel", "id": f"s{i}"})
        await asyncio.wait_for(asyncio.gather(*followers[: work.streams]), work.timeout_s)
        return RoundTrace(
            streams, longs, started, decoding, (window_start, window_end),
            after_streams.minus(before), after_longs.minus(after_streams),
        )  # fmt: skip
    finally:
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        await asyncio.gather(*(s.close() for s in sockets), return_exceptions=True)
