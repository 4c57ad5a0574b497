"""The Locust chat load test, run headless in its own process: against the real fleet, and against a
fake edge that breaks the protocol on purpose, to show that each kind of breakage fails a sample.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import sys
from http import HTTPStatus
from pathlib import Path

from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from shared.models.echo import split_pieces

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"


async def run_locust(host: str, csv_prefix: Path, users: int, run_time: str, *flags: str) -> tuple[int, str]:
    """Locust in a subprocess (importing it here would patch this process's sockets for gevent).

    Users stop gracefully at the end (`--stop-timeout`): each ends its chat, or its pause after a
    refused handshake, and leaves. Killing them mid-sleep instead has, now and then, left gevent's
    join on a user that never died, and Locust waiting forever.
    """
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary", "--stop-timeout", "5",
        "-u", str(users), "-r", str(users), "-t", run_time, "--host", host, "--csv", str(csv_prefix), *flags,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    except TimeoutError:
        process.kill()  # never leave it behind
        await process.wait()
        raise
    return process.returncode, output.decode(errors="replace")


def read_rows(path: Path, key: str = "Name") -> dict[str, dict[str, str]]:
    with path.open(newline="") as f:
        return {row[key]: row for row in csv.DictReader(f)}


def read_failures(csv_prefix: Path) -> list[dict[str, str]]:
    with Path(f"{csv_prefix}_failures.csv").open(newline="") as f:
        return list(csv.DictReader(f))


async def test_smoke_run_against_the_echo_fleet_has_no_failures(echo_fleet, tmp_path):
    words, max_tokens = 20, 16  # the echo model stops at max_tokens: 16 pieces, finish "length"
    host = ",".join(echo_fleet.spec.chat_url(i) for i in range(echo_fleet.spec.edges))
    prefix = tmp_path / "smoke"
    rc, output = await run_locust(
        host, prefix, 5, "15s", "--prompt-words", str(words), "--max-tokens", str(max_tokens),
        "--think-time", "0.1", "--chat-timeout", "30",
    )
    assert rc == 0, output[-3000:]
    stats = read_rows(Path(f"{prefix}_stats.csv"))
    assert read_failures(prefix) == [], output[-3000:]
    assert int(stats["Aggregated"]["Failure Count"]) == 0
    # Five users, one socket each, none dropped and none refused.
    assert int(stats["connect"]["Request Count"]) == 5
    streams = int(stats["stream"]["Request Count"])
    assert streams >= 10, output[-3000:]
    # Every finished stream had its first token and 15 gaps between 16 tokens; chats cut
    # short when the run ended add a few more first tokens and gaps, never fewer.
    assert int(stats["ttft"]["Request Count"]) >= streams
    assert int(stats["accepted"]["Request Count"]) >= int(stats["ttft"]["Request Count"])
    assert int(stats["itl"]["Request Count"]) >= streams * (max_tokens - 1)
    # A stream's size is its token count, the same for every chat here.
    assert float(stats["stream"]["Average Content Size"]) == max_tokens
    assert float(stats["stream"]["Requests/s"]) > 0


# A fake edge ---------------------------------------------------------------------------------
GOOD_KEY = "good-key"
SCENARIOS = ("ok", "gap", "repeat", "wrong_text", "error", "stall", "close", "other_id", "wrong_usage")


async def fake_edge(scenarios: itertools.cycle):
    """Speaks the chat protocol with an echo reply, but breaks it in a different way each chat.

    The key must come as ?api_key=, so a run with --key-in-query and a second key shows
    both that the query form is used and that a refusal is reported.
    """

    def check_key(connection, request):
        if f"api_key={GOOD_KEY}" not in request.path or "authorization" in request.headers:
            return connection.respond(HTTPStatus.UNAUTHORIZED, "unknown API key\n")
        return None

    async def handler(ws) -> None:
        try:
            async for text in ws:
                frame = json.loads(text)
                await reply(ws, frame, next(scenarios))
        except ConnectionClosed:
            pass

    async def reply(ws, frame, scenario: str) -> None:
        chat_id = frame["id"]
        pieces = split_pieces(frame["messages"][-1]["content"])[: frame["max_tokens"]]

        async def send(**fields) -> None:
            await ws.send(json.dumps(fields))

        await send(type="accepted", id=chat_id, request_id="r-" + chat_id)
        if scenario == "error":
            await send(type="error", id=chat_id, code="overloaded", message="try later", retryable=True)
            return
        seqs = list(range(len(pieces)))
        if scenario == "gap":
            seqs[2:] = [s + 1 for s in seqs[2:]]
        elif scenario == "repeat":
            seqs[3] = 2
        for k, (seq, piece) in enumerate(zip(seqs, pieces)):
            if scenario == "wrong_text" and k == 1:
                piece = piece.upper()
            if scenario == "stall" and k == 2:
                return  # never finishes: the client must time out
            if scenario == "close" and k == 2:
                await ws.close(1011, "internal error")
                return
            frame_id = "elsewhere" if scenario == "other_id" and k == 1 else chat_id
            await send(type="token", id=frame_id, seq=seq, text=piece)
            await asyncio.sleep(0.001)
        usage = {"prompt_tokens": len(pieces), "cached_tokens": 0,
                 "completion_tokens": len(pieces) + (scenario == "wrong_usage")}
        await send(type="done", id=chat_id, finish_reason="length", usage=usage)

    return await serve(handler, "127.0.0.1", 0, process_request=check_key, compression=None)


async def test_each_protocol_breakage_fails_a_sample_with_a_clear_message(tmp_path):
    server = await fake_edge(itertools.cycle(SCENARIOS))
    port = server.sockets[0].getsockname()[1]
    prefix = tmp_path / "broken"
    try:
        rc, output = await run_locust(
            f"ws://127.0.0.1:{port}/v1/chat", prefix, 3, "8s", "--api-keys", f"{GOOD_KEY},bad-key,{GOOD_KEY}",
            "--key-in-query", "--prompt-words", "12", "--max-tokens", "8", "--think-time", "0", "--chat-timeout", "1",
        )
    finally:
        server.close()
        await server.wait_closed()
    assert rc == 1, output[-3000:]  # Locust's exit status when any sample failed
    errors = {(row["Name"], row["Error"]) for row in read_failures(prefix)}
    messages = "\n".join(f"{name}: {error}" for name, error in sorted(errors))
    expected = {
        "connect": ["handshake refused: HTTP 401"],
        "stream": [
            "gap in seq: a token went missing",
            "repeated seq: a token came twice",
            "reply differs from the echo (same length)",
            "error frame overloaded: try later (retryable=True)",
            "timeout: no done within 1 s, mid-stream",
            "socket closed by the edge mid-chat (code 1011)",
            "token frame for another chat on this socket (cross-talk)",
            "usage.completion_tokens differs from the tokens that arrived",
        ],
    }
    for name, fragments in expected.items():
        for fragment in fragments:
            assert any(n == name and fragment in e for n, e in errors), f"{fragment!r} not among\n{messages}"
    stats = read_rows(Path(f"{prefix}_stats.csv"))
    # The well-behaved chats still count as successes, with all their samples.
    ok_streams = int(stats["stream"]["Request Count"]) - int(stats["stream"]["Failure Count"])
    assert ok_streams >= 1, output[-3000:]
    assert int(stats["ttft"]["Failure Count"]) == int(stats["itl"]["Failure Count"]) == 0
