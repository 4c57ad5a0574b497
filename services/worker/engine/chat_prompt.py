"""A chat's prompt ids with its tools: the template renders them where it can, else the Hermes format
(shared/models/tool_calls.py) carries tools, calls and results as plain turns."""

from __future__ import annotations

from services.worker.engine.types import EngineRequest
from shared.models.tokenizer import Tokenizer, template_messages
from shared.models.tool_calls import (
    hermes_messages,
    native_messages,
    renders_tools,
    tool_schemas,
)


def chat_prompt_ids(tokenizer: Tokenizer, request: EngineRequest) -> list[int]:
    """Template errors propagate (the caller rejects the request with them)."""
    messages = request.messages
    if not request.tools and not any(m.tool_calls or m.role == "tool" for m in messages):
        return tokenizer.apply_chat_template(template_messages(messages))
    if renders_tools(tokenizer.chat_template):
        tools = tool_schemas(request.tools) if request.tools else None
        return tokenizer.apply_chat_template(native_messages(messages), tools=tools)
    return tokenizer.apply_chat_template(hermes_messages(messages, request.tools))
