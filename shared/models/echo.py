"""The echo model's text units: a reply is the last user message, one word piece per step.

A piece is a word with its surrounding whitespace, so the pieces of a text concatenate back
to it exactly; prompts are counted in pieces, as a real model counts tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from shared.models.tokenizer import ChatTurn

ECHO = "echo"
CONTEXT_PIECES = 8192
_PIECE = re.compile(r"\s*\S+\s*")


def split_pieces(text: str) -> list[str]:
    pieces = _PIECE.findall(text)
    return pieces or ([text] if text else [])


def count_prompt_pieces(messages: Iterable[ChatTurn]) -> int:
    return sum(len(split_pieces(m.content)) for m in messages)
