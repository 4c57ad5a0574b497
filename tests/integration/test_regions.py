"""Two regions with overflow on real Kafka and Redis (echo workers): region 1 always overflows
(overflow_load 0), so a chat sent to its edge is relayed to region 2 and served there whole,
in order, with a normal done; a cancel and a resume behave; and when region 2's edge dies, the
relayed stream ends at once with a retryable error, and the next chat stays in region 1."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator

import pytest

from services.launcher.regions import (
    LocalRegion,
    RegionFleets,
    create_region_topics,
    drop_region_topics,
    local_regions,
    region_fleets,
)
from shared.chat_client import ChatSocket
from tests.conftest import RESUME_GRACE_S, TEST_PORT, eventually
from tests.integration.test_metrics import scrape, value

ADDED_DELAY_MS = 35.0
SUMMARY_INTERVAL_S = 0.5
WORDS = " ".join(f"w{i}" for i in range(30))
LONG = " ".join(f"long{i}" for i in range(1500))  # 1,500 steps of 5 ms: runs while the test acts


def compact(region: LocalRegion) -> LocalRegion:
    """Every port of the region within its 500: its internal and gossip ports next to its client port."""
    base = region.spec.base_port
    return dataclasses.replace(region, spec=dataclasses.replace(region.spec, base_internal_port=base + 50, base_gossip_port=base + 60))


@pytest.fixture(scope="module")
def regions(infra, fleet_logs) -> Iterator[RegionFleets]:
    prefix = f"test-regions-{uuid.uuid4().hex[:8]}"
    summary_topic = f"{prefix}.capacity"
    layout = local_regions(
        2, TEST_PORT, prefix=prefix, summary_topic=summary_topic, added_delay_ms=ADDED_DELAY_MS, partitions=2,
        extra_env={"DRIVETRAIN_RESUME_GRACE_S": str(RESUME_GRACE_S), "DRIVETRAIN_REGIONS_SUMMARY_INTERVAL_S": str(SUMMARY_INTERVAL_S)},
        region_env={"r1": {"DRIVETRAIN_REGIONS_OVERFLOW_LOAD": "0.0"}},  # region 1 always sends its chats on
        edges=1, routers=1, workers=1, model="echo", echo_delay_ms=5,
    )  # fmt: skip
    layout = [compact(region) for region in layout]
    create_region_topics(infra, layout, summary_topic)
    fleets = region_fleets(layout, fleet_logs / prefix, echo_logs=False)
    fleets.start(ready_timeout_s=120)
    yield fleets
    fleets.stop()
    drop_region_topics(infra, layout, summary_topic)


def metric(port: int, name: str, **labels: str) -> float:
    return value(scrape(port), name, **labels)


def edge_port(fleets: RegionFleets, region: int) -> int:
    return fleets.regions[region].spec.base_port


@pytest.fixture(scope="module")
async def overflowing(regions) -> RegionFleets:
    """Region 1 knows its own worker (so it is at its overflow load) and region 2's room."""
    r1 = edge_port(regions, 0)
    await eventually(lambda: metric(r1, "drivetrain_edge_region_load") >= 0, 20, "region 1 never knew its worker")
    await eventually(lambda: 0 <= metric(r1, "drivetrain_edge_region_peer_load", region="r2") < 0.9, 20, "region 1 never heard of r2")
    return regions


async def test_a_chat_sent_to_a_full_region_is_served_whole_by_its_peer(overflowing):
    r1, r2 = edge_port(overflowing, 0), edge_port(overflowing, 1)
    sock = await ChatSocket.open(overflowing.regions[0].spec.chat_url(0))
    try:
        sent = time.monotonic()
        await sock.chat("c1", WORDS, temperature=0.0)
        result = await sock.collect("c1", timeout=20)
    finally:
        await sock.close()
    accepted, tokens, final = result.frames[0], result.tokens, result.final
    assert accepted["type"] == "accepted" and accepted["id"] == "c1"
    assert result.arrivals[0] - sent >= 2 * ADDED_DELAY_MS / 1000  # it went to r2 and back
    assert [t["seq"] for t in tokens] == list(range(len(tokens))) and all(t["id"] == "c1" for t in tokens)
    assert result.text.split() == WORDS.split()
    assert final["type"] == "done" and final["finish_reason"] == "stop" and final["id"] == "c1"
    assert final["usage"]["completion_tokens"] == len(tokens)
    # Placed in r2 by r1's edge; placed (here) and served by r2's edge, its own pipeline.
    assert metric(r1, "drivetrain_edge_region_placements_total", region="r2") >= 1
    assert metric(r1, "drivetrain_edge_region_placements_total", region="r1") == 0
    assert metric(r2, "drivetrain_edge_region_placements_total", region="r2") >= 1
    assert metric(r2, "drivetrain_edge_chats_total", tier="standard") >= 1
    assert metric(r1, "drivetrain_edge_chats_total", tier="standard") == 0


async def test_a_relayed_chat_is_cancelled_through_the_relay_and_never_resumed(overflowing):
    sock = await ChatSocket.open(overflowing.regions[0].spec.chat_url(0))
    try:
        await sock.chat("long", LONG)
        accepted = await sock.next_frame("long", timeout=15)
        assert (await sock.next_frame("long", timeout=15))["type"] == "token"
        await sock.send({"type": "cancel", "id": "long"})
        final = (await sock.collect("long", timeout=10)).final
        assert final["type"] == "done" and final["finish_reason"] == "cancelled"
        resume = {"type": "resume", "id": "again", "request_id": accepted["request_id"], "resume_token": accepted["resume_token"]}
        await sock.send(resume)
        refused = await sock.next_frame("again", timeout=5)
        assert (refused["type"], refused["code"]) == ("error", "resume_refused")
    finally:
        await sock.close()


async def test_when_the_peers_edge_dies_the_relayed_stream_ends_at_once_and_new_chats_stay_home(overflowing):
    r1 = edge_port(overflowing, 0)
    sock = await ChatSocket.open(overflowing.regions[0].spec.chat_url(0))
    try:
        await sock.chat("doomed", LONG)
        assert (await sock.next_frame("doomed", timeout=15))["type"] == "accepted"
        assert (await sock.next_frame("doomed", timeout=15))["type"] == "token"
        overflowing.fleets[1].kill("edge-0")  # SIGKILL: the relay's far end is gone
        killed = time.monotonic()
        frames = (await sock.collect("doomed", timeout=10)).frames
        error = frames[-1]
        assert (error["type"], error["code"], error["retryable"]) == ("error", "worker_lost", True)
        assert time.monotonic() - killed < 2.0
        assert all(f["type"] == "token" for f in frames[:-1])
        assert metric(r1, "drivetrain_edge_region_relay_errors_total", reason="broken") == 1
        # r2's last summary is still fresh, but its edge cannot be reached: the chat is served here.
        await sock.chat("after", WORDS)
        result = await sock.collect("after", timeout=20)
        assert result.final["type"] == "done" and result.text.split() == WORDS.split()
        assert metric(r1, "drivetrain_edge_region_placements_total", region="r1") == 1
    finally:
        await sock.close()
