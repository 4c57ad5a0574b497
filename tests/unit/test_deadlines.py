"""No stream hangs: silent started chats and never-started chats both time out."""

from services.edge.connection import Chat
from services.edge.deadlines import Deadlines, overdue

LIMITS = Deadlines(progress_s=5.0, start_s=20.0)


def chat(owner=None, last=100.0):
    return Chat("c1", "r1", owner=owner, last_event_at=last)


def test_started_chat_must_keep_progressing():
    assert overdue(chat("w1"), 104.9, LIMITS) is None
    code, message = overdue(chat("w1"), 105.1, LIMITS)
    assert code == "worker_lost" and "w1" in message


def test_unstarted_chat_waits_longer_for_a_worker():
    assert overdue(chat(), 110.0, LIMITS) is None
    assert overdue(chat(), 120.5, LIMITS)[0] == "no_worker"
