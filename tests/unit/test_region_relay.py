"""The relay to a peer region's edge, against a stand-in peer on a loopback socket: frames go both
ways under the client's chat id with the added delay, a cancel is forwarded, and a socket that
breaks ends every chat in flight at once with a retryable error."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers

from services.edge.protocol import (
    AcceptedFrame,
    ChatFrame,
    DoneFrame,
    EdgeFrame,
    ErrorFrame,
    TokenFrame,
    parse_client_frame,
)
from services.edge.region_relay import (
    RELAYED_HEADER,
    RelayLink,
    RelayUnavailable,
    chat_text,
)
from services.edge.region_settings import RegionPeer
from shared.codes import ErrorCode


class FakePeer:
    """Answers a chat with accepted, two tokens and done, unless told to hold it; records what it got."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.headers: Headers | None = None
        self.hold = False  # accept and stream one token, then wait (a long reply)
        self.sockets: list[ServerConnection] = []

    async def handler(self, ws: ServerConnection) -> None:
        self.headers = ws.request.headers
        self.sockets.append(ws)
        async for text in ws:
            frame = json.loads(text)
            self.received.append(frame)
            if frame["type"] == "cancel":
                await ws.send(json.dumps({"type": "done", "id": frame["id"], "finish_reason": "cancelled", "usage": USAGE}))
                continue
            await ws.send(json.dumps({"type": "accepted", "id": frame["id"], "request_id": "rq1", "resume_token": "secret"}))
            await ws.send(json.dumps({"type": "token", "id": frame["id"], "seq": 0, "text": "Hel"}))
            if not self.hold:
                await ws.send("not json at all")
                await ws.send(json.dumps({"type": "token", "id": frame["id"], "seq": 1, "text": "lo"}))
                await ws.send(json.dumps({"type": "done", "id": frame["id"], "finish_reason": "stop", "usage": USAGE}))


