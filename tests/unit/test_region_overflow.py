"""Placement of each new chat between this region and its peers, with the relay behind it: what is
relayed (a WebSocket client's chats when this region is full and a peer has room) and what stays."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from services.edge.connection import Connection
from services.edge.protocol import AcceptedFrame, DoneFrame, EdgeFrame
from services.edge.region_overflow import RegionOverflow
from services.edge.region_relay import RELAYED_HEADER
from services.edge.region_settings import RegionPeer, RegionSettings
from services.edge.region_summaries import RegionCapacity
from shared.seal import Seal
from tests.unit.test_region_relay import FakePeer, chat

SECRET = b"fleet-secret"
TOPIC = "regions.capacity"


class Load:
    def __init__(self, load: float | None) -> None:
        self.value = load

    def load(self) -> float | None:
        return self.value

    def admitted(self, request_id: str, prompt_tokens: int) -> None:
        pass

    def ended(self, request_id: str) -> None:
        pass


def overflow_to(url: str, load: float | None) -> RegionOverflow:
    settings = RegionSettings(name="r1", peers=(RegionPeer(name="r2", edge_url=url, rtt_ms=70),), summary_topic=TOPIC)
    regions = RegionOverflow(settings, Seal(SECRET, "r1-edge"), Load(load), CollectorRegistry())
    peer_summary = RegionCapacity("r2", 0.2, 0.9, 0.0)
    regions.summaries.apply(Seal(SECRET, "r2-edge").encode(TOPIC, peer_summary))
    return regions


def client(regions: RegionOverflow, conn_id: str = "conn", **headers: str) -> tuple[Connection, asyncio.Queue[EdgeFrame]]:
    frames: asyncio.Queue[EdgeFrame] = asyncio.Queue()
    conn = Connection(conn_id, "tenant", frames.put)
    regions.opened(conn_id, {"authorization": "Bearer k", **headers}, {})
    return conn, frames


def placed(regions: RegionOverflow, region: str) -> float:
    return regions.metrics.placements.labels(region)._value.get()


@pytest.fixture
async def peer_url():
    from websockets.asyncio.server import serve

    fake = FakePeer()
    fake.hold = True
    async with serve(fake.handler, "127.0.0.1", 0) as server:
        yield f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat"


async def test_a_full_region_relays_a_sockets_chat_which_then_counts_as_in_flight_on_that_socket(peer_url):
    regions = overflow_to(peer_url, load=0.95)
    conn, frames = client(regions)
    writer = asyncio.create_task(conn.run_writer())
    assert await regions.place(conn, chat("c1"))
    assert isinstance(await asyncio.wait_for(frames.get(), 5), AcceptedFrame)
    assert regions.has_chat("conn", "c1") and regions.num_chats("conn") == 1 and regions.num_chats() == 1
    assert (placed(regions, "r2"), placed(regions, "r1")) == (1, 0)
    assert regions.cancel("conn", "c1") and not regions.cancel("conn", "other")
    while not isinstance(frame := await asyncio.wait_for(frames.get(), 5), DoneFrame):
        pass
    assert frame.finish_reason == "cancelled" and regions.num_chats() == 0
    regions.close_connection("conn")
    conn.close_writer()
    await writer
    await regions.aclose()


@pytest.mark.parametrize("load", [0.5, None])
async def test_a_region_under_its_overflow_load_or_that_knows_no_worker_keeps_the_chat(peer_url, load):
    regions = overflow_to(peer_url, load=load)
    conn, _ = client(regions)
    assert not await regions.place(conn, chat("c1"))
    assert (placed(regions, "r1"), placed(regions, "r2")) == (1, 0)


async def test_chats_that_came_over_a_relay_or_over_http_are_never_relayed(peer_url):
    regions = overflow_to(peer_url, load=0.95)
    relayed_in, _ = client(regions, "in", **{RELAYED_HEADER: "r2"})
    assert not await regions.place(relayed_in, chat("c1"))
    http = Connection("http", "tenant", asyncio.Queue().put)  # never `opened`: an HTTP API chat
    assert not await regions.place(http, chat("c2"))
    assert placed(regions, "r1") == 2


async def test_a_peer_that_cannot_be_reached_leaves_the_chat_here_and_is_counted():
    regions = overflow_to("ws://127.0.0.1:9/v1/chat", load=0.95)
    conn, _ = client(regions)
    assert not await regions.place(conn, chat("c1"))
    assert placed(regions, "r1") == 1
    assert regions.metrics.relay_errors.labels("connect")._value.get() == 1


async def test_single_region_places_nothing_and_counts_nothing():
    regions = RegionOverflow(RegionSettings(), Seal(SECRET, "edge"), Load(5.0), CollectorRegistry())
    conn, _ = client(regions)
    assert not await regions.place(conn, chat("c1"))
    assert regions.num_chats() == 0 and regions.summaries_io(None, "edge", None) is None  # type: ignore[arg-type]
