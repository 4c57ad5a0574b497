"""The contract between the worker service and whatever generates text (echo, or the engine).

The service feeds requests in and turns each step's outputs into token events; an
engine never sees Kafka, and the service never sees tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.worker.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    tenant: str
    messages: list[dict[str, str]]  # [{"role": ..., "content": ...}]
    sampling: SamplingParams


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one request: new text, and how it ended if it did."""

    request_id: str
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | None while running
    usage: Usage | None = None  # set when finished
    error_code: str | None = None  # set when the request failed alone
    error_message: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error_code is not None


class RequestRejected(Exception):
    """A request that can never run here (e.g. longer than the context); it fails alone."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# Called by an engine with the requests it is about to compute for the first time,
# before it computes them: once it returns, the start is on record, so a request that
# takes the worker down with it is never run again elsewhere.
StartListener = Callable[[list[str]], None]


class GenerationEngine(Protocol):
    start_listener: StartListener | None

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; raises RequestRejected if it can never run."""

    def abort_request(self, request_id: str) -> StepOutput | None:
        """Stop a request and free its memory now; its final output, or None if unknown."""

    def step(self) -> list[StepOutput]:
        """Run one step over the current batch; outputs for the requests that made progress."""

    def has_unfinished_requests(self) -> bool: ...

    def request_ids(self) -> list[str]:
        """Every request the engine holds, running or waiting."""

    def load(self) -> dict[str, int | float]:
        """What the fleet should know of this engine's load (running, waiting, free KV blocks)."""
