"""Counts a chat's prompt the way the served model will, so an oversized one never reaches Kafka."""

from __future__ import annotations

from collections.abc import Callable

Messages = list[dict[str, str]]


class PromptLimit:
    def __init__(self, count: Callable[[Messages], int], context: int) -> None:
        self._count = count
        self.context = context

    def excess(self, messages: Messages) -> str | None:
        """None if the prompt fits the model's context, else why it does not."""
        length = self._count(messages)
        if length > self.context:
            return f"prompt is {length} tokens; the model's context holds {self.context}"
        return None


def prompt_limit_for(model: str, max_model_len: int = 0) -> PromptLimit:
    """The echo model counts word pieces; real models count tokens of the chat template,
    against the same limit the workers' engines hold requests to."""
    if model == "echo":
        from services.worker.echo import CONTEXT_PIECES, count_prompt_pieces

        return PromptLimit(count_prompt_pieces, CONTEXT_PIECES)
    from services.worker.engine.engine import DEFAULT_MAX_MODEL_LEN
    from services.worker.engine.weights import load_tokenizer_and_config

    tokenizer, config = load_tokenizer_and_config(model)
    context = max_model_len or min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    return PromptLimit(lambda messages: len(tokenizer.apply_chat_template(messages)), context)
