"""When an edge gives up on a chat, so that no stream ever hangs.

A chat that a worker has started must keep making progress; one that no worker has
started must be started in time. Either failure ends the chat with a retryable error.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.edge.connection import Chat
from shared.codes import ErrorCode


@dataclass(frozen=True)
class Deadlines:
    progress_s: float  # longest silence of a started chat
    start_s: float  # longest wait for any worker to start a chat


def overdue(chat: Chat, now: float, deadlines: Deadlines) -> tuple[ErrorCode, str] | None:
    """(code, message) if the chat has waited too long, else None."""
    silent = now - chat.last_event_at
    if chat.owner is not None and silent > deadlines.progress_s:
        return ErrorCode.WORKER_LOST, f"worker {chat.owner} made no progress for {silent:.0f} s"
    if chat.owner is None and silent > deadlines.start_s:
        return ErrorCode.NO_WORKER, f"no worker started this chat within {deadlines.start_s:.0f} s"
    return None
