"""Hostile or careless clients against the real fleet (echo model): no input costs a traceback, a
dropped socket, or a retryable error for what can never succeed; no anonymous client holds the edge.

The last test reads this module's own fleet logs for tracebacks, so it runs after all the others.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator

import httpx2
import pytest
from websockets.exceptions import InvalidStatus

from services.launcher.fleet import Fleet
from shared.chat_client import ChatSocket
from shared.topics import MAX_FRAME_BYTES
from tests.conftest import TEST_PORT, KafkaTap, start_fleet


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("untrusted-fleet")


@pytest.fixture(scope="module")
def fleet(topics, fleet_dir) -> Iterator[Fleet]:
    fleet = start_fleet(topics, fleet_dir, edges=2, routers=1, workers=1, model="echo", echo_delay_ms=1)
    yield fleet
    fleet.stop()


@pytest.fixture
async def http(fleet) -> AsyncIterator[httpx2.AsyncClient]:
    headers = {"authorization": "Bearer dev-key"}
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{TEST_PORT}/v1", headers=headers, timeout=30) as c:
        yield c


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def chat_frame(chat_id: str, **fields) -> str:
    return json.dumps({"type": "chat", "id": chat_id, "messages": [{"role": "user", "content": "hi"}], **fields})


async def refused_and_still_serving(sock: ChatSocket, frame: str, chat_id: str | None, codes: tuple[str, ...]) -> None:
    await sock.send(frame)
    error = await sock.next_frame(chat_id, timeout=10)
    assert error["type"] == "error" and error["code"] in codes and error["retryable"] is False, error
    await sock.chat("after", "still here")
    result = await sock.collect("after")
    assert result.text == "still here" and result.final["type"] == "done"


@pytest.mark.parametrize("depth", [1_000, 100_000, MAX_FRAME_BYTES // 2 - 8])
async def test_deep_nesting_on_the_socket_is_an_error_frame(fleet, depth):
    sock = await ChatSocket.open(fleet.spec.chat_url(0))
    try:
        await refused_and_still_serving(sock, nested(depth), None, ("invalid_json", "invalid_message"))
        if depth >= 100_000:  # deep past any recursion limit, so the id is never read
            inside = chat_frame("deep")[:-1] + ', "conversation": ' + nested(depth // 2) + "}"
            await refused_and_still_serving(sock, inside, None, ("invalid_json",))
    finally:
        await sock.close()


@pytest.mark.parametrize("field", ["tool_choice", "tools", "response_format", "messages"])
async def test_deep_nesting_over_http_is_400(http, field):
    body = '{"model":"echo","messages":[{"role":"user","content":"hi"}],"' + field + '":' + nested(100_000) + "}"
    response = await http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] in ("invalid_json", "invalid_value", "unsupported_parameter")


@pytest.mark.parametrize(
    "fields", [{"max_tokens": 10**30}, {"max_tokens": 10**6}, {"seed": 2**70}, {"seed": -(2**64)}]
)
async def test_integers_out_of_range_are_refused_before_accepted_and_never_queued(fleet, topics, infra, fields):
    async with KafkaTap(infra, topics.requests, topics.requests_partitions) as tap:
        sock = await ChatSocket.open(fleet.spec.chat_url(0))
        try:
            await sock.send(chat_frame("big", **fields))
            error = await sock.next_frame("big", timeout=10)  # the first frame: no `accepted` before it
            assert (error["type"], error["code"], error["retryable"]) == ("error", "invalid_message", False)
            await sock.chat("after", "still here")
            assert (await sock.next_frame("after"))["type"] == "accepted"
            await sock.collect("after")
        finally:
            await sock.close()
        queued = await tap.records(2.0)
    assert len(queued) == 1  # the chat that came after, alone


@pytest.mark.parametrize("fields", [{"max_tokens": 10**30}, {"max_completion_tokens": 10**6}, {"seed": 2**70}])
async def test_integers_out_of_range_over_http_are_400_not_503(http, fields):
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], **fields}
    response = await http.post("/chat/completions", json=body)
    assert response.status_code == 400 and "retry-after" not in response.headers, response.text


@pytest.mark.parametrize("last_seq", [2**64, 2**31])
async def test_resume_from_beyond_any_stream_is_invalid_message(fleet, last_seq):
    sock = await ChatSocket.open(fleet.spec.chat_url(0))
    try:
        frame = {"type": "resume", "id": "r1", "request_id": "x" * 32, "resume_token": "t", "last_seq": last_seq}
        await refused_and_still_serving(sock, json.dumps(frame), "r1", ("invalid_message",))
    finally:
        await sock.close()


async def test_a_frame_just_under_the_limit_is_queued_and_answered(fleet):
    words = 100
    frame = chat_frame("huge", max_tokens=2)
    room = MAX_FRAME_BYTES - 16 - len(frame) - words + 2  # the content "hi" is replaced, spaces between words
    content = " ".join(["w" * (room // words)] * words)
    frame = chat_frame("huge", max_tokens=2).replace('"hi"', json.dumps(content))
    assert MAX_FRAME_BYTES - 200 < len(frame.encode()) < MAX_FRAME_BYTES
    sock = await ChatSocket.open(fleet.spec.chat_url(0))
    try:
        await sock.send(frame)
        result = await sock.collect("huge", timeout=60)
        assert result.final["type"] == "done" and result.final["finish_reason"] == "length", result.final
    finally:
        await sock.close()


async def test_foreign_origin_is_refused_own_origin_is_not(fleet):
    with pytest.raises(InvalidStatus) as info:
        await ChatSocket.open(fleet.spec.chat_url(0), origin="http://evil.example")
    assert info.value.response.status_code == 403
    sock = await ChatSocket.open(fleet.spec.chat_url(0), origin=f"http://127.0.0.1:{TEST_PORT}")
    await sock.close()


async def test_a_frame_flood_closes_the_socket_with_1008(fleet):
    sock = await ChatSocket.open(fleet.spec.chat_url(0))
    for _ in range(2_000):
        await sock.send('{"type":"cancel","id":"nothing"}')
    deadline = time.monotonic() + 10
    while sock.close_code is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sock.close_code == 1008
    await sock.close()


async def test_slow_headers_do_not_hold_a_connection(fleet):
    reader, writer = await asyncio.open_connection("127.0.0.1", TEST_PORT)
    start = time.monotonic()
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=20)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 15
    writer.close()


async def test_a_flood_of_bad_keys_is_slowed_down_and_good_clients_still_connect(fleet):
    url = fleet.spec.chat_url(1)

    async def bad() -> int:
        try:
            await ChatSocket.open(url, api_key="wrong")
        except InvalidStatus as exc:
            return exc.response.status_code
        return 101

    statuses = await asyncio.gather(*(bad() for _ in range(300)))
    assert set(statuses) == {401, 429} and statuses.count(401) <= 30
    # Another edge serves this address as before; this one does again once it slows down.
    sock = await ChatSocket.open(fleet.spec.chat_url(0))
    await sock.chat("ok", "fine")
    assert (await sock.collect("ok")).text == "fine"
    await sock.close()


def test_no_input_left_a_traceback_in_the_logs(fleet, fleet_dir):
    logs = {path.name: path.read_text(errors="replace") for path in fleet_dir.glob("*.log")}
    assert any(name.startswith("edge") for name in logs)
    assert {name: text.count("Traceback") for name, text in logs.items() if "Traceback" in text} == {}
    edge_errors = [line for name, text in logs.items() if name.startswith("edge") for line in text.splitlines() if " ERROR " in line]
    assert edge_errors == []
