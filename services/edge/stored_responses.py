"""`previous_response_id` on /v1/responses: the conversation a request continues is read from the response
store before the request is admitted, and its finished answer is stored (unless `store: false`) before its
last body or event goes out, so a client that saw it end can continue it at once, on any edge."""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

from services.edge.openai_responses_schema import (
    decode_responses_request,
    input_messages,
    responses_text,
)
from services.edge.openai_schema import RETRY_AFTER_S, ApiError, CompletionHeader
from services.edge.openai_text_events import ParsedText
from services.edge.protocol import ChatMessage, DoneFrame
from services.edge.response_store import ResponseStore, StoredTurn
from shared.redis_client import REDIS_UNAVAILABLE

log = logging.getLogger(__name__)


def previous_not_found(response_id: str) -> ApiError:
    """OpenAI's refusal, for an unknown, expired or another tenant's id alike (they must read the same)."""
    return ApiError(
        400, f"Previous response with id '{response_id}' not found.",
        code="previous_response_not_found", param="previous_response_id",
    )  # fmt: skip


class StoredResponses:
    def __init__(self, store: ResponseStore) -> None:
        self._store = store

    async def parse(self, body: bytes, served_model: str, chat_id: str, head: CompletionHeader, tenant: str) -> ParsedText:
        """The request with the conversation it continues; ApiError when it cannot be honoured."""
        request = decode_responses_request(body, served_model)
        history = await self._history(tenant, request.previous_response_id)
        parsed = responses_text(request, chat_id, head, [ChatMessage(t.role, t.content) for t in history])
        if request.store is False:
            return parsed
        turns = [*history, *(StoredTurn(m.role, m.content) for m in input_messages(request))]
        return dataclasses.replace(parsed, finished=partial(self._save, tenant, head.id, turns))

    async def _history(self, tenant: str, previous_id: str | None) -> list[StoredTurn]:
        if previous_id is None:
            return []
        try:
            turns = await self._store.load(tenant, previous_id)
        except REDIS_UNAVAILABLE as exc:
            message = "The previous response could not be read now; retry"
            raise ApiError(503, message, "server_error", "unavailable", retry_after=RETRY_AFTER_S) from exc
        if turns is None:
            raise previous_not_found(previous_id)
        return turns

    async def _save(self, tenant: str, response_id: str, turns: list[StoredTurn], text: str, done: DoneFrame) -> None:
        try:
            await self._store.save(tenant, response_id, [*turns, StoredTurn("assistant", text)])
        except REDIS_UNAVAILABLE as exc:  # the answer still goes out; only its continuation is lost
            log.warning("response %s was not stored: %r", response_id, exc)
