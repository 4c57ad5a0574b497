"""A request's prompt as token ids: chat messages through the chat template, or a raw prompt as it is."""

from __future__ import annotations

import jinja2

from services.worker.engine.chat_prompt import chat_prompt_ids
from services.worker.engine.types import EngineRequest, FailureCode, RequestRejected
from shared.models.tokenizer import Tokenizer


def prompt_token_ids(tokenizer: Tokenizer, request: EngineRequest, vocab_size: int) -> list[int]:
    """RequestRejected (invalid_request) for messages the template refuses or ids outside the vocabulary.

    A raw text is tokenized with the tokenizer's special tokens, as the edge counted it
    (shared/models/prompt_length.py); raw ids go in unchanged, checked first, since an id past
    the embedding table would fail the whole batch's step, not this request alone.
    """
    raw = request.prompt
    if raw is None:
        try:
            return chat_prompt_ids(tokenizer, request)  # the tools too, where it has some
        except (jinja2.TemplateError, ValueError, KeyError, TypeError) as exc:
            message = f"the messages do not fit the chat template: {exc}"
            raise RequestRejected(FailureCode.INVALID_REQUEST, message) from exc
    if raw.text is not None:
        return tokenizer.encode(raw.text)
    ids = list(raw.token_ids or ())
    if any(not 0 <= i < vocab_size for i in ids):
        message = f"a prompt token id is outside the vocabulary (0..{vocab_size - 1})"
        raise RequestRejected(FailureCode.INVALID_REQUEST, message)
    return ids
