"""A chat's prompt with its tools, as the model reads it: the template renders the tools where it can,
else the Hermes format (tool_calls.py) carries tools, calls and results as plain turns.

Workers compute these ids and edges count them with the same function, so a prompt the edge admits
is the prompt the engine computes, tool listing included.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.models.tokenizer import Tokenizer, template_messages
from shared.models.tool_calls import (
    FunctionTool,
    Turn,
    hermes_messages,
    native_messages,
    renders_tools,
    tool_schemas,
)


def chat_prompt_ids(tokenizer: Tokenizer, turns: Sequence[Turn], tools: Sequence[FunctionTool] = ()) -> list[int]:
    """Template errors propagate (a worker rejects the request with them)."""
    if not tools and not any(t.tool_calls or t.role == "tool" for t in turns):
        return tokenizer.apply_chat_template(template_messages(turns))
    if renders_tools(tokenizer.chat_template):
        schemas = tool_schemas(tools) if tools else None
        return tokenizer.apply_chat_template(native_messages(turns), tools=schemas)
    return tokenizer.apply_chat_template(hermes_messages(turns, tools))
