"""Counts a chat's prompt (messages with the tools they offer, or a raw prompt) the way the served model
will, so an oversized one is refused before it is queued."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.models.chat_prompt import chat_prompt_ids
from shared.models.echo import count_prompt_pieces
from shared.models.raw_prompt import PromptInput, RawPrompt
from shared.models.spec import ModelSpec
from shared.models.tokenizer import Tokenizer
from shared.models.tool_calls import FunctionTool


class PromptTokens(Protocol):
    """The token ids of a prompt; `tools` are listed in a chat's prompt (a raw prompt has none)."""

    def __call__(self, prompt: PromptInput, tools: Sequence[FunctionTool] = ()) -> list[int]: ...


class PromptCount(Protocol):
    def __call__(self, prompt: PromptInput, tools: Sequence[FunctionTool] = ()) -> int: ...


@dataclass(frozen=True)
class PromptLimit:
    count: PromptCount
    context: int

    def excess(self, messages: PromptInput, tools: Sequence[FunctionTool] = ()) -> str | None:
        """None if the prompt fits the model's context, else why it does not."""
        return self.measure(messages, tools)[1]

    def measure(self, messages: PromptInput, tools: Sequence[FunctionTool] = ()) -> tuple[int, str | None]:
        """The prompt's length, tool listing included, and why it does not fit the model's context (None if it does)."""
        length = self.count(messages, tools)
        if length > self.context:
            return length, f"prompt is {length} tokens; the model's context holds {self.context}"
        return length, None


def prompt_tokens(spec: ModelSpec) -> PromptTokens | None:
    """The token ids a worker's engine makes of a chat (its chat template, tokenized; a raw prompt as
    services/worker/engine/prompt_ids.py makes it); None for the echo model."""
    if spec.is_echo:
        return None
    tokenizer = Tokenizer.from_folder(spec.tokenizer_folder)

    def tokens(prompt: PromptInput, tools: Sequence[FunctionTool] = ()) -> list[int]:
        if isinstance(prompt, RawPrompt):  # fed as it is: no template, so no tool listing either
            return tokenizer.encode(prompt.text) if prompt.text is not None else list(prompt.token_ids or ())
        return chat_prompt_ids(tokenizer, prompt, tools)  # type: ignore[arg-type]  # turns as the wire carries them

    return tokens


def prompt_limit(spec: ModelSpec, tokens: PromptTokens | None = None) -> PromptLimit:
    """The echo model counts word pieces; real models count the chat template's tokens (`tokens`,
    when the caller has them already)."""
    if spec.is_echo:
        return PromptLimit(count_prompt_pieces, spec.max_model_len)
    count = tokens or prompt_tokens(spec)
    assert count is not None  # not the echo model

    def length(prompt: PromptInput, tools: Sequence[FunctionTool] = ()) -> int:
        return len(count(prompt, tools))

    return PromptLimit(length, spec.max_model_len)
