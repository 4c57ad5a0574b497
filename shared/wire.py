"""Typed, versioned messages of every internal wire (Kafka topics, router -> edge), encoded as msgpack.

Decoding validates: a message that does not fit its schema raises `WireError`, which
consumers turn into a dead-letter record instead of a crash. On Kafka each message
travels sealed (seal.py), on the router -> edge link in MAC'd frames (link_auth.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.codes import ErrorCode, FinishReason

WIRE_VERSION = 1

# A request's sampling limits and defaults, the same wherever one enters: the client protocol and this wire.
Role = Literal["system", "user", "assistant", "tool"]
DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 1.0
# Integers carry a range msgpack can hold (64 bits) and that makes sense: no stream is longer
# than MAX_STREAM_TOKENS (the edge caps `max_tokens` at the served model's context, too), so
# a seq, a `max_tokens` and a resume point all fit in 32 bits; a seed is any 64-bit value.
MAX_STREAM_TOKENS = 2**31 - 1
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_STREAM_TOKENS)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
LastSeq = Annotated[int, msgspec.Meta(ge=-1, le=MAX_STREAM_TOKENS)]  # -1: nothing received yet
Weight = Annotated[float, msgspec.Meta(gt=0.0, le=1000.0)]
# Sampling controls beyond temperature and top_p, with OpenAI's ranges (and vLLM's for its extras).
TopK = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # 0 = off
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=2.0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
StopStrings = Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]], msgspec.Meta(max_length=16)]
StopTokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=64)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
LogitBias = Annotated[dict[TokenId, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]], msgspec.Meta(max_length=300)]
Priority = Annotated[int, msgspec.Meta(ge=-1000, le=1000)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_STREAM_TOKENS)]  # tokens of one request, prompt or reply
# A raw prompt (a completion's): text, or token ids, fed to the model without the chat template.
PromptText = Annotated[str, msgspec.Meta(min_length=1)]
PromptTokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]


class WireError(ValueError):
    """A message that is not valid msgpack or does not match its schema."""


class ToolCall(msgspec.Struct, frozen=True):
    """A function call an assistant turn made (shared/models/tool_calls.py writes and reads them)."""

    id: str
    name: str
    arguments: str  # JSON text


class Message(msgspec.Struct, frozen=True, omit_defaults=True):  # a plain turn encodes as before
    role: Role
    content: str
    tool_calls: list[ToolCall] = []  # an assistant turn's calls
    tool_call_id: str = ""  # a tool turn: the call it answers


class Tool(msgspec.Struct, frozen=True):
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: str = "{}"  # its arguments' JSON schema, as JSON text


GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "lark"]


class Grammar(msgspec.Struct, frozen=True):
    """What the reply's text must match (shared/models/structured.py compiles it); the edge checked that it compiles."""

    kind: GrammarKind
    spec: str = ""  # the schema as JSON text, the regex, the choices as a JSON list, or a Lark grammar


class Controls(msgspec.Struct, frozen=True, omit_defaults=True):
    """Sampling controls beyond temperature, top_p and seed; all off by default."""

    top_k: TopK = 0
    stop: StopStrings = []  # the text ends before the first of these
    stop_token_ids: StopTokenIds = []
    ignore_eos: bool = False
    min_tokens: MaxTokens | Literal[0] = 0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    logit_bias: LogitBias = {}
    logprobs: TopLogprobs | None = None  # None: none; k: each token's and its k most likely alternatives'


class ChatRequest(msgspec.Struct, frozen=True, tag="chat"):
    """Edge -> worker, on the requests topic, keyed by request id."""

    request_id: str
    edge_id: str
    conn_id: str
    tenant: str
    messages: list[Message]
    max_tokens: MaxTokens = DEFAULT_MAX_TOKENS
    temperature: Temperature = DEFAULT_TEMPERATURE
    top_p: TopP = DEFAULT_TOP_P
    seed: Seed | None = None
    created_at: float = 0.0
    weight: Weight = 1.0  # the tenant's fair-share weight (its tier's)
    priority: Priority = 0  # within the tenant: lower runs first
    tier: str = ""  # the tenant's tier when admitted: its usage is priced at that tier's prices
    prompt_tokens: Count = 0  # the prompt as the edge counted it: a usage record's, when the engine's is lost
    controls: Controls = Controls()
    grammar: Grammar | None = None  # structured output: the reply's text matches it
    tools: list[Tool] = []  # rendered into the prompt; a forced call comes as `grammar`
    prompt: PromptText | PromptTokenIds | None = None  # set: a raw prompt, and `messages` is empty
    v: int = WIRE_VERSION

    def __post_init__(self) -> None:
        if self.prompt is not None and self.messages:
            raise ValueError("a chat request carries either messages or a raw prompt, not both")


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """Edge -> all workers, on the control topic: stop these requests and free their memory.

    `epoch` is the route epoch the edge knew: a stream resumed since (a higher epoch)
    belongs to another connection now and is not cancelled.
    """

    request_ids: list[str]
    epoch: int = 0
    v: int = WIRE_VERSION


class Resume(msgspec.Struct, frozen=True, tag="resume"):
    """Edge -> all workers: the request's stream now goes to this connection, from `from_seq` on.

    `old_edge_id`/`old_conn_id`: where it went before, told at once that it moved (empty: unknown).
    """

    request_id: str
    epoch: int
    edge_id: str
    conn_id: str
    from_seq: int
    old_edge_id: str = ""
    old_conn_id: str = ""
    v: int = WIRE_VERSION


