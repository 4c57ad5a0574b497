"""Capacity summaries from the global topic: each peer's newest, stale ones read as no room, and any
record that is not a sealed summary of this wire version skipped and counted, never raised."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from services.edge.region_metrics import RegionMetrics
from services.edge.region_settings import RegionPeer, RegionSettings
from services.edge.region_summaries import (
    PeerSummaries,
    RegionCapacity,
    RegionSummaries,
)
from shared import wire
from shared.seal import Seal
from shared.service_settings import KafkaSettings

SECRET = b"fleet-secret"
TOPIC = "regions.capacity"
SETTINGS = RegionSettings(
    name="r1",
    peers=(RegionPeer(name="r2", edge_url="ws://127.0.0.1:1/v1/chat", rtt_ms=70), RegionPeer(name="r3", edge_url="ws://x/", rtt_ms=10)),
    summary_topic=TOPIC,
    summary_interval_s=1.0,
)
PEER_SEAL = Seal(SECRET, "r2-edge-0")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def summary(region: str = "r2", load: float | None = 0.3, overflow_load: float = 0.9) -> bytes:
    return PEER_SEAL.encode(TOPIC, RegionCapacity(region, load, overflow_load, at=1.0))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def book(clock) -> PeerSummaries:
    return PeerSummaries(SETTINGS, Seal(SECRET, "r1-edge-0"), clock)


def test_each_peer_keeps_its_newest_summary_until_it_goes_stale(book, clock):
    assert book.load_of("r2") is None  # nothing heard yet: no room
    book.apply(summary(load=0.3))
    book.apply(summary(load=0.6))
    assert book.load_of("r2") == 0.6
    rooms = {room.name: room for room in book.rooms()}
    assert (rooms["r2"].load, rooms["r2"].overflow_load, rooms["r2"].rtt_ms) == (0.6, 0.9, 70)
    assert rooms["r3"].load is None and not rooms["r3"].has_room
    clock.now += 3.0  # three intervals: still fresh
    assert book.load_of("r2") == 0.6
    clock.now += 0.5
    assert book.load_of("r2") is None
    assert not {room.name: room for room in book.rooms()}["r2"].has_room


def test_summaries_of_this_region_and_of_regions_not_peers_are_ignored(book):
    assert book.apply(summary(region="r1")) is None
    assert book.apply(summary(region="r9")) is None
    assert [room.load for room in book.rooms()] == [None, None]


def test_a_region_that_knows_no_worker_has_no_room(book):
    book.apply(summary(load=None))
    assert not book.rooms()[0].has_room


def reader_of(book: PeerSummaries, metrics: RegionMetrics, load: float) -> RegionSummaries:
    """The I/O shell, not started: its `read` and `summary` need no broker."""
    producer = None  # never used unstarted
    return RegionSummaries(SETTINGS, KafkaSettings(), "r1-edge-0", producer, PEER_SEAL, book, lambda: load, metrics.summaries_skipped)  # type: ignore[arg-type]


def other_version() -> bytes:
    body = msgspec.msgpack.encode({"type": "region-capacity", "region": "r2", "load": 0.1, "overflow_load": 0.9, "at": 1.0, "v": 2})
    return PEER_SEAL.seal(TOPIC, body)


@pytest.mark.parametrize(
    "record",
    [
        None,  # a null record
        b"",
        b"\xff\x00garbage",
        Seal(b"another-secret", "r2-edge-0").encode(TOPIC, RegionCapacity("r2", 0.1, 0.9, 1.0)),  # not signed by the fleet
        PEER_SEAL.encode("other.topic", RegionCapacity("r2", 0.1, 0.9, 1.0)),  # sealed for another topic
        other_version(),
        PEER_SEAL.seal(TOPIC, b"\x93\x01\x02\x03"),  # sealed, but not a summary
        PEER_SEAL.encode(TOPIC, wire.Cancel(["r"], 0)),  # another message kind
        PEER_SEAL.seal(TOPIC, msgspec.msgpack.encode({"type": "region-capacity", "region": "r2", "load": float("nan"), "overflow_load": 0.9, "at": 1.0})),
        PEER_SEAL.seal(TOPIC, msgspec.msgpack.encode({"type": "region-capacity", "region": "r2", "load": -1.0, "overflow_load": 0.9, "at": 1.0})),
    ],
)
def test_a_bad_record_raises_a_wire_error_in_the_book_and_is_skipped_and_counted_by_the_reader(book, record):
    with pytest.raises(wire.WireError):
        book.apply(record)
    metrics = RegionMetrics(CollectorRegistry())
    reader = reader_of(book, metrics, load=0.5)
    reader.read(record, offset=7)
    reader.read(summary(load=0.4))  # and the next good one still counts
    assert metrics.summaries_skipped._value.get() == 1
    assert book.load_of("r2") == 0.4


def test_the_published_summary_carries_this_regions_load_and_overflow_load(book):
    metrics = RegionMetrics(CollectorRegistry())
    reader = reader_of(book, metrics, load=0.25)
    published = reader.summary()
    assert (published.region, published.load, published.overflow_load) == ("r1", 0.25, 0.9)
    assert wire.decode(wire.encode(published), RegionCapacity) == published
