"""A raw prompt: text or token ids fed to the model as they are, without the chat template.

What `/v1/completions` sends. Edges count it and workers feed it through the same type, so
the count the edge admits by is the count the engine computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.models.tokenizer import ChatTurn


@dataclass(frozen=True)
class RawPrompt:
    """Exactly one of `text` (tokenized with the tokenizer's special tokens, as vLLM does) and `token_ids`."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a raw prompt is either text or token ids")

    @classmethod
    def of(cls, value: str | Sequence[int]) -> RawPrompt:
        """The wire's `prompt` field (a string or a list of token ids) as a raw prompt."""
        return cls(text=value) if isinstance(value, str) else cls(token_ids=tuple(value))


# What a worker computes a reply from, and an edge counts: chat messages, or a raw prompt.
PromptInput = Sequence[ChatTurn] | RawPrompt
