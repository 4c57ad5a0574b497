"""The echo model: replies with the last user message, one word piece per step.

It costs no compute, so the pipeline's own overhead (Kafka, routing, sockets) can be
tested and measured alone. Each piece is a word with its trailing whitespace, so the
pieces of a reply concatenate to the message exactly.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from services.worker.generation import (
    GenerationRequest,
    RequestRejected,
    StartListener,
    StepOutput,
    Usage,
)

CONTEXT_PIECES = 8192
_PIECE = re.compile(r"\s*\S+\s*")


def split_pieces(text: str) -> list[str]:
    pieces = _PIECE.findall(text)
    return pieces or ([text] if text else [])


def count_prompt_pieces(messages: list[dict[str, str]]) -> int:
    return sum(len(split_pieces(m["content"])) for m in messages)


@dataclass
class _EchoStream:
    pieces: list[str]
    prompt_pieces: int
    max_tokens: int
    sent: int = 0
    started: bool = False

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_pieces, cached_tokens=0, completion_tokens=self.sent)


class EchoEngine:
    """A GenerationEngine whose every step emits the next piece of each running reply."""

    def __init__(self, delay_ms: float = 0.0, crash_on: str = "") -> None:
        self.delay_s = delay_ms / 1000.0
        self._crash_on = crash_on  # fault tests: a "poison" message that kills the process
        self._next_step_at = 0.0
        self._streams: dict[str, _EchoStream] = {}
        self.start_listener: StartListener | None = None

    def add_request(self, request: GenerationRequest) -> None:
        prompt_pieces = count_prompt_pieces(request.messages)
        if prompt_pieces > CONTEXT_PIECES:
            raise RequestRejected(
                "prompt_too_long", f"prompt has {prompt_pieces} pieces; the context holds {CONTEXT_PIECES}"
            )
        last_user = next((m["content"] for m in reversed(request.messages) if m["role"] == "user"), "")
        self._streams[request.request_id] = _EchoStream(
            split_pieces(last_user), prompt_pieces, request.sampling.max_tokens
        )

    def abort_request(self, request_id: str) -> StepOutput | None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return None
        return StepOutput(request_id, finish_reason="cancelled", usage=stream.usage())

    def step(self) -> list[StepOutput]:
        if self.delay_s:
            # Steps keep to a fixed pace, like a model whose step takes `delay_ms`:
            # the time spent around a step is absorbed, not added on top.
            now = time.perf_counter()
            self._next_step_at = max(now, self._next_step_at) + self.delay_s
            time.sleep(self._next_step_at - now)
        self._announce_starts()
        outputs = []
        for request_id, stream in list(self._streams.items()):
            if stream.sent >= len(stream.pieces):
                finish = "stop"
                text = ""
            else:
                text = stream.pieces[stream.sent]
                stream.sent += 1
                finish = None
                if stream.sent >= len(stream.pieces):
                    finish = "stop"
                elif stream.sent >= stream.max_tokens:
                    finish = "length"
            if finish is None:
                outputs.append(StepOutput(request_id, text))
            else:
                del self._streams[request_id]
                outputs.append(StepOutput(request_id, text, finish_reason=finish, usage=stream.usage()))
        return outputs

    def _announce_starts(self) -> None:
        new = [request_id for request_id, stream in self._streams.items() if not stream.started]
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

    def load(self) -> dict[str, int | float]:
        return {"running": len(self._streams), "waiting": 0}
