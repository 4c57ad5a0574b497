"""The echo model: a GenerationEngine that replies with the last user message, one word piece per step.

It costs no compute, so the pipeline's own overhead (Kafka, routing, sockets) can be tested and
measured alone. Its pieces and its prompt counting are the edge's too (shared/models/echo.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from services.worker.engine.types import (
    EngineLoad,
    EngineOutput,
    EngineRequest,
    FailureCode,
    FinishReason,
    Logprob,
    RequestRejected,
    StartListener,
    Usage,
)
from shared.models.echo import CONTEXT_PIECES, count_prompt_pieces, reply_pieces


def next_step_end(last_end: float, now: float, delay_s: float, stepping: bool) -> float:
    """When a step started at `now` ends. Steps keep to a fixed pace, like a model whose step takes
    `delay_s` with nothing between steps: while streams run, each step ends one delay after the
    last, the time spent around steps absorbed (added on top, it would push every later token of
    every stream back, step after step). The first step after an idle spell, or after a stall
    longer than a step, takes a whole delay from now."""
    due = last_end + delay_s
    return due if stepping and due > now else now + delay_s


@dataclass
class _EchoStream:
    pieces: list[str]
    prompt_pieces: int
    max_tokens: int
    logprobs: int | None = None  # asked for: each piece is certain (logprob 0), its only likely alternative itself
    sent: int = 0
    started: bool = False

    def logprobs_of(self, piece: str) -> tuple[Logprob, ...]:
        if self.logprobs is None or not piece:
            return ()
        return (Logprob(piece, 0.0, ((piece, 0.0),) if self.logprobs else ()),)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_pieces, cached_tokens=0, completion_tokens=self.sent)


class EchoEngine:
    """Every step emits the next piece of each running reply."""

    def __init__(self, delay_ms: float = 0.0, crash_on: str = "", context: int = CONTEXT_PIECES, max_running: int = 0) -> None:
        self.delay_s = delay_ms / 1000.0
        self.context = context
        self.max_running = max_running  # 0: every request runs at once
        self._crash_on = crash_on  # fault tests: a "poison" message that kills the process
        self._next_step_at = 0.0
        self._stepping = False  # the last step left streams running: the next one keeps its pace
        self._streams: dict[str, _EchoStream] = {}
        self._steps = 0
        self.start_listener: StartListener | None = None
        self.kv_listener = None  # no KV cache: nothing to tell

    def add_request(self, request: EngineRequest) -> None:
        prompt = request.prompt if request.prompt is not None else request.messages
        prompt_pieces = count_prompt_pieces(prompt, request.tools)  # as the edge counted it
        if prompt_pieces > self.context:
            raise RequestRejected(
                FailureCode.PROMPT_TOO_LONG, f"prompt has {prompt_pieces} pieces; the context holds {self.context}"
            )
        self._streams[request.request_id] = _EchoStream(
            reply_pieces(prompt), prompt_pieces, request.sampling.max_tokens, request.sampling.logprobs
        )

    def abort_request(self, request_id: str) -> EngineOutput | None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return None
        return EngineOutput(request_id, finish_reason=FinishReason.CANCELLED, usage=stream.usage())

    def step(self) -> list[EngineOutput]:
        if self.delay_s:
            now = time.perf_counter()
            self._next_step_at = next_step_end(self._next_step_at, now, self.delay_s, self._stepping)
            time.sleep(self._next_step_at - now)
        self._steps += 1
        self._announce_starts()
        outputs = []
        for request_id, stream in self._running():
            text, finish = "", FinishReason.STOP
            if stream.sent < len(stream.pieces):
                text = stream.pieces[stream.sent]
                stream.sent += 1
                finish = None
                if stream.sent >= len(stream.pieces):
                    finish = FinishReason.STOP
                elif stream.sent >= stream.max_tokens:
                    finish = FinishReason.LENGTH
            logprobs = stream.logprobs_of(text)
            if finish is None:
                outputs.append(EngineOutput(request_id, text, logprobs=logprobs))
            else:
                del self._streams[request_id]
                outputs.append(EngineOutput(request_id, text, finish_reason=finish, usage=stream.usage(), logprobs=logprobs))
        self._stepping = bool(self._streams)
        return outputs

    def _running(self) -> list[tuple[str, _EchoStream]]:
        """The oldest `max_running` requests run; the rest wait, not yet started."""
        streams = list(self._streams.items())
        return streams[: self.max_running] if self.max_running else streams

    def _announce_starts(self) -> None:
        new = [request_id for request_id, stream in self._running() if not stream.started]
        if new and self.start_listener is not None:
            self.start_listener(new)
        for request_id in new:
            stream = self._streams[request_id]
            stream.started = True
            if self._crash_on and "".join(stream.pieces) == self._crash_on:
                os._exit(70)  # as a segfault in a kernel would: no cleanup, no goodbye

    def has_unfinished_requests(self) -> bool:
        return bool(self._streams)

    def request_ids(self) -> list[str]:
        return list(self._streams)

    def load(self) -> EngineLoad:
        streams = list(self._streams.values())  # one read: the engine thread changes the dict
        running = min(len(streams), self.max_running) if self.max_running else len(streams)
        waiting_tokens = sum(s.prompt_pieces for s in streams[running:])
        return EngineLoad(
            running=running, waiting=len(streams) - running, steps=self._steps,
            max_running=self.max_running, waiting_tokens=waiting_tokens,
        )
