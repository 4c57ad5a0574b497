"""The `logprobs` object of OpenAI's legacy completions (/v1/completions): each generated token, its
log-probability, its likeliest alternatives as a token -> logprob dict, and where its text starts.

Offsets count from the start of the choice's `text` (the completion; `echo` with logprobs is refused,
so no prompt text comes before it) and run on across a stream's chunks. Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.edge.protocol import LogprobBody

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on this endpoint's integer `logprobs`


@dataclass
class CompletionLogprobs:
    """One choice's logprobs, in order; `take` is called once per chunk (or once, for a whole body)."""

    offset: int = 0  # where the next token's text starts in the choice's text

    def take(self, logprobs: Sequence[LogprobBody]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top_logprobs: list[dict[str, float]] = []
        text_offset: list[int] = []
        for lp in logprobs:
            tokens.append(lp.token)
            token_logprobs.append(lp.logprob)
            top_logprobs.append(top_dict(lp.top_logprobs))
            text_offset.append(self.offset)
            self.offset += len(lp.token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}  # fmt: skip


def top_dict(alternatives: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Alternatives likeliest first; two ids that decode to the same text keep the likelier one's value
    (a dict has one entry per text, as OpenAI's shape has)."""
    top: dict[str, float] = {}
    for token, logprob in alternatives:
        top.setdefault(token, logprob)
    return top
