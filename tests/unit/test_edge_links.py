"""A router's link to an edge, against a real socket on loopback: frames arrive whole and in order
over an authenticated session, a dropped connection is made again, an edge that stays away is given
up on after a few tries, and an edge without the fleet secret (or not the one meant) is never sent to."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from services.router import edge_links
from services.router.edge_links import EdgeLink, EdgeUnreachable, forward_frames
from shared import wire
from shared.framing import accept_router, read_frame
from shared.link_auth import LinkKeys

KEYS = LinkKeys(b"fleet secret")


def link_to(edge_id: str, address: tuple[str, int]) -> EdgeLink:
    return EdgeLink(edge_id, address, KEYS, "router-0")


class Edge:
    """Reads frames on a loopback port; can drop its connections, or be shut."""

    def __init__(self, edge_id: str = "edge-0", keys: LinkKeys = KEYS) -> None:
        self.edge_id = edge_id
        self.keys = keys
        self.frames: asyncio.Queue[bytes] = asyncio.Queue()
        self.connections = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self, port: int = 0) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        return self._server.sockets[0].getsockname()[:2]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ValueError, TimeoutError):
            router_id, frames = await accept_router(reader, writer, self.keys, self.edge_id, 2.0)
            assert router_id == "router-0"
            while True:
                self.frames.put_nowait(frames.open(await read_frame(reader)))
        writer.close()

    async def drop_connections(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        await asyncio.sleep(0.05)

    async def shut(self) -> None:
        await self.drop_connections()
        self._server.close()
        await self._server.wait_closed()


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(edge_links, "RETRY_DELAY_S", 0.01)


async def test_frames_arrive_whole_in_order_over_one_connection(fast_retries):
    edge = Edge()
    link = link_to("edge-0", await edge.start())
    try:
        payloads = [bytes([i]) * (i * 1000 + 1) for i in range(20)]
        for payload in payloads:
            await link.send(payload)
        assert [await asyncio.wait_for(edge.frames.get(), 2) for _ in payloads] == payloads
        assert edge.connections == 1
    finally:
        await link.close()
        await edge.shut()


async def test_a_dropped_connection_is_made_again(fast_retries):
    edge = Edge()
    link = link_to("edge-0", await edge.start())
    try:
        await link.send(b"before")
        assert await asyncio.wait_for(edge.frames.get(), 2) == b"before"
        await edge.drop_connections()
        # The first write after a drop may still land in the dead socket's buffer; keep
        # sending until a frame arrives over the new connection, as a router's next batch would.
        for i in range(50):
            await link.send(b"after %d" % i)
            with contextlib.suppress(TimeoutError):
                assert (await asyncio.wait_for(edge.frames.get(), 0.1)).startswith(b"after")
                break
        else:
            raise AssertionError("no frame arrived after the drop")
        assert edge.connections == 2
    finally:
        await link.close()
        await edge.shut()


async def test_an_edge_that_stays_away_is_given_up_after_the_attempts(fast_retries):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = probe.getsockname()
    link = link_to("edge-9", address)
    with pytest.raises(EdgeUnreachable, match="edge-9"):
        await link.send(b"x")
    with pytest.raises(EdgeUnreachable):
        await link.send(b"x", attempts=1)  # an edge gossip calls dead gets one try
    # It comes up on that port: the same link reaches it.
    edge = Edge("edge-9")
    await edge.start(address[1])
    try:
        await link.send(b"late")
        assert await asyncio.wait_for(edge.frames.get(), 2) == b"late"
    finally:
        await link.close()
        await edge.shut()


@pytest.mark.parametrize("edge", [Edge("edge-0", LinkKeys(b"another secret")), Edge("edge-1")], ids=["wrong secret", "another edge"])
async def test_an_edge_that_cannot_prove_itself_is_never_sent_to(fast_retries, edge):
    link = link_to("edge-0", await edge.start())
    try:
        with pytest.raises(EdgeUnreachable):
            await link.send(b"secret tokens", attempts=2)
        assert edge.frames.empty() and edge.connections == 2
    finally:
        await link.close()
        await edge.shut()


def test_deliveries_are_split_into_frames_within_the_limit_in_order():
    deliveries = [wire.Delivery("c", wire.Token("r", seq, "x" * 1000), "w") for seq in range(100)]
    frames = forward_frames(deliveries, max_bytes=10_000)
    assert len(frames) > 10 and all(len(frame) <= 10_000 for frame in frames)
    assert [d for frame in frames for d in wire.decode(frame, wire.ForwardBatch).deliveries] == deliveries
    assert forward_frames(deliveries[:3]) == [wire.encode(wire.ForwardBatch(deliveries[:3]))]
