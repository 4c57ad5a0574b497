"""A whole cluster in virtual time: Nodes driven by an event queue over the fault model, no sockets, no sleeping."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from shared.membership.member import Address, Status
from shared.membership.memory import FaultModel
from shared.membership.node import Node, Outgoing
from shared.membership.settings import MembershipSettings

_TICK, _PACKET, _STOP = 0, 1, 2
# Deadlines are never scheduled closer than this, so a node cannot spin at one instant.
_MIN_STEP = 1e-6


@dataclass(frozen=True, slots=True)
class Change:
    """A status change as one observer saw it, at virtual time `at`."""

    at: float
    observer: str
    member: str
    old: Status | None
    new: Status


class Simulation:
    """Deterministic for a given seed: every random choice comes from generators derived from it."""

    def __init__(
        self, config: MembershipSettings, seed: int = 0, loss: float = 0.0, delay: tuple[float, float] = (0.0005, 0.002)
    ) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.faults = FaultModel(random.Random(self.rng.random()), loss, delay)
        self.now = 0.0
        self.nodes: dict[str, Node] = {}
        self.stopped: set[str] = set()
        self.changes: list[Change] = []
        self._by_address: dict[Address, str] = {}
        self._queue: list[tuple[float, int, int, object]] = []
        self._tick_at: dict[str, float] = {}
        self._order = 0
        self.packets_sent = 0
        self.bytes_sent = 0

    # --- building and breaking the cluster ------------------------------------
    def add(self, member_id: str, role: str = "worker", seeds: Sequence[str] = (), **meta: dict) -> Node:
        n = len(self.nodes) + 1
        address = (f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}", 7946)
        return self._start(member_id, role, address, seeds, n, meta)

    def restart(self, member_id: str, seeds: Sequence[str] = ()) -> Node:
        """A crashed member comes back as a new process: same id and address, none of its old state."""
        old = self.nodes[member_id]
        self.stopped.discard(member_id)
        self.faults.revive(old.address)
        return self._start(member_id, old.table.me.role, old.address, seeds, old.table.me.pid + len(self.nodes), {})

    def _start(self, member_id: str, role: str, address: Address, seeds: Sequence[str], pid: int, meta: dict) -> Node:
        node = Node(
            self.config, member_id, role, address, rng=random.Random(self.rng.random()), now=self.now, pid=pid,
            addresses=meta.get("addresses"), load=meta.get("load"),
        )
        self.nodes[member_id] = node
        self._by_address[address] = member_id
        self._after(node, node.join([self.nodes[s].address for s in seeds], self.now))
        return node

    def crash(self, member_id: str) -> None:
        """Stops the node without a word: its packets vanish from now on."""
        self.stopped.add(member_id)
        self.faults.kill(self.nodes[member_id].address)

    def leave(self, member_id: str, grace: float | None = None) -> None:
        """Graceful leave: announce, keep gossiping for `grace` seconds, then stop."""
        node = self.nodes[member_id]
        self._after(node, node.leave(self.now))
        self._push(self.now + (self.config.leave_timeout if grace is None else grace), _STOP, member_id)

    def partition(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        self.faults.cut([self.nodes[i].address for i in side_a], [self.nodes[i].address for i in side_b])

    def inject(self, member_id: str, data: bytes, source: Address) -> None:
        """Deliver a hand-made datagram to a node now."""
        node = self.nodes[member_id]
        self._after(node, node.on_packet(data, source, self.now))

    # --- running ---------------------------------------------------------------
    def run_until(self, until: float) -> None:
        while self._queue and self._queue[0][0] <= until:
            at, _, kind, item = heapq.heappop(self._queue)
            self.now = at
            if kind == _PACKET:
                member_id, data, source = item  # type: ignore[misc]
                if member_id not in self.stopped:
                    node = self.nodes[member_id]
                    self._after(node, node.on_packet(data, source, at))
            elif kind == _TICK:
                if item in self.stopped or self._tick_at.get(item) != at:  # type: ignore[arg-type]
                    continue  # a tick superseded by an earlier one
                node = self.nodes[item]  # type: ignore[index]
                self._tick_at[node.id] = float("inf")
                self._after(node, node.on_tick(at))
            else:
                self.crash(item)  # type: ignore[arg-type]
        self.now = max(self.now, until)

    def run_for(self, seconds: float) -> None:
        self.run_until(self.now + seconds)

    def run_until_true(self, predicate: Callable[[], bool], timeout: float, step: float) -> float | None:
        """Virtual seconds from now until predicate holds (checked every `step`), or None on timeout."""
        start = self.now
        while self.now - start <= timeout:
            if predicate():
                return self.now - start
            self.run_for(step)
        return None

    # --- observing -------------------------------------------------------------
    def live(self) -> list[Node]:
        return [n for i, n in self.nodes.items() if i not in self.stopped]

    def status(self, observer: str, member: str) -> Status | None:
        view = self.nodes[observer].table.get(member)
        return view.status if view else None

    def all_see(self, member: str, statuses: Iterable[Status]) -> bool:
        wanted = set(statuses)
        return all(self.status(n.id, member) in wanted for n in self.live() if n.id != member)

    def converged(self) -> bool:
        """Every running node sees every running node alive."""
        ids = [n.id for n in self.live()]
        return all(self.status(n.id, m) is Status.ALIVE for n in self.live() for m in ids)

    # --- plumbing --------------------------------------------------------------
    def _after(self, node: Node, out: list[Outgoing]) -> None:
        for item in out:
            self._send(node.address, item)
        for event in node.drain_events():
            if event.old_status != event.new_status:
                self.changes.append(Change(self.now, node.id, event.member.id, event.old_status, event.new_status))
        due = max(node.next_deadline(), self.now + _MIN_STEP)
        if due < self._tick_at.get(node.id, float("inf")):
            self._tick_at[node.id] = due
            self._push(due, _TICK, node.id)

    def _send(self, source: Address, item: Outgoing) -> None:
        self.packets_sent += 1
        self.bytes_sent += len(item.data)
        destination = self._by_address.get(item.address)
        delay = self.faults.fate(source, item.address)
        if destination is not None and delay is not None:
            self._push(self.now + delay, _PACKET, (destination, item.data, source))

    def _push(self, at: float, kind: int, item: object) -> None:
        self._order += 1
        heapq.heappush(self._queue, (at, self._order, kind, item))
