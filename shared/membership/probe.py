"""Probe bookkeeping: the round-robin order of targets, one probe in flight, and pings relayed for others."""

from __future__ import annotations

import random
from dataclasses import dataclass

from shared.membership.member import GONE, Address, MemberState


@dataclass(slots=True)
class Probe:
    """This period's probe of one member: direct ping, then indirect pings, then a verdict at ends_at."""

    target: str
    probe_id: int
    indirect_at: float
    ends_at: float
    acked: bool = False
    indirect_sent: bool = False
    expected_nacks: int = 0
    nacks: int = 0


@dataclass(slots=True)
class Relay:
    """A ping we sent on another member's behalf (ping-req): its ack goes back to origin, else a nack at nack_at."""

    origin: Address
    origin_probe: int
    nack_at: float


class ProbeOrder:
    """Round-robin over a shuffled list, reshuffled each pass: every member is probed once per pass,
    which bounds the time to first detection, unlike picking at random."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.order: list[str] = []
        self.index = 0

    def add(self, member_id: str) -> None:
        """A newcomer goes in at a random place, so a burst of joins does not line up in probe order."""
        self.order.insert(self.rng.randint(self.index, len(self.order)), member_id)

    def next_target(self, members: dict[str, MemberState], me: str) -> MemberState | None:
        for _ in range(2):
            while self.index < len(self.order):
                m = members.get(self.order[self.index])
                self.index += 1
                if m is not None and m.id != me and m.status not in GONE:
                    return m
            self._reshuffle(members, me)
        return None

    def _reshuffle(self, members: dict[str, MemberState], me: str) -> None:
        self.order = [i for i, m in members.items() if i != me and m.status not in GONE]
        self.rng.shuffle(self.order)
        self.index = 0
