"""Resumable streams: a client whose socket dropped picks its stream up on another edge."""

from __future__ import annotations

import time

import pytest

from shared.chat_client import ChatSocket

TEXT = " ".join(f"w{i}" for i in range(400))


async def start_and_drop(url: str, tokens_before_drop: int) -> tuple[dict, list[dict]]:
    """Start a long chat, read a few tokens, then lose the socket."""
    sock = await ChatSocket.open(url)
    await sock.chat("c1", TEXT, max_tokens=400)
    accepted = await sock.next_frame("c1")
    seen = [await sock.next_frame("c1") for _ in range(tokens_before_drop)]
    await sock.ws.close()
    return accepted, seen


async def resume(url: str, accepted: dict, last_seq: int, token: str | None = None) -> tuple[ChatSocket, dict]:
    sock = await ChatSocket.open(url)
    await sock.send(
        {
            "type": "resume",
            "id": "again",
            "request_id": accepted["request_id"],
            "resume_token": token or accepted["resume_token"],
            "last_seq": last_seq,
        }
    )
    return sock, await sock.next_frame("again", timeout=10)


async def test_resume_on_another_edge_continues_without_loss_or_repeat(echo_fleet):
    accepted, seen = await start_and_drop(echo_fleet.spec.chat_url(0), 5)
    assert [f["seq"] for f in seen] == [0, 1, 2, 3, 4]
    sock, resumed = await resume(echo_fleet.spec.chat_url(1), accepted, last_seq=4)
    try:
        assert resumed == {"type": "resumed", "id": "again", "request_id": accepted["request_id"], "next_seq": 5}
        rest = await sock.collect("again", timeout=30)
    finally:
        await sock.close()
    seqs = [f["seq"] for f in rest.tokens]
    assert seqs == list(range(5, 400)), seqs[:10]
    assert "".join(f["text"] for f in seen) + rest.text == TEXT
    assert rest.final["type"] == "done" and rest.final["finish_reason"] == "stop"


async def test_resume_after_the_stream_finished_replays_the_rest(echo_fleet):
    accepted, seen = await start_and_drop(echo_fleet.spec.chat_url(1), 1)
    sock, resumed = await resume(echo_fleet.spec.chat_url(0), accepted, last_seq=-1)
    try:
        assert resumed["type"] == "resumed" and resumed["next_seq"] == 0
        rest = await sock.collect("again", timeout=30)
    finally:
        await sock.close()
    assert rest.text == TEXT and [f["seq"] for f in rest.tokens] == list(range(400))


@pytest.mark.parametrize("case", ["wrong_token", "unknown_request"])
async def test_refused_resume_reveals_nothing(echo_fleet, case):
    accepted, _ = await start_and_drop(echo_fleet.spec.chat_url(0), 1)
    if case == "unknown_request":
        accepted = {**accepted, "request_id": "0" * 32}
    sock, answer = await resume(echo_fleet.spec.chat_url(1), accepted, 0, token="x" * 32 if case == "wrong_token" else None)
    try:
        assert answer["type"] == "error" and answer["code"] == "resume_refused"
        assert accepted["request_id"] not in answer["message"]
        # The same socket still works.
        await sock.chat("fresh", "still here")
        assert (await sock.collect("fresh")).text == "still here"
    finally:
        await sock.close()


async def test_resume_ahead_of_the_stream_is_refused(echo_fleet):
    accepted, _ = await start_and_drop(echo_fleet.spec.chat_url(0), 2)
    sock, resumed = await resume(echo_fleet.spec.chat_url(1), accepted, last_seq=100_000)
    try:
        assert resumed["type"] == "resumed"
        answer = await sock.next_frame("again", timeout=10)
    finally:
        await sock.close()
    assert answer["type"] == "error" and answer["code"] == "resume_refused"


@pytest.mark.parametrize("other_edge", [False, True], ids=["same-edge", "other-edge"])
async def test_resuming_a_stream_still_attached_elsewhere_tells_the_first_socket_at_once(echo_fleet, other_edge):
    first = await ChatSocket.open(echo_fleet.spec.chat_url(0))
    second = None
    try:
        await first.chat("c1", TEXT, max_tokens=400)
        accepted = await first.next_frame("c1")
        assert (await first.next_frame("c1"))["type"] == "token"
        second, resumed = await resume(echo_fleet.spec.chat_url(1 if other_edge else 0), accepted, last_seq=0)
        assert resumed["type"] == "resumed"
        started = time.monotonic()
        lost = await first.collect("c1", timeout=10)
        assert lost.final["type"] == "error" and lost.final["code"] == "stream_moved", lost.final
        assert lost.final["retryable"] is False and time.monotonic() - started < 3.0
        rest = await second.collect("again", timeout=30)
        assert rest.final["type"] == "done" and rest.final["finish_reason"] == "stop"
        assert rest.text == TEXT[len("w0 "):]  # everything after seq 0, once
        await first.chat("next", "the first socket still works")
        assert (await first.collect("next")).text == "the first socket still works"
    finally:
        await first.close()
        if second is not None:
            await second.close()


async def test_cancel_after_resume_ends_the_stream_at_once(echo_fleet):
    accepted, _ = await start_and_drop(echo_fleet.spec.chat_url(0), 2)
    sock, resumed = await resume(echo_fleet.spec.chat_url(1), accepted, last_seq=1)
    try:
        assert resumed["type"] == "resumed"
        assert (await sock.next_frame("again"))["type"] == "token"
        await sock.send({"type": "cancel", "id": "again"})
        rest = await sock.collect("again", timeout=10)
    finally:
        await sock.close()
    assert rest.final["type"] == "done" and rest.final["finish_reason"] == "cancelled", rest.final
    assert len(rest.tokens) < 100  # at 5 ms a token, a cancel ignored would run all 400
