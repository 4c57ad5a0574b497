"""Words that cross every boundary: how a stream ends, and why a client was refused or a stream failed.

StrEnums, so the wire schema and the client protocol validate them, and code compares them
with plain strings as the JSON does. docs/errors.md says what an operator does about each.
"""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


class ErrorCode(StrEnum):
    # Refused at the edge; the socket stays open.
    INVALID_JSON = "invalid_json"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_MESSAGE = "invalid_message"
    DUPLICATE_ID = "duplicate_id"
    UNKNOWN_ID = "unknown_id"
    TOO_MANY_CHATS = "too_many_chats"
    PROMPT_TOO_LONG = "prompt_too_long"
    INVALID_SCHEMA = "invalid_schema"  # a response format or tool the grammar library cannot compile
    UNAVAILABLE = "unavailable"
    RESUME_REFUSED = "resume_refused"
    STREAM_MOVED = "stream_moved"  # another socket resumed this stream: it goes on there, not here
    EDGE_DRAINING = "edge_draining"  # this edge is stopping: open a socket to another one
    INVALID_API_KEY = "invalid_api_key"  # HTTP 401 at the handshake, never a frame
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"  # HTTP 403 at the handshake, never a frame
    TOO_MANY_HANDSHAKES = "too_many_handshakes"  # HTTP 429 at the handshake, never a frame
    FRAME_RATE_EXCEEDED = "frame_rate_exceeded"  # close code 1008, never a frame
    # Refused by tenancy: the fleet is full for the tenant's tier, or the tenant is over a limit.
    OVERLOADED = "overloaded"  # with retry_after_ms (HTTP 429 + Retry-After)
    RATE_LIMITED = "rate_limited"  # over requests/min or tokens/min; with retry_after_ms
    TOO_MANY_STREAMS = "too_many_streams"  # the tenant's concurrent-stream cap, over all edges
    TOO_MANY_CONNECTIONS = "too_many_connections"  # the tenant's connection cap: HTTP 429 at the handshake
    # Refused by a worker, or a stream that failed.
    INVALID_REQUEST = "invalid_request"
    ENGINE_ERROR = "engine_error"
    WORKER_LOST = "worker_lost"
    WORKER_DRAINING = "worker_draining"  # its worker was stopping and could not finish it in time
    NO_WORKER = "no_worker"
    REQUEST_QUARANTINED = "request_quarantined"

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed if the client sends it again."""
        return self in _RETRYABLE


_RETRYABLE = frozenset(
    {
        ErrorCode.TOO_MANY_CHATS,
        ErrorCode.TOO_MANY_HANDSHAKES,
        ErrorCode.OVERLOADED,
        ErrorCode.RATE_LIMITED,
        ErrorCode.TOO_MANY_STREAMS,
        ErrorCode.TOO_MANY_CONNECTIONS,
        ErrorCode.UNAVAILABLE,
        ErrorCode.EDGE_DRAINING,
        ErrorCode.WORKER_LOST,
        ErrorCode.WORKER_DRAINING,
        ErrorCode.NO_WORKER,
    }
)


# What an error says names what was wrong and may quote the client's value, but never grows with
# what was sent: a 100 kB model name or enum value comes back cut short, not whole.
MAX_ERROR_MESSAGE_CHARS = 1_000


def clipped(message: str) -> str:
    """`message`, cut to MAX_ERROR_MESSAGE_CHARS (an ellipsis marking the cut) where it is longer."""
    if len(message) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    return message[: MAX_ERROR_MESSAGE_CHARS - 1] + "…"