Control = Cancel | Resume


# Token-path events. Every event of a request carries a seq: tokens 0..n-1, then one
# terminal event (done or error) at seq n, so an edge can order and de-duplicate all of them.
# Events outside that order (a start, an error raised by someone other than the running
# worker) carry OUT_OF_BAND: they take effect on arrival.
OUT_OF_BAND = -1


class Started(msgspec.Struct, frozen=True, tag="started", array_like=True):
    """A worker began computing the request: from here on, only this worker may run it."""

    request_id: str
    seq: int
    worker_id: str


class Logprob(msgspec.Struct, frozen=True, array_like=True):
    """A generated token's text and log-probability, and its most likely alternatives'."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = []


class Token(msgspec.Struct, frozen=True, tag="token", array_like=True):
    request_id: str
    seq: int
    text: str


class LoggedToken(Token, frozen=True, tag="logged-token", array_like=True):
    """A token of a request that asked for logprobs: a token event, and the logprobs of the tokens
    behind its text. Its own tag, so a plain token stays the four fields it always was."""

    logprobs: list[Logprob] = []


class Usage(msgspec.Struct, frozen=True, array_like=True):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Done(msgspec.Struct, frozen=True, tag="done", array_like=True):
    request_id: str
    seq: int
    finish_reason: FinishReason
    usage: Usage


class Error(msgspec.Struct, frozen=True, tag="error", array_like=True):
    request_id: str
    seq: int
    code: ErrorCode
    message: str
    retryable: bool

    @classmethod
    def of(cls, request_id: str, code: ErrorCode, message: str, seq: int = OUT_OF_BAND) -> Error:
        """An error whose `retryable` is the code's own."""
        return cls(request_id, seq, code, message, code.retryable)


class Moved(msgspec.Struct, frozen=True, tag="moved", array_like=True):
    """The stream was resumed at `epoch` on another connection. Addressed to the connection that
    lost it (`conn_id`, on the batch's edge), not through the route, which names the new one."""

    request_id: str
    seq: int
    conn_id: str
    epoch: int


class HandedOff(msgspec.Struct, frozen=True, tag="handed-off", array_like=True):
    """The running worker moved the request, KV cache and all, to `worker_id` (a prefill worker
    to a decode worker): from here on only that worker may add to the stream. Sent by the worker
    handing it off, before the new one says anything, on the same partition as the stream."""

    request_id: str
    seq: int
    worker_id: str


Event = Started | Token | LoggedToken | Done | Error | Moved | HandedOff


class TokenBatch(msgspec.Struct, frozen=True, tag="tokens"):
    """Worker -> routers: all of one engine step's events for one edge, in one message."""

    edge_id: str
    worker_id: str
    events: list[Event]
    sent_at: float = 0.0
    epochs: dict[str, int] = {}  # route epoch of resumed requests; absent means 0
    v: int = WIRE_VERSION


class Delivery(msgspec.Struct, frozen=True, array_like=True):
    """One event for one connection, and the worker whose sealed batch carried it."""

    conn_id: str
    event: Event
    worker_id: str = ""


class ForwardBatch(msgspec.Struct, frozen=True, tag="forward"):
    """Router -> edge over the internal connection: events resolved to their connections."""

    deliveries: list[Delivery]
    v: int = WIRE_VERSION
    sent_at: float = 0.0  # when the router wrote it (unix seconds), for the edge's link timing; 0: untimed


BlockKey = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # the first 63 bits of a block hash (block_hash.py)


class KvEvents(msgspec.Struct, frozen=True, tag="kv-events"):
    """Worker -> every edge, on the kv-events topic, keyed by worker: what entered and left its
    prefix cache since its last record. `cleared`: everything it held before is gone (applied first)."""

    worker_id: str
    block_size: Annotated[int, msgspec.Meta(ge=1, le=2**16)]
    stored: list[BlockKey] = []
    evicted: list[BlockKey] = []
    cleared: bool = False
    v: int = WIRE_VERSION


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | None, kind: type) -> msgspec.Struct:
    """Decode and validate; any malformed input (a null record too) becomes a WireError with the reason."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        message = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(str(exc)) from exc
    if message.v != WIRE_VERSION:
        raise WireError(f"unsupported wire version {message.v}")
    return message


class DeadLetter(msgspec.Struct, frozen=True, tag="dead-letter"):
    """A message a consumer could not use, parked with the reason instead of retried forever."""

    source_topic: str
    partition: int
    offset: int
    consumer: str
    reason: str
    payload: bytes
    v: int = WIRE_VERSION


class UsageRecord(msgspec.Struct, frozen=True, tag="usage"):
    """What one finished request used, on the usage topic, keyed by request id; one per request
    as the aggregate counts it (it dedupes by request id). `reporter` measured it and sealed it:
    the worker that ended the stream, or the edge that saw that worker die mid-stream.
    Exactly one of `finish_reason` (done or cancelled) and `error` (ended by a failure) is set."""

    request_id: str
    tenant: str
    tier: str
    prompt_tokens: Count
    cached_tokens: Count
    completion_tokens: Count
    reporter: str
    worker_id: str
    created_at: float  # when the edge admitted it (unix seconds)
    finished_at: float  # when it ended; its hour is the counters' bucket
    finish_reason: FinishReason | None = None
    error: ErrorCode | None = None
    v: int = WIRE_VERSION
