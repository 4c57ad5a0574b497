"""What an anonymous client may hold or spend at the edge: rate limits, origins, handshake checks, read timeouts."""

from __future__ import annotations

import asyncio
import contextlib

import h11
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from services.edge.auth import Credential
from services.edge.handshake import (
    BAD_KEY,
    BAD_ORIGIN,
    SLOW_DOWN,
    HandshakeGate,
    Refusal,
)
from services.edge.origins import OriginPolicy
from services.edge.read_timeouts import ReadTimeouts, read_deadline, timed_protocol
from services.edge.tenants import book_from_keys, hash_key
from shared.codes import ErrorCode
from shared.rate_limits import KeyedBuckets, LogThrottle, Rate, TokenBucket

# Rate limits -------------------------------------------------------------------------------
T1 = Credential("t1", hash_key("good"))

def test_bucket_allows_a_burst_then_the_rate():
    bucket = TokenBucket(Rate(per_s=2.0, burst=3), now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take(0.4)  # 0.8 of a token back
    assert bucket.take(0.5)
    assert not bucket.take(0.5)
    assert bucket.tokens(100.0) == 3  # never more than the burst


def test_keyed_buckets_are_independent_and_bounded():
    buckets = KeyedBuckets(Rate(per_s=1.0, burst=2), max_keys=3)
    assert [buckets.charge("a", 0.0) for _ in range(3)] == [True, True, False]
    assert not buckets.allows("a", 0.0) and buckets.allows("b", 0.0)
    for key in "bcd":
        buckets.charge(key, 0.0)
    assert len(buckets) == 3 and buckets.allows("a", 0.0)  # the oldest key went first
    buckets.sweep(10.0)
    assert len(buckets) == 0  # refilled buckets are forgotten


def test_log_throttle_says_how_many_it_held_back():
    throttle = LogThrottle(Rate(per_s=1.0, burst=2), now=0.0)
    assert [throttle.admit(0.0) for _ in range(5)] == [0, 0, None, None, None]
    assert throttle.admit(1.0) == 3


# Origins ---------------------------------------------------------------------------------------
def test_default_policy_allows_non_browsers_and_the_edge_own_page_only():
    policy = OriginPolicy.parse("")
    assert policy.allows(None, "edge:8080")
    assert policy.allows("http://edge:8080", "edge:8080")
    assert policy.allows("HTTP://Edge:80", "edge")  # default port, any case
    assert not policy.allows("http://evil.example", "edge:8080")
    assert not policy.allows("null", "edge:8080")  # a sandboxed page or a file
    assert not policy.allows("https://edge:8080", "edge:8080")  # another scheme is another origin


def test_listed_origins_and_star():
    policy = OriginPolicy.parse("https://app.example, http://localhost:3000")
    assert policy.allows("https://app.example", "edge:8080")
    assert policy.allows("http://localhost:3000", "edge:8080")
    assert not policy.allows("http://localhost:3001", "edge:8080")
    assert OriginPolicy.parse("*").allows("http://anything.example", "edge:8080")
    with pytest.raises(ValueError):
        OriginPolicy.parse("app.example/path")


# Handshakes --------------------------------------------------------------------------------------
def gate(**kwargs) -> HandshakeGate:
    return HandshakeGate(book_from_keys({"good": "t1"}, {}, "standard").tenant_of, OriginPolicy.parse(""), Rate(per_s=1.0, burst=3), **kwargs)


def test_good_key_is_admitted_as_its_tenant():
    assert gate().admit("1.2.3.4", {"authorization": "Bearer good"}, {}, False, 0.0) == T1


def test_an_address_refused_too_often_is_told_to_slow_down_before_its_key_is_checked():
    handshakes = gate()
    refusals = [handshakes.admit("1.2.3.4", {"authorization": "Bearer bad"}, {}, False, 0.0) for _ in range(5)]
    assert refusals == [BAD_KEY, BAD_KEY, BAD_KEY, SLOW_DOWN, SLOW_DOWN]
    assert SLOW_DOWN.status == 429 and SLOW_DOWN.code.retryable
    # Even a good key waits: the address is what is limited. Others are not affected.
    assert handshakes.admit("1.2.3.4", {"authorization": "Bearer good"}, {}, False, 0.5) == SLOW_DOWN
    assert handshakes.admit("5.6.7.8", {"authorization": "Bearer good"}, {}, False, 0.5) == T1
    assert handshakes.admit("1.2.3.4", {"authorization": "Bearer good"}, {}, False, 1.0) == T1


def test_foreign_origin_is_refused_even_with_a_good_key():
    headers = {"origin": "http://evil.example", "host": "edge:8080"}
    assert gate().admit("1.2.3.4", headers, {"api_key": "good"}, False, 0.0) == BAD_ORIGIN
    assert BAD_ORIGIN.status == 403


def test_admission_hook_decides_last_for_a_known_tenant():
    full = Refusal(429, ErrorCode.TOO_MANY_CHATS, "tenant at its connection cap")
    seen = []

    def admission(tenant: str, client: str) -> Refusal | None:
        seen.append((tenant, client))
        return full

    assert gate(admission=admission).admit("1.2.3.4", {"authorization": "Bearer good"}, {}, False, 0.0) == full
    assert gate(admission=admission).admit("1.2.3.4", {}, {}, False, 0.0) == BAD_KEY
    assert seen == [("t1", "1.2.3.4")]


# HTTP read timeouts ------------------------------------------------------------------------------
TIMEOUTS = ReadTimeouts(header_s=0.3, body_s=0.3)


def test_read_deadline_per_part_of_the_request():
    assert read_deadline(h11.IDLE, 10.0, ReadTimeouts(2.0, 5.0)) == 12.0
    assert read_deadline(h11.SEND_BODY, 10.0, ReadTimeouts(2.0, 5.0)) == 15.0
    assert read_deadline(h11.DONE, 10.0, ReadTimeouts(2.0, 5.0)) is None


@contextlib.asynccontextmanager
async def timed_server():
    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    config = uvicorn.Config(
        Starlette(routes=[Route("/", echo, methods=["POST"])]),
        host="127.0.0.1", port=0, http=timed_protocol(TIMEOUTS), log_level="warning", lifespan="off",
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.should_exit = True
        await serving


async def held_for(port: int, *pieces: bytes, pause: float = 0.0) -> tuple[float, bytes]:
    """Send the pieces with a pause between them; how long the server kept the connection and what it said."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = loop.time()

    async def answer() -> tuple[float, bytes]:
        received = b""
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                received += chunk
        return loop.time() - start, received

    reading = asyncio.create_task(answer())
    with contextlib.suppress(ConnectionError):
        for piece in pieces:
            if reading.done():
                break
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(pause)
    result = await asyncio.wait_for(reading, timeout=5)
    writer.close()
    return result


async def test_slow_headers_are_cut_off():
    async with timed_server() as port:
        held, answer = await held_for(port, *[b"POST / HTTP/1.1\r\n", b"x-a: 1\r\n", b"x-b: 1\r\n"] * 5, pause=0.1)
    assert held < 2.0 and answer.startswith(b"HTTP/1.1 408")


async def test_a_body_that_never_comes_is_cut_off():
    head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n"
    async with timed_server() as port:
        held, answer = await held_for(port, head, b"only some", pause=0.1)
    assert held < 2.0 and answer == b""  # the request was in progress: closed without a response


async def test_prompt_requests_and_keep_alive_still_work():
    request = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"
    async with timed_server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(3):  # each well inside the timeouts, together longer than them
            writer.write(request)
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n2"), timeout=2)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.2)
        writer.close()
