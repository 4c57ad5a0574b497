"""Building a finished request's usage record, the same for every reporter: pure, no Kafka.

Who reports: the worker, for every stream it ends (done, cancelled, or a failure after tokens
went out), with the engine's exact counts when it has them; the edge, for a stream whose worker
died after delivering tokens, with the tokens it delivered and the prompt as it counted it.
A request that ends before any token went out and with nothing counted is not billed.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared import wire
from shared.codes import ErrorCode, FinishReason


@dataclass(frozen=True)
class UsageContext:
    """What a usage record needs to know of its request besides the counts."""

    tenant: str
    tier: str
    prompt_tokens: int = 0  # as the edge counted it: the record's when the engine's count is lost
    created_at: float = 0.0

    @classmethod
    def of(cls, chat: wire.ChatRequest) -> UsageContext:
        return cls(chat.tenant, chat.tier, chat.prompt_tokens, chat.created_at)


def usage_record(
    request_id: str,
    context: UsageContext,
    reporter: str,
    worker_id: str,
    finished_at: float,
    usage: wire.Usage | None = None,
    tokens_sent: int = 0,
    finish_reason: FinishReason | None = None,
    error: ErrorCode | None = None,
) -> wire.UsageRecord | None:
    """The record of a request that ended with `finish_reason` or with `error` (exactly one).

    `usage`: the engine's counts, exact; without them, the prompt is the edge's count, none of
    it cached, and the reply is the `tokens_sent` tokens that went out. None: nothing to bill,
    either a failure before any token went out, or a request that ended with nothing counted.
    """
    if (finish_reason is None) == (error is None):
        raise ValueError("a usage record has a finish reason or an error, not both or neither")
    if error is not None and tokens_sent == 0:
        return None  # nobody got a token: a failed request is not billed
    if usage is not None:
        prompt, cached, completion = usage.prompt_tokens, min(usage.cached_tokens, usage.prompt_tokens), usage.completion_tokens
    else:
        prompt, cached, completion = context.prompt_tokens, 0, tokens_sent
    if not (prompt or completion):
        return None
    return wire.UsageRecord(
        request_id=request_id,
        tenant=context.tenant,
        tier=context.tier,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        reporter=reporter,
        worker_id=worker_id,
        created_at=context.created_at,
        finished_at=finished_at,
        finish_reason=finish_reason,
        error=error,
    )


def record_problem(record: wire.UsageRecord) -> str | None:
    """Why the aggregate cannot count this record (it is dead-lettered), or None."""
    if not record.tenant or "{" in record.tenant or "}" in record.tenant:
        return f"tenant {record.tenant[:64]!r} cannot be a counter key's hash tag"
    if (record.finish_reason is None) == (record.error is None):
        return "a usage record has a finish reason or an error, not both or neither"
    if record.cached_tokens > record.prompt_tokens:
        return f"{record.cached_tokens} cached prompt tokens of {record.prompt_tokens}"
    return None
