"""The probe cycle: a round-robin order of targets, one probe per period (direct, then indirect), relayed pings."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from shared.membership.awareness import Awareness
from shared.membership.member import GONE, Address, MemberState, Status
from shared.membership.messages import Ack, Body, Nack, Ping, PingReq, Suspect, encode
from shared.membership.settings import MembershipSettings
from shared.membership.table import MemberTable

NACK_FRACTION = 0.8
# send(address, make_body, first): seal make_body(updates) with piggybacked updates, `first` ahead of them.
Send = Callable[[Address, Callable[[list[bytes]], Body], "list[bytes] | None"], None]


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
            self.order = [i for i, m in members.items() if i != me and m.status not in GONE]
            self.rng.shuffle(self.order)
            self.index = 0
        return None


class Prober:
    """Runs SWIM's failure detector for one node; verdicts go to the table, health to awareness."""

    def __init__(
        self, config: MembershipSettings, table: MemberTable, awareness: Awareness, rng: random.Random,
        send: Send, now: float,
    ) -> None:
        self.config = config
        self.table = table
        self.awareness = awareness
        self.rng = rng
        self.send = send
        self.order = ProbeOrder(rng)
        self.probe: Probe | None = None
        self.relays: dict[int, Relay] = {}
        self.next_probe = now
        self._ids = 0

    def next_deadline(self) -> float:
        times = [float("inf") if self.table.leaving else self.next_probe]
        if self.probe is not None:
            p = self.probe
            times.append(p.ends_at if p.indirect_sent or p.acked else p.indirect_at)
        if self.relays:
            times.append(min(r.nack_at for r in self.relays.values()))
        return min(times)

    def step(self, now: float) -> None:
        probe = self.probe
        if probe is not None:
            if not probe.acked and not probe.indirect_sent and now >= probe.indirect_at:
                self._probe_indirectly(probe)
            if now >= probe.ends_at:
                self._conclude(probe, now)
                self.probe = None
        if self.probe is None and not self.table.leaving and now >= self.next_probe:
            self._start(now)
        for relay_id in [i for i, r in self.relays.items() if r.nack_at <= now]:
            relay = self.relays.pop(relay_id)
            self.send(relay.origin, lambda u, r=relay: Nack(r.origin_probe, u), None)

    def relay(self, request: PingReq, source: Address, now: float) -> None:
        relay_id = self._next_id()
        # The nack must reach the asker before its probe period ends; the asker sent us the request
        # one probe timeout into a period at least twice as long, so 80% of a timeout leaves room.
        self.relays[relay_id] = Relay(source, request.probe, now + NACK_FRACTION * self.config.probe_timeout)
        view = self.table.digest
        self.send((request.host, request.port), lambda u: Ping(relay_id, request.target, view, u), None)

    def on_ack(self, probe_id: int) -> None:
        relay = self.relays.pop(probe_id, None)
        if relay is not None:
            self.send(relay.origin, lambda u: Ack(relay.origin_probe, u), None)
        elif self.probe is not None and self.probe.probe_id == probe_id and not self.probe.acked:
            self.probe.acked = True
            self.awareness.apply_delta(-1)

    def on_nack(self, probe_id: int) -> None:
        if self.probe is not None and self.probe.probe_id == probe_id:
            self.probe.nacks += 1

    def _start(self, now: float) -> None:
        period = self.awareness.scale(self.config.probe_interval)
        self.next_probe = now + period
        target = self.order.next_target(self.table.members, self.table.me.id)
        if target is None:
            return
        probe_id = self._next_id()
        self.probe = Probe(target.id, probe_id, now + self.awareness.scale(self.config.probe_timeout), now + period)
        # Lifeguard's buddy system: tell a suspect it is suspected, so it can refute at once.
        first = None
        if target.status is Status.SUSPECT:
            first = [encode(Suspect(target.id, target.incarnation, self.table.me.id))]
        view = self.table.digest
        self.send(target.address, lambda u: Ping(probe_id, target.id, view, u), first)

    def _probe_indirectly(self, probe: Probe) -> None:
        probe.indirect_sent = True
        target = self.table.get(probe.target)
        if target is None or target.status in GONE:
            return
        helpers = self.table.pick(
            self.rng, self.config.indirect_checks, lambda m: m.status is Status.ALIVE and m.id != target.id
        )
        for helper in helpers:
            self.send(helper.address, lambda u: PingReq(probe.probe_id, target.id, target.host, target.port, u), None)
            probe.expected_nacks += 1

    def _conclude(self, probe: Probe, now: float) -> None:
        if probe.acked:
            return
        # Helpers that did answer with a nack prove our own links work; missing nacks
        # (or no helpers at all) suggest the fault may be ours.
        missing = probe.expected_nacks - probe.nacks if probe.expected_nacks else 1
        self.awareness.apply_delta(max(0, missing))
        self.table.suspect(probe.target, now)

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids
