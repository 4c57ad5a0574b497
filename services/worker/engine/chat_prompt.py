"""A request's chat prompt ids with its tools: shared/models/chat_prompt.py renders them, the same
function the edge counts prompts with."""

from __future__ import annotations

from services.worker.engine.types import EngineRequest
from shared.models.chat_prompt import chat_prompt_ids as render_chat_prompt
from shared.models.tokenizer import Tokenizer


def chat_prompt_ids(tokenizer: Tokenizer, request: EngineRequest) -> list[int]:
    """Template errors propagate (the caller rejects the request with them)."""
    return render_chat_prompt(tokenizer, request.messages, request.tools)
