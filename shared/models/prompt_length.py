"""Counts a chat's prompt (messages, or a raw prompt) the way the served model will, so an oversized one is
refused before it is queued."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.models.echo import count_prompt_pieces
from shared.models.raw_prompt import PromptInput, RawPrompt
from shared.models.spec import ModelSpec
from shared.models.tokenizer import Tokenizer, template_messages

PromptTokens = Callable[[PromptInput], list[int]]


@dataclass(frozen=True)
class PromptLimit:
    count: Callable[[PromptInput], int]
    context: int

    def excess(self, messages: PromptInput) -> str | None:
        """None if the prompt fits the model's context, else why it does not."""
        return self.measure(messages)[1]

    def measure(self, messages: PromptInput) -> tuple[int, str | None]:
        """The prompt's length, and why it does not fit the model's context (None if it does)."""
        length = self.count(messages)
        if length > self.context:
            return length, f"prompt is {length} tokens; the model's context holds {self.context}"
        return length, None


def prompt_tokens(spec: ModelSpec) -> PromptTokens | None:
    """The token ids a worker's engine makes of a chat (its chat template, tokenized; a raw prompt as
    services/worker/engine/prompt_ids.py makes it); None for the echo model."""
    if spec.is_echo:
        return None
    tokenizer = Tokenizer.from_folder(spec.tokenizer_folder)

    def tokens(prompt: PromptInput) -> list[int]:
        if isinstance(prompt, RawPrompt):
            return tokenizer.encode(prompt.text) if prompt.text is not None else list(prompt.token_ids or ())
        return tokenizer.apply_chat_template(template_messages(prompt))

    return tokens


def prompt_limit(spec: ModelSpec, tokens: PromptTokens | None = None) -> PromptLimit:
    """The echo model counts word pieces; real models count the chat template's tokens (`tokens`,
    when the caller has them already)."""
    if spec.is_echo:
        return PromptLimit(count_prompt_pieces, spec.max_model_len)
    count = tokens or prompt_tokens(spec)
    return PromptLimit(lambda messages: len(count(messages)), spec.max_model_len)
