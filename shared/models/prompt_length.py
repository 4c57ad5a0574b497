"""Counts a chat's prompt the way the served model will, so an oversized one is refused before it is queued."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.models.echo import count_prompt_pieces
from shared.models.spec import ModelSpec
from shared.models.tokenizer import ChatTurn, Tokenizer, template_messages


@dataclass(frozen=True)
class PromptLimit:
    count: Callable[[Sequence[ChatTurn]], int]
    context: int

    def excess(self, messages: Sequence[ChatTurn]) -> str | None:
        """None if the prompt fits the model's context, else why it does not."""
        length = self.count(messages)
        if length > self.context:
            return f"prompt is {length} tokens; the model's context holds {self.context}"
        return None


def prompt_limit(spec: ModelSpec) -> PromptLimit:
    """The echo model counts word pieces; real models count the chat template's tokens."""
    if spec.is_echo:
        return PromptLimit(count_prompt_pieces, spec.max_model_len)
    tokenizer = Tokenizer.from_folder(spec.tokenizer_folder)
    return PromptLimit(lambda messages: len(tokenizer.apply_chat_template(template_messages(messages))), spec.max_model_len)
