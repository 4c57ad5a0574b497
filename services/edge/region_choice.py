"""Which region a new chat goes to: a pure function of this region's load and what is known of its peers.

A chat stays in its home region unless that region is at its overflow load; then the nearest
peer with room takes it. A peer has room when its latest summary is fresh and shows a load
under that peer's own overflow load: a peer that would overflow itself is never sent more,
so a chat is placed once and never bounces between regions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerRoom:
    """What this edge knows of one peer region now; `load` is None when its summary is missing or stale."""

    name: str
    rtt_ms: float
    load: float | None
    overflow_load: float

    @property
    def has_room(self) -> bool:
        return self.load is not None and self.load < self.overflow_load


def choose_region(here: str, load: float | None, overflow_load: float, peers: Sequence[PeerRoom]) -> str:
    """The name of the region the chat goes to: `here`, or the nearest peer with room.

    An unknown load here (no worker reported yet) keeps the chat here, as admission admits it
    then; a tie in round-trip time goes to the emptier peer, then to the first name.
    """
    if load is None or load < overflow_load:
        return here
    roomy = [peer for peer in peers if peer.has_room]
    if not roomy:
        return here  # admission here refuses it if this region is full for its tier
    return min(roomy, key=lambda peer: (peer.rtt_ms, peer.load, peer.name)).name
