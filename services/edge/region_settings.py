"""The edge's `regions` settings: which region this fleet is, its peers, and when chats overflow to them.

A region is a whole fleet (its edges, workers, routers, topics, gossip cluster, Redis): a chat
placed in a peer is relayed to one of that region's edges and served there end to end
(region_overflow.py). With no `name` the edge is single-region, exactly as without this section.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from shared.settings import Section

RegionName = Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")]


class RegionPeer(Section):
    """Another region this one may send chats to."""

    name: Annotated[RegionName, Field(min_length=1)]
    """the peer region's name, as its edges publish it in their capacity summaries"""
    edge_url: str
    """WebSocket URL of a chat endpoint of one of its edges (ws://HOST:PORT/v1/chat or wss://...)"""
    rtt_ms: Annotated[float, Field(ge=0.0)] = 0.0
    """configured round-trip time to it: the nearest peer with room (lowest rtt_ms) gets the overflow"""

    @field_validator("edge_url")
    @classmethod
    def _websocket_url(cls, url: str) -> str:
        if not url.startswith(("ws://", "wss://")):
            raise ValueError("edge_url must be a ws:// or wss:// URL")
        return url


class RegionSettings(Section):
    """Regions with overflow: a chat goes to the nearest peer region with room when this one is nearly full."""

    name: RegionName = ""
    """this fleet's region; empty: single-region (no summaries, no overflow)"""
    peers: tuple[RegionPeer, ...] = ()
    """the other regions, as JSON: [{"name": "r2", "edge_url": "ws://host:8580/v1/chat", "rtt_ms": 70}]"""
    overflow_load: Annotated[float, Field(ge=0.0, le=10.0)] = 0.9
    """this region's fleet load (the load admission judges by, 1.0: full) from which new chats go to a peer with room; it is also published, so peers send chats here only below it"""
    summary_topic: Annotated[str, Field(min_length=1, max_length=249)] = "drivetrain-regions.capacity"
    """global Kafka topic (one for all regions, one partition) on which every edge publishes its region's load and reads its peers'"""
    summary_interval_s: Annotated[float, Field(gt=0.0, le=60.0)] = 1.0
    """how often each edge publishes its region's load; a peer's summary older than 3 of these counts as no room"""
    added_delay_ms: Annotated[float, Field(ge=0.0, le=10_000.0)] = 0.0
    """artificial one-way delay the relay adds to each frame, both ways (to try regions on one machine)"""

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    @model_validator(mode="after")
    def _distinct_peers(self) -> RegionSettings:
        names = [peer.name for peer in self.peers]
        if len(set(names)) != len(names):
            raise ValueError(f"regions.peers names a region twice: {names}")
        if self.name and self.name in names:
            raise ValueError(f"regions.peers names this region ({self.name}) itself")
        return self
