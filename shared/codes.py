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
    UNAVAILABLE = "unavailable"
    RESUME_REFUSED = "resume_refused"
    INVALID_API_KEY = "invalid_api_key"  # HTTP 401 at the handshake, never a frame
    # Refused by a worker, or a stream that failed.
    INVALID_REQUEST = "invalid_request"
    ENGINE_ERROR = "engine_error"
    WORKER_LOST = "worker_lost"
    NO_WORKER = "no_worker"
    REQUEST_QUARANTINED = "request_quarantined"

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed if the client sends it again."""
        return self in _RETRYABLE


_RETRYABLE = frozenset({ErrorCode.TOO_MANY_CHATS, ErrorCode.UNAVAILABLE, ErrorCode.WORKER_LOST, ErrorCode.NO_WORKER})
