"""`drivetrain chat` as a user runs it: a real process reading a pipe, against a real echo fleet.

The echo model replies with the last user message and counts every message's word pieces as
prompt tokens, so `prompt_tokens` shows exactly which history each turn sent.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from services.launcher.fleet import Fleet
from tests.conftest import start_fleet

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def chat_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    """One edge, router and worker; 20 ms echo steps, so a long reply is still streaming when Ctrl-C comes."""
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=1, model="echo", echo_delay_ms=20)
    yield fleet
    fleet.stop()


def command(fleet: Fleet, *args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "chat", "--url", fleet.spec.chat_url(0), *args]


def frames_by_chat(stdout: str) -> dict[str, list[dict]]:
    chats: dict[str, list[dict]] = {}
    for line in stdout.splitlines():
        frame = json.loads(line)  # --json: every line of stdout is one frame
        chats.setdefault(frame["id"], []).append(frame)
    return chats


def reply_of(frames: list[dict]) -> tuple[str, dict]:
    return "".join(f["text"] for f in frames if f["type"] == "token"), frames[-1]


def test_a_piped_session_keeps_history_and_obeys_reset_and_system(chat_fleet):
    script = "one two\nthree four five\n/system Be brief.\nsix\n/reset\nseven\n/exit\nnever sent\n"
    done = subprocess.run(
        command(chat_fleet, "--json"), input=script, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    chats = frames_by_chat(done.stdout)
    assert list(chats) == ["t1", "t2", "t3", "t4"]  # nothing after /exit
    replies = {chat_id: reply_of(frames) for chat_id, frames in chats.items()}
    assert [text for text, _ in replies.values()] == ["one two", "three four five", "six", "seven"]
    assert all(final["type"] == "done" and final["finish_reason"] == "stop" for _, final in replies.values())
    # t1: 2 pieces. t2: 2 + its reply 2 + 3. t3: system 2 + t2's 7 + t2's reply 3 + 1.
    # t4, after /reset: the system prompt 2 + 1 (the system prompt stays).
    assert [final["usage"]["prompt_tokens"] for _, final in replies.values()] == [2, 7, 13, 3]
    assert "system prompt set: Be brief." in done.stderr and "history cleared" in done.stderr


def test_text_output_and_the_one_shot_form(chat_fleet):
    done = subprocess.run(
        command(chat_fleet), input="hello there\n/bogus\nand again\n", capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "hello there" and lines[1].startswith("[stop: 2 prompt tokens (0 cached), 2 completion tokens, ")
    assert lines[1].endswith("tokens/s]") and "ms to first token" in lines[1]
    assert lines[2] == "and again" and lines[3].startswith("[stop: 6 prompt tokens (0 cached)")
    assert "unknown command /bogus" in done.stderr

    one = subprocess.run(
        command(chat_fleet, "just once", "--system", "S"), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith("just once\n[stop: 3 prompt tokens")
    as_json = subprocess.run(
        command(chat_fleet, "--json", "as frames"), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    kinds = [f["type"] for f in frames_by_chat(as_json.stdout)["t1"]]
    assert as_json.returncode == 0 and kinds == ["accepted", "token", "token", "done"]


def test_ctrl_c_cancels_the_reply_and_the_session_goes_on(chat_fleet):
    # A shell starts its background jobs with SIGINT ignored, and a child inherits that; the chat
    # runs as from a terminal, where Ctrl-C reaches it.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            command(chat_fleet, "--json"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, inherited)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()

    def next_frame() -> dict:
        return json.loads(lines.get(timeout=TIMEOUT_S))

    try:
        long = " ".join(f"w{i}" for i in range(500))  # 10 s of reply at 20 ms a piece
        process.stdin.write(long + "\n")
        process.stdin.flush()
        while next_frame()["type"] != "token":
            pass
        process.send_signal(signal.SIGINT)
        frames = [next_frame()]
        while frames[-1]["type"] not in ("done", "error"):
            frames.append(next_frame())
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "cancelled", frames[-1]
        shown = 1 + sum(f["type"] == "token" for f in frames)
        assert shown < 500 and process.poll() is None  # cut short, and still running

        process.stdin.write("after\n")
        process.stdin.flush()
        after = [next_frame()]
        while after[-1]["type"] not in ("done", "error"):
            after.append(next_frame())
        assert {f["id"] for f in after} == {"t2"}
        assert reply_of(after)[0] == "after"
        # The stopped reply stays in the history: the question, the pieces shown, and "after".
        assert after[-1]["usage"]["prompt_tokens"] == 500 + shown + 1
        process.stdin.close()
        assert process.wait(TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
