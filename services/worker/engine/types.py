"""The engine's API: what goes in (a request), what comes out (each step's output per request), how a
request ends, and how an engine reports its load. Torch-free, and knows no Kafka: the worker service
converts these to and from its wire messages in one place (services/worker/convert.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from services.worker.engine.block_pool import KVCacheListener
from services.worker.engine.sampling_params import SamplingParams
from shared.models.raw_prompt import RawPrompt


class FinishReason(StrEnum):
    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context
    CANCELLED = "cancelled"  # aborted: the client cancelled or went away


class FailureCode(StrEnum):
    """Why one request failed alone (the others in its batch go on)."""

    INVALID_REQUEST = "invalid_request"  # it can never run: its messages do not fit the chat template
    PROMPT_TOO_LONG = "prompt_too_long"  # its prompt (plus max_tokens) does not fit the context or the KV pool
    ENGINE_ERROR = "engine_error"  # computing it raised


@dataclass(frozen=True)
class Failure:
    code: FailureCode
    message: str


class RequestRejected(Exception):
    """A request that can never run here; raised by `add_request`, for that request only."""

    def __init__(self, code: FailureCode, message: str) -> None:
        super().__init__(message)
        self.failure = Failure(code, message)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str = ""  # a tool turn: the call it answers


@dataclass(frozen=True)
class Tool:
    """A function the prompt offers the model."""

    name: str
    description: str = ""
    parameters: str = "{}"  # JSON schema text


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` and `spec` as shared/models/structured.py reads them."""

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    tenant: str
    messages: Sequence[Message]
    sampling: SamplingParams
    weight: float = 1.0  # the tenant's share of the engine against other tenants (fair share)
    priority: int = 0  # among the tenant's own waiting requests, lower first
    prompt: RawPrompt | None = None  # set: fed to the model as it is, without the chat template; messages empty
    constraint: Constraint | None = None  # structured output: decoding keeps to this grammar
    tools: tuple[Tool, ...] = ()  # rendered into the prompt
    handoff: bool = False  # stop once the first token is sampled, holding the KV for another engine (HandoffReady)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Logprob:
    """One generated token's text and log-probability, and its most likely alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    """How an engine's KV cache is laid out: per layer, K and V pools of (blocks, block_size,
    num_kv_heads, head_dim). Two engines can exchange blocks only if theirs are equal."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def block_bytes(self) -> int:
        """One block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * _ELEMENT_BYTES[self.dtype]


@dataclass(frozen=True)
class HandoffReady:
    """A request parked after its prefill (EngineRequest.handoff): everything another engine
    needs to run it on, its KV aside, which is read block by block (the engine's read_kv_layer)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # the first token
    cached_tokens: int  # of the prompt, served from this engine's prefix cache
    block_ids: tuple[int, ...]  # this engine's blocks holding the prompt's KV, in position order
    layout: KVLayout


@dataclass(frozen=True)
class EngineOutput:
    """What one step did for one request: new text, and how it ended if it did."""

    request_id: str
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # set when it finished or failed
    failure: Failure | None = None
    # Of the tokens this step generated, when the request asked; their text may be held back
    # (a possible stop string) and come in a later output.
    logprobs: tuple[Logprob, ...] = ()
    handoff: HandoffReady | None = None  # set: parked for a handoff; the engine holds its KV until released or resumed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.failure is not None


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of what the engine holds and has done; plain reads, safe from another thread."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # share of KV cache blocks in use
    free_kv_blocks: int = 0
    prefix_hit_rate: float = 0.0  # prompt tokens served from the prefix cache
    steps: int = 0
    graph_steps: int = 0  # steps whose model ran as one compiled (CPU) or captured (CUDA) graph
    preemptions: int = 0
    isolated_failures: int = 0  # batched steps that raised and were re-run request by request
    # Capacity, for the edges' admission: 0 where the engine has no such bound.
    max_running: int = 0  # requests it runs at once
    waiting_tokens: int = 0  # tokens still to compute of the requests waiting to run
    kv_tokens: int = 0  # the KV cache pool, in tokens


class StartListener(Protocol):
    """Told the requests an engine is about to compute for the first time, before it computes them:
    once it returns, the start is on record, so a request that takes the process down with it is
    never run again elsewhere."""

    def __call__(self, request_ids: list[str]) -> None: ...


class GenerationEngine(Protocol):
    """What the worker service drives: the model engine, or the echo model."""

    start_listener: StartListener | None
    kv_listener: KVCacheListener | None  # told of prefix-cache stores and evictions; an engine without a cache never calls it

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises RequestRejected if it can never run."""

    def abort_request(self, request_id: str) -> EngineOutput | None:
        """Stop a request and free its memory now; its final output, or None if unknown."""

    def step(self) -> list[EngineOutput]:
        """Run one step over the current batch; outputs for the requests that made progress (overlapped
        on a GPU: the outputs of the step launched before, as the next one runs)."""

    def has_unfinished_requests(self) -> bool: ...

    def request_ids(self) -> list[str]:
        """Every request the engine holds, running or waiting."""

    def load(self) -> EngineLoad: ...


@runtime_checkable
class HandoffEngine(Protocol):
    """An engine whose requests can move to another engine after their prefill (kv_handoffs.py):
    the model engine. A prefill or decode worker needs one."""

    @property
    def kv_layout(self) -> KVLayout: ...

    def read_kv_layer(self, request_id: str, layer: int, first_block: int) -> tuple[bytes, bytes]: ...

    def write_kv_layer(self, request_id: str, layer: int, k: bytes, v: bytes) -> None: ...

    def release_handoff(self, request_id: str) -> None: ...

    def resume_handoff(self, request_id: str) -> bool: ...

    def reserve_import(self, request: EngineRequest, prompt_token_ids: list[int], output_token_ids: list[int]) -> int | None: ...

    def commit_import(self, request_id: str, cached_tokens: int) -> None: ...

    def cancel_import(self, request_id: str) -> None: ...
