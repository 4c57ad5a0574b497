"""The echo model's text units: a reply is the last user message (or a raw prompt), one word piece per step.

A piece is a word with its surrounding whitespace, so the pieces of a text concatenate back
to it exactly; prompts are counted in pieces, as a real model counts tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from shared.models.raw_prompt import PromptInput, RawPrompt
from shared.models.tokenizer import ChatTurn
from shared.models.tool_calls import FunctionTool, hermes_messages

ECHO = "echo"
CONTEXT_PIECES = 8192
_PIECE = re.compile(r"\s*\S+\s*")


def split_pieces(text: str) -> list[str]:
    pieces = _PIECE.findall(text)
    return pieces or ([text] if text else [])


def count_prompt_pieces(prompt: PromptInput, tools: Sequence[FunctionTool] = ()) -> int:
    """A prompt's pieces; with tools, those of the turns as the Hermes format writes them (the
    listing in the system prompt, calls and results as text), as a real model's prompt holds them."""
    if isinstance(prompt, RawPrompt):
        return len(raw_pieces(prompt))
    if tools:
        return sum(len(split_pieces(m["content"])) for m in hermes_messages(prompt, tools))
    return sum(len(split_pieces(m.content)) for m in prompt)


def reply_pieces(prompt: PromptInput) -> list[str]:
    """What the echo model replies: a raw prompt's pieces, or the last user message's."""
    if isinstance(prompt, RawPrompt):
        return raw_pieces(prompt)
    return split_pieces(_last_user(prompt))


def raw_pieces(prompt: RawPrompt) -> list[str]:
    """A raw text's pieces; token ids read as their numbers, one piece each ("5 7 9")."""
    if prompt.text is not None:
        return split_pieces(prompt.text)
    return split_pieces(" ".join(str(i) for i in prompt.token_ids or ()))


def _last_user(messages: Iterable[ChatTurn]) -> str:
    return next((m.content for m in reversed(list(messages)) if m.role == "user"), "")
