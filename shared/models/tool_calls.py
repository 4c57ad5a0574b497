"""Tool calls in the Hermes format, for chat templates that do not render tools themselves.

The tools go into the system prompt inside <tools></tools>; the model answers a call as
<tool_call>{"name": ..., "arguments": {...}}</tool_call>; a tool's result goes back as a user
turn inside <tool_response></tool_response> (NousResearch's Hermes function-calling format).
`call_grammar` is the Lark grammar a forced call (`required`, or one named function) must match,
each call's arguments held to its function's parameter schema. Pure, torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from shared.models.structured import JSON_OPTIONS

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


class FunctionTool(Protocol):
    name: str
    description: str
    parameters: str  # JSON schema text


class Turn(Protocol):
    role: str
    content: str
    tool_calls: Sequence[Any]  # each with name and arguments (JSON text)
    tool_call_id: str


def tool_schemas(tools: Sequence[FunctionTool]) -> list[dict[str, Any]]:
    """The tools as OpenAI writes them, the shape templates and the Hermes prompt list."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters)},
        }
        for t in tools
    ]


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}\n{CALL_CLOSE}'


def hermes_messages(turns: Sequence[Turn], tools: Sequence[FunctionTool]) -> list[dict[str, str]]:
    """The conversation as plain role/content messages: tools in the system prompt, calls and results as text."""
    messages: list[dict[str, str]] = []
    if tools:
        listing = "\n".join(json.dumps(schema) for schema in tool_schemas(tools))
        prompt = SYSTEM_PROMPT.format(tools=listing)
        if turns and turns[0].role == "system":
            prompt = f"{turns[0].content}\n\n{prompt}"
            turns = turns[1:]
        messages.append({"role": "system", "content": prompt})
    for turn in turns:
        if turn.role == "tool":
            messages.append({"role": "user", "content": f"<tool_response>\n{turn.content}\n</tool_response>"})
        elif turn.tool_calls:
            calls = "\n".join(call_text(c.name, c.arguments) for c in turn.tool_calls)
            messages.append({"role": turn.role, "content": f"{turn.content}\n{calls}" if turn.content else calls})
        else:
            messages.append({"role": turn.role, "content": turn.content})
    return messages


def call_grammar(tools: Sequence[FunctionTool], parallel: bool) -> str:
    """Lark for one call of any of `tools` (several, one per line, when `parallel`)."""
    bodies = [f"call_{i}" for i in range(len(tools))]
    lines = [
        "start: call" + (' ("\\n" call)*' if parallel else ""),
        f'call: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"',
        "body: " + " | ".join(bodies),
    ]
    for rule, tool in zip(bodies, tools, strict=True):
        lines.append(f"{rule}: %json {json.dumps(_call_schema(tool))}")
    return "\n".join(lines)


def _call_schema(tool: FunctionTool) -> dict[str, Any]:
    parameters = json.loads(tool.parameters) or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_OPTIONS,
    }


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template lists tools itself (it reads the `tools` variable Hugging Face passes)."""
    return bool(chat_template) and "tools" in chat_template


def native_messages(turns: Sequence[Turn]) -> list[dict[str, Any]]:
    """Messages as tool-aware Hugging Face templates read them: calls with parsed arguments."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        message: dict[str, Any] = {"role": turn.role, "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _loads_object(c.arguments)}}
                for c in turn.tool_calls
            ]
        if turn.tool_call_id:
            message["tool_call_id"] = turn.tool_call_id
        messages.append(message)
    return messages


def _loads_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
