"""Structured output: a grammar (wire.Grammar) as an llguidance grammar, and whether that grammar compiles.

Torch-free, so the edge refuses a schema the library cannot compile (`invalid_schema`) before a
worker ever sees it; the worker compiles the same text against its tokenizer
(services/worker/engine/grammar_compiler.py). Both ends cache by the grammar's text, bounded.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Protocol

import llguidance

CACHE_SIZE = 256  # distinct grammars remembered; a fleet's clients reuse a handful of schemas
# Compact JSON, no free whitespace: a small model given free whitespace may write newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'


class Grammar(Protocol):
    """wire.Grammar, or the engine's Constraint."""

    kind: str
    spec: str


class InvalidGrammar(ValueError):
    """A grammar the library cannot compile; the message says why."""


def grammar_text(grammar: Grammar) -> str:
    """The llguidance grammar for a wire grammar; InvalidGrammar when it cannot be built."""
    return _grammar_text(grammar.kind, grammar.spec)


def check_grammar(grammar: Grammar) -> None:
    """InvalidGrammar unless the grammar compiles (the answer is cached by its text)."""
    error = _grammar_error(grammar.kind, grammar.spec)
    if error:
        raise InvalidGrammar(error)


@lru_cache(maxsize=CACHE_SIZE)
def _grammar_text(kind: str, spec: str) -> str:
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, overrides=JSON_OPTIONS)
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise InvalidGrammar("choice must be a non-empty list of strings")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec)
    except (ValueError, TypeError) as exc:  # the library's word for a schema that is not a JSON object
        raise InvalidGrammar(str(exc)) from exc
    raise InvalidGrammar(f"unknown grammar kind {kind!r}")


@lru_cache(maxsize=CACHE_SIZE)
def _grammar_error(kind: str, spec: str) -> str:
    try:
        text = _grammar_text(kind, spec)
    except InvalidGrammar as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    return messages[0] if is_error else ""  # warnings (an unsupported keyword ignored) do not refuse