USAGE = {"prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 2}


@pytest.fixture
async def peer() -> AsyncIterator[tuple[FakePeer, RegionPeer]]:
    fake = FakePeer()
    async with serve(fake.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        yield fake, RegionPeer(name="r2", edge_url=f"ws://127.0.0.1:{port}/v1/chat", rtt_ms=1)


class Client:
    def __init__(self) -> None:
        self.frames: asyncio.Queue[tuple[EdgeFrame, float]] = asyncio.Queue()
        self.ended: list[int] = []
        self.bad_frames = 0

    def deliver(self, frame: EdgeFrame) -> None:
        self.frames.put_nowait((frame, time.monotonic()))

    async def until_final(self, timeout: float = 5.0) -> list[EdgeFrame]:
        frames = []
        while True:
            frame, _ = await asyncio.wait_for(self.frames.get(), timeout)
            frames.append(frame)
            if isinstance(frame, (DoneFrame, ErrorFrame)):
                return frames

    def count_bad(self) -> None:
        self.bad_frames += 1


async def open_link(peer: RegionPeer, client: Client, delay_s: float = 0.0) -> RelayLink:
    return await RelayLink.open(
        peer, "tenant-key", "r1", deliver=client.deliver, delay_s=delay_s,
        on_ended=lambda _link, failed: client.ended.append(failed), on_bad_frame=client.count_bad,
    )  # fmt: skip


def chat(chat_id: str = "c1") -> ChatFrame:
    frame = parse_client_frame(json.dumps({"type": "chat", "id": chat_id, "messages": [{"role": "user", "content": "Hello"}]}))
    assert isinstance(frame, ChatFrame)
    return frame


async def test_a_relayed_chat_comes_back_whole_under_its_id_as_the_tenant_with_a_token_that_resumes_nothing(peer):
    fake, region = peer
    client = Client()
    link = await open_link(region, client)
    link.start(chat("c1"))
    frames = await client.until_final()
    assert [type(f) for f in frames] == [AcceptedFrame, TokenFrame, TokenFrame, DoneFrame]
    assert all(f.id == "c1" for f in frames)
    assert [f.text for f in frames if isinstance(f, TokenFrame)] == ["Hel", "lo"]
    assert frames[0].request_id == "rq1" and frames[0].resume_token != "secret"
    assert client.bad_frames == 1  # the garbage frame was dropped, the stream went on
    assert fake.headers["Authorization"] == "Bearer tenant-key" and fake.headers[RELAYED_HEADER] == "r1"
    assert parse_client_frame(json.dumps(fake.received[0])) == chat("c1")  # the same chat, field for field
    assert not link.holds("c1") and link.num_chats() == 0
    await link.abort()


async def test_the_added_delay_is_paid_each_way(peer):
    _, region = peer
    client = Client()
    link = await open_link(region, client, delay_s=0.1)
    sent = time.monotonic()
    link.start(chat("c1"))
    _, first_at = await client.frames.get()
    assert first_at - sent >= 0.2  # one way out, one way back
    await link.abort()


async def test_a_cancel_is_forwarded_and_answered_by_the_peer(peer):
    fake, region = peer
    fake.hold = True
    client = Client()
    link = await open_link(region, client)
    link.start(chat("c1"))
    await client.frames.get()  # accepted
    link.cancel("c1")
    frames = await client.until_final()
    assert isinstance(frames[-1], DoneFrame) and frames[-1].finish_reason == "cancelled"
    assert fake.received[-1] == {"type": "cancel", "id": "c1"}
    await link.abort()


async def test_a_broken_socket_ends_every_chat_at_once_with_a_retryable_error(peer):
    fake, region = peer
    fake.hold = True
    client = Client()
    link = await open_link(region, client)
    link.start(chat("started"))
    assert isinstance((await client.frames.get())[0], AcceptedFrame)
    await fake.sockets[0].close(1011)  # the peer's edge is gone
    broke_at = time.monotonic()
    frames = await client.until_final()
    error = frames[-1]
    assert isinstance(error, ErrorFrame) and error.id == "started"
    assert (error.code, error.retryable) == (ErrorCode.WORKER_LOST, True)
    assert time.monotonic() - broke_at < 1.0
    await asyncio.wait_for(link.wait_closed(), 2)
    assert client.ended == [1] and not link.usable


async def test_the_client_leaving_cancels_its_chats_at_the_peer_and_closes_the_socket(peer):
    fake, region = peer
    fake.hold = True
    client = Client()
    link = await open_link(region, client)
    link.start(chat("c1"))
    await client.frames.get()
    link.close()
    await asyncio.wait_for(link.wait_closed(), 3)
    assert {"type": "cancel", "id": "c1"} in fake.received
    assert client.ended == [0]  # nothing failed: the client was gone


async def test_a_peer_that_cannot_be_reached_raises_before_anything_is_sent():
    region = RegionPeer(name="r2", edge_url="ws://127.0.0.1:9/v1/chat")
    with pytest.raises(RelayUnavailable):
        await open_link(region, Client())


RICH = {
    "type": "chat", "id": "c", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}],
    "max_tokens": 5, "temperature": 0.0, "seed": 3, "priority": -5, "top_k": 3, "stop": ["x"], "stop_token_ids": [1],
    "ignore_eos": True, "min_tokens": 2, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "logit_bias": {"12": -3.0},
    "logprobs": 2, "conversation": "conv", "tool_choice": "none", "parallel_tool_calls": False,
}  # fmt: skip


@pytest.mark.parametrize(
    "sent",
    [
        RICH,
        {"type": "chat", "id": "c", "prompt": [1, 2, 3]},
        {"type": "chat", "id": "c", "prompt": "raw", "response_format": {"type": "json_object"}},
        {"type": "chat", "id": "c", "messages": [{"role": "user", "content": "Hi"}], "structured_outputs": {"regex": "a+"}},
    ],
)
def test_the_frame_the_peer_gets_parses_as_the_same_chat(sent):
    frame = parse_client_frame(json.dumps(sent))
    assert isinstance(frame, ChatFrame)
    assert parse_client_frame(chat_text(frame)) == frame
    assert "min_tokens" not in chat_text(chat("c"))  # a default a client may not send is left out
