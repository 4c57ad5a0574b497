"""One node's member table: applies alive/suspect/dead/left updates by SWIM precedence, runs suspicions, refutes."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator

from shared.membership.awareness import Awareness
from shared.membership.broadcast import BroadcastQueue
from shared.membership.member import GONE, MemberEvent, MemberState, Status, supersedes
from shared.membership.messages import (
    Alive,
    Dead,
    Left,
    StateRecord,
    Suspect,
    Update,
    encode,
)
from shared.membership.settings import MembershipSettings
from shared.membership.suspicion import Suspicion
from shared.membership.timing import expected_confirmations, suspicion_bounds


class MemberTable:
    """Every update that changes the table is queued for re-gossip and recorded as an event."""

    def __init__(
        self, me: MemberState, config: MembershipSettings, awareness: Awareness, broadcasts: BroadcastQueue
    ) -> None:
        self.me = me
        self.config = config
        self.awareness = awareness
        self.broadcasts = broadcasts
        self.members: dict[str, MemberState] = {me.id: me}
        self.peers: list[MemberState] = []  # everyone but us, for sampling without a scan
        self.suspicions: dict[str, Suspicion] = {}
        self.events: list[MemberEvent] = []
        self.joined: list[str] = []  # ids new to the table, for the prober to schedule
        self.leaving = False
        self.refutations = 0
        self._active = 1  # members not dead or left, kept current by _set_status
        self.digest = member_hash(me.id)  # XOR of member_hash over the same members

    # --- reading ---------------------------------------------------------------
    def get(self, member_id: str) -> MemberState | None:
        return self.members.get(member_id)

    def others(self) -> Iterator[MemberState]:
        return iter(self.peers)

    def active_peers(self) -> int:
        return self._active - (self.me.status not in GONE)

    def pick(self, rng: random.Random, k: int, eligible: Callable[[MemberState], bool]) -> list[MemberState]:
        """Up to k distinct random peers that are eligible; O(k) when most are, as in a healthy cluster."""
        if k <= 0:
            return []
        chosen: dict[str, MemberState] = {}
        for _ in range(4 * k if self.peers else 0):
            m = self.peers[rng.randrange(len(self.peers))]
            if m.id not in chosen and eligible(m):
                chosen[m.id] = m
                if len(chosen) == k:
                    return list(chosen.values())
        rest = [m for m in self.peers if m.id not in chosen and eligible(m)]
        return list(chosen.values()) + rng.sample(rest, min(k - len(chosen), len(rest)))

    def num_active(self) -> int:
        """Members not dead or left, this node included: the N of the timing formulas."""
        return self._active

    def records(self) -> list[StateRecord]:
        return [to_record(m) for m in self.members.values()]

    def next_deadline(self) -> float:
        return min((min(s.deadline, s.regossip_at) for s in self.suspicions.values()), default=float("inf"))

    # --- updates from others ---------------------------------------------------
    def apply(self, update: Update, now: float) -> bool:
        if isinstance(update, Alive):
            return self.apply_alive(update, now)
        if isinstance(update, Suspect):
            return self.apply_suspect(update, now)
        if isinstance(update, Dead):
            return self._apply_gone(update.member, update.incarnation, Status.DEAD, update, now)
        return self._apply_gone(update.member, update.incarnation, Status.LEFT, update, now)

    def apply_alive(self, a: Alive, now: float) -> bool:
        if a.member == self.me.id:
            if self.leaving or a.incarnation < self.me.incarnation:
                return False
            if a.incarnation == self.me.incarnation and a == self.self_alive():
                return False
            # Someone holds a newer or different account of us (we restarted, or a stale
            # meta): overrule it with a higher incarnation.
            self._refute(a.incarnation, now)
            return True
        m = self.members.get(a.member)
        if m is None:
            m = MemberState(a.member, a.role, a.host, a.port, status=Status.ALIVE, status_since=now)
            self.members[a.member] = m
            self.peers.append(m)
            self.joined.append(a.member)
            old: Status | None = None
        elif a.incarnation <= m.incarnation:
            return False
        else:
            old = m.status
        m.role, m.host, m.port, m.pid = a.role, a.host, a.port, a.pid
        m.addresses, m.load = dict(a.addresses), dict(a.load)
        self.suspicions.pop(m.id, None)
        self._set_status(m, Status.ALIVE, a.incarnation, now, old)
        self.broadcasts.queue(m.id, encode(a))
        return True

    def apply_suspect(self, s: Suspect, now: float) -> bool:
        m = self.members.get(s.member)
        if m is None:
            return False
        if m is self.me:
            if self.leaving or s.incarnation < self.me.incarnation:
                return False
            self._refute(s.incarnation, now)
            return True
        if m.status is Status.SUSPECT and s.incarnation == m.incarnation:
            timer = self.suspicions.get(m.id)
            if timer is not None and timer.confirm(s.by):
                # Re-gossip so that others count this independent accusation too.
                self.broadcasts.queue(m.id, encode(s))
                return True
            return False
        if not supersedes(Status.SUSPECT, s.incarnation, m.status, m.incarnation):
            return False
        n = self.num_active()
        shortest, longest = suspicion_bounds(
            self.config.suspicion_mult, self.config.suspicion_max_timeout_mult, n, self.config.probe_interval
        )
        expected = expected_confirmations(self.config.suspicion_mult, n)
        self.suspicions[m.id] = Suspicion(s.by, now, shortest, longest, expected)
        self._set_status(m, Status.SUSPECT, s.incarnation, now, m.status)
        self.broadcasts.queue(m.id, encode(s))
        return True

    def _apply_gone(self, member_id: str, incarnation: int, status: Status, update: Update, now: float) -> bool:
        m = self.members.get(member_id)
        if m is None:
            return False
        if m is self.me:
            if self.leaving or incarnation < self.me.incarnation:
                return False
            self._refute(incarnation, now)
            return True
        if not supersedes(status, incarnation, m.status, m.incarnation):
            return False
        self.suspicions.pop(m.id, None)
        self._set_status(m, status, incarnation, now, m.status)
        self.broadcasts.queue(m.id, encode(update))
        return True

    def merge_record(self, record: StateRecord, sender: str, now: float) -> bool:
        """A full-state entry from push/pull. A remote 'dead' only makes us suspect: we check for ourselves."""
        if record.status is Status.ALIVE:
            alive = Alive(
                record.member, record.incarnation, record.role, record.host, record.port,
                record.addresses, record.load, record.pid,
            )
            return self.apply_alive(alive, now)
        if record.status is Status.LEFT:
            return self.apply(Left(record.member, record.incarnation), now)
        return self.apply_suspect(Suspect(record.member, record.incarnation, sender), now)

    def correction(self, update: Update) -> bytes | None:
        """Our alive record of the member, if the update is an accusation we already know to be stale."""
        if isinstance(update, (Alive, Left)):
            return None
        m = self.members.get(update.member)
        if m is None or m.status is not Status.ALIVE or m.incarnation <= update.incarnation:
            return None
        return encode(to_alive(m))

    # --- this node's own doings ------------------------------------------------
    def suspect(self, member_id: str, now: float) -> bool:
        """A probe of member_id failed."""
        m = self.members.get(member_id)
        if m is None or m.status is not Status.ALIVE:
            return False
        return self.apply_suspect(Suspect(m.id, m.incarnation, self.me.id), now)

    def expire_suspicions(self, now: float) -> None:
        """Declare dead the suspects whose time ran out; re-gossip the ones still open after a while."""
        for member_id, suspicion in list(self.suspicions.items()):
            m = self.members[member_id]
            if suspicion.deadline <= now:
                self.apply(Dead(member_id, m.incarnation, self.me.id), now)
            elif suspicion.regossip_at <= now:
                suspicion.regossip_at = now + suspicion.shortest
                self.broadcasts.queue(member_id, encode(Suspect(member_id, m.incarnation, suspicion.first_by)))

    def publish_meta(self, addresses: dict[str, str], load: dict[str, int | float], now: float) -> None:
        """New addresses or load are news about ourselves: a new incarnation carries them."""
        if self.leaving:
            return  # an alive now would overrule our own goodbye
        self.me.addresses, self.me.load = dict(addresses), dict(load)
        self.me.incarnation += 1
        self.broadcasts.queue(self.me.id, encode(self.self_alive()))

    def leave(self, now: float) -> None:
        self.leaving = True
        self.me.status, self.me.status_since = Status.LEFT, now
        self._active -= 1
        self.digest ^= member_hash(self.me.id)
        self.broadcasts.queue(self.me.id, encode(Left(self.me.id, self.me.incarnation)))

    def prune(self, now: float) -> None:
        """Forget members gone for longer than dead_retention."""
        if len(self.members) == self._active + (self.me.status in GONE):
            return  # nobody gone
        cutoff = now - self.config.dead_retention
        expired = {m.id for m in self.peers if m.status in GONE and m.status_since < cutoff}
        if expired:
            self.peers = [m for m in self.peers if m.id not in expired]
            for member_id in expired:
                del self.members[member_id]

    def self_alive(self) -> Alive:
        return to_alive(self.me)

    def _refute(self, accused_incarnation: int, now: float) -> None:
        self.me.incarnation = max(self.me.incarnation, accused_incarnation) + 1
        self.refutations += 1
        # Being accused means others could not hear us: perhaps we are the slow one (Lifeguard).
        self.awareness.apply_delta(1)
        self.broadcasts.queue(self.me.id, encode(self.self_alive()))

    def _set_status(self, m: MemberState, status: Status, incarnation: int, now: float, old: Status | None) -> None:
        if old != status:
            m.status_since = now
            delta = (status not in GONE) - (old is not None and old not in GONE)
            self._active += delta
            if delta:
                self.digest ^= member_hash(m.id)
        m.status, m.incarnation = status, incarnation
        self.events.append(MemberEvent(m.view(), old, status))


def to_record(m: MemberState) -> StateRecord:
    return StateRecord(m.id, m.incarnation, m.status, m.role, m.host, m.port, m.addresses, m.load, m.pid)


def to_alive(m: MemberState) -> Alive:
    return Alive(m.id, m.incarnation, m.role, m.host, m.port, m.addresses, m.load, m.pid)


def member_hash(member_id: str) -> int:
    """A stable 64-bit hash (Python's str hash differs between processes)."""
    return int.from_bytes(hashlib.blake2b(member_id.encode(), digest_size=8).digest(), "big")
