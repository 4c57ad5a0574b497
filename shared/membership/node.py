"""The SWIM node as a sans-I/O state machine: datagrams and clock ticks in, datagrams out; no sockets, no sleeping."""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec

from shared.membership.awareness import Awareness
from shared.membership.broadcast import BroadcastQueue
from shared.membership.codec import Codec, Drop
from shared.membership.config import MembershipConfig
from shared.membership.member import GONE, Address, MemberEvent, MemberState, MemberView, Status
from shared.membership.messages import (
    PIGGYBACKING, Ack, Body, Envelope, Gossip, MembersRequest, MembersResponse, Nack, Ping, PingReq,
    Suspect, Sync, decode_record, decode_update, encode,
)
from shared.membership.probe import Probe, ProbeOrder, Relay
from shared.membership.replay import ReplayGuard
from shared.membership.table import MemberTable
from shared.membership.timing import push_pull_interval, retransmit_limit
from shared.membership.writer import PacketWriter

# Never let an oversized meta crowd out everything else in a packet.
MAX_META_SHARE = 0.5
# Corrections sent back for stale accusations in one packet.
MAX_CORRECTIONS = 4


@dataclass(frozen=True, slots=True)
class Outgoing:
    address: Address
    data: bytes


class Node:
    """One member. `now` is seconds on a clock the cluster shares (wall time, or virtual time in a simulation)."""

    def __init__(
        self, config: MembershipConfig, member_id: str, role: str, address: Address, *,
        addresses: dict[str, str] | None = None, load: dict[str, int | float] | None = None,
        pid: int = 0, rng: random.Random | None = None, now: float = 0.0,
    ) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.awareness = Awareness(config.awareness_max_multiplier)
        self.broadcasts = BroadcastQueue()
        me = MemberState(member_id, role, address[0], address[1], dict(addresses or {}), dict(load or {}), pid,
                         status_since=now)
        self.table = MemberTable(me, config, self.awareness, self.broadcasts)
        self.codec = Codec(config.cluster_name, config.secret_bytes)
        # Sequence numbers start from the clock, so a restarted member is not taken for a replayer.
        self.writer = PacketWriter(self.codec, member_id, config.max_packet_size, int(now * 1_000_000))
        self.replay = ReplayGuard(config.replay_window)
        self.drops: collections.Counter[Drop] = collections.Counter()
        self.order = ProbeOrder(self.rng)
        self.probe: Probe | None = None
        self.relays: dict[int, Relay] = {}
        self._probe_ids = 0
        self._seeds: list[Address] = []
        self._strangers: dict[str, float] = {}  # unknown senders we swapped state with, and when
        self._pending_meta: tuple[dict[str, str], dict[str, int | float]] | None = None
        self._last_meta_at = float("-inf")
        self._next_probe = now
        self._next_gossip = now
        self._next_push_pull = now + config.push_pull_interval * self.rng.uniform(0.5, 1.0)
        self._next_rejoin = float("inf")
        self._next_prune = now + 1.0
        self._now = now
        self._out: list[Outgoing] = []

    # --- reading ---------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.table.me.id

    @property
    def address(self) -> Address:
        return self.table.me.address

    @property
    def leaving(self) -> bool:
        return self.table.leaving

    def members(self) -> list[MemberView]:
        return [m.view() for m in self.table.members.values()]

    def member(self, member_id: str) -> MemberView | None:
        m = self.table.get(member_id)
        return m.view() if m else None

    def has_peers(self) -> bool:
        return any(m.status not in GONE for m in self.table.others())

    def drain_events(self) -> list[MemberEvent]:
        events, self.table.events = self.table.events, []
        return events

    def pending_broadcasts(self) -> int:
        return len(self.broadcasts)

    def next_deadline(self) -> float:
        """When on_tick next has work to do; packets may bring it forward."""
        times = [self._next_prune, self.table.next_deadline(), self._next_rejoin, self._next_push_pull]
        if not self.leaving:
            times.append(self._next_probe)
        if self.probe is not None:
            times.append(self.probe.ends_at if self.probe.indirect_sent or self.probe.acked else self.probe.indirect_at)
        if self.relays:
            times.append(min(r.nack_at for r in self.relays.values()))
        if len(self.broadcasts):
            times.append(self._next_gossip)
        if self._pending_meta is not None:
            times.append(self._last_meta_at + self.config.meta_min_interval)
        return min(times)

    # --- commands --------------------------------------------------------------
    def join(self, seeds: Sequence[Address], now: float) -> list[Outgoing]:
        """Push our state to every seed and ask for theirs; repeated while we know nobody."""
        self._begin(now)
        self._seeds = [tuple(s) for s in seeds if tuple(s) != self.address]  # type: ignore[misc]
        self._push_pull_to(self._seeds)
        self._next_rejoin = now + self.config.rejoin_interval if self._seeds else float("inf")
        return self._flush()

    def leave(self, now: float) -> list[Outgoing]:
        """Announce `left`; keep ticking a little while so the news spreads (the shell does)."""
        self._begin(now)
        if not self.leaving:
            self.table.leave(now)
            self.probe = None
            self._gossip_round()
        return self._flush()

    def set_meta(
        self, now: float, *, addresses: dict[str, str] | None = None, load: dict[str, int | float] | None = None
    ) -> list[Outgoing]:
        """New addresses and/or load, published now or, if the last publication was recent, at the next due tick."""
        self._begin(now)
        me = self.table.me
        base = self._pending_meta or (me.addresses, me.load)
        wanted = (dict(addresses) if addresses is not None else base[0], dict(load) if load is not None else base[1])
        size = len(encode(msgspec.structs.replace(self.table.self_alive(), addresses=wanted[0], load=wanted[1])))
        if size > self.config.max_packet_size * MAX_META_SHARE:
            raise ValueError(f"member meta of {size} bytes does not fit in a gossip packet")
        if wanted != (me.addresses, me.load) or self._pending_meta is not None:
            self._pending_meta = wanted
            self._publish_meta_if_due(now)
        return self._flush()

    # --- input -----------------------------------------------------------------
    def on_packet(self, data: bytes, source: Address, now: float) -> list[Outgoing]:
        """Handle one datagram. Anything bad is dropped and counted, never raised."""
        self._begin(now)
        envelope = self.codec.open(data)
        if isinstance(envelope, Drop):
            self.drops[envelope] += 1
            return []
        if not self.replay.accept(envelope.sender, envelope.seq, envelope.ts, now):
            self.drops[Drop.REPLAYED] += 1
            return []
        body = envelope.body
        if isinstance(body, PIGGYBACKING):
            self._apply_updates(body.updates, source)
            self._sync_if_stranger(envelope.sender, source)
        self._handle(envelope, body, source)
        return self._flush()

    def on_tick(self, now: float) -> list[Outgoing]:
        self._begin(now)
        self._step_probe(now)
        self._expire_relays(now)
        self.table.expire_suspicions(now)
        if now >= self._next_gossip:
            self._next_gossip = now + self.config.gossip_interval
            self._gossip_round()
        if now >= self._next_push_pull:
            self._next_push_pull = now + push_pull_interval(self.config.push_pull_interval, self.table.num_active())
            self._periodic_push_pull()
        if now >= self._next_rejoin:
            self._next_rejoin = now + self.config.rejoin_interval
            if not self.leaving and not self.has_peers():
                self._push_pull_to(self._seeds)
        self._publish_meta_if_due(now)
        if now >= self._next_prune:
            self._next_prune = now + 1.0
            self.table.prune(now)
            self.replay.prune(now)
            self._strangers = {k: t for k, t in self._strangers.items() if now - t < self.config.rejoin_interval}
        return self._flush()

    # --- packet handlers -------------------------------------------------------
    def _handle(self, envelope: Envelope, body: Body, source: Address) -> None:
        if isinstance(body, Ping):
            if body.target == self.id:
                self._send_updates(source, lambda u: Ack(body.probe, u))
        elif isinstance(body, PingReq):
            self._relay(body, source)
        elif isinstance(body, Ack):
            self._on_ack(body.probe)
        elif isinstance(body, Nack):
            if self.probe is not None and self.probe.probe_id == body.probe:
                self.probe.nacks += 1
        elif isinstance(body, Sync):
            self._merge_records(body.states, envelope.sender)
            if body.request:
                self._send_state(source, lambda s, i, n: Sync(False, s))
        elif isinstance(body, MembersRequest):
            self._send_state(source, lambda s, i, n: MembersResponse(body.request_id, i, n, s))

    def _apply_updates(self, blobs: list[bytes], source: Address) -> None:
        corrections: list[bytes] = []
        for blob in blobs:
            try:
                update = decode_update(blob)
            except ValueError:  # msgspec's DecodeError and ValidationError both are
                self.drops[Drop.BAD_UPDATE] += 1
                continue
            if not self.table.apply(update, self._now):
                fix = self.table.correction(update)
                if fix is not None and len(corrections) < MAX_CORRECTIONS:
                    corrections.append(fix)
        self._schedule_newcomers()
        if corrections:
            # The sender missed a refutation we heard; tell it directly rather than
            # hoping random gossip reaches it before its suspicion runs out.
            self._send_updates(source, Gossip, corrections)

    def _sync_if_stranger(self, sender: str, source: Address) -> None:
        """A member that talks to us but is not in our table: our views have drifted, so swap full state."""
        if sender in self.table.members or self.leaving:
            return
        if self._now - self._strangers.get(sender, float("-inf")) < self.config.rejoin_interval:
            return
        self._strangers[sender] = self._now
        self._push_pull_to([source])

    def _merge_records(self, blobs: list[bytes], sender: str) -> None:
        for blob in blobs:
            try:
                record = decode_record(blob)
            except ValueError:
                self.drops[Drop.BAD_UPDATE] += 1
                continue
            self.table.merge_record(record, sender, self._now)
        self._schedule_newcomers()

    def _schedule_newcomers(self) -> None:
        for member_id in self.table.joined:
            self.order.add(member_id)
        self.table.joined.clear()

    def _relay(self, body: PingReq, source: Address) -> None:
        relay_id = self._next_probe_id()
        self.relays[relay_id] = Relay(source, body.probe, self._now + self.config.probe_timeout)
        self._send_updates((body.host, body.port), lambda u: Ping(relay_id, body.target, u))

    def _on_ack(self, probe_id: int) -> None:
        relay = self.relays.pop(probe_id, None)
        if relay is not None:
            self._send_updates(relay.origin, lambda u: Ack(relay.origin_probe, u))
        elif self.probe is not None and self.probe.probe_id == probe_id and not self.probe.acked:
            self.probe.acked = True
            self.awareness.apply_delta(-1)

    # --- the probe cycle -------------------------------------------------------
    def _step_probe(self, now: float) -> None:
        probe = self.probe
        if probe is not None:
            if not probe.acked and not probe.indirect_sent and now >= probe.indirect_at:
                self._probe_indirectly(probe)
            if now >= probe.ends_at:
                self._conclude(probe, now)
                self.probe = None
        if self.probe is None and not self.leaving and now >= self._next_probe:
            self._start_probe(now)

    def _start_probe(self, now: float) -> None:
        period = self.awareness.scale(self.config.probe_interval)
        self._next_probe = now + period
        target = self.order.next_target(self.table.members, self.id)
        if target is None:
            return
        probe_id = self._next_probe_id()
        self.probe = Probe(target.id, probe_id, now + self.awareness.scale(self.config.probe_timeout), now + period)
        # Lifeguard's buddy system: tell a suspect it is suspected, so it can refute at once.
        first = [encode(Suspect(target.id, target.incarnation, self.id))] if target.status is Status.SUSPECT else None
        self._send_updates(target.address, lambda u: Ping(probe_id, target.id, u), first)

    def _probe_indirectly(self, probe: Probe) -> None:
        probe.indirect_sent = True
        target = self.table.get(probe.target)
        if target is None or target.status in GONE:
            return
        helpers = [m for m in self.table.others() if m.status is Status.ALIVE and m.id != target.id]
        for helper in self.rng.sample(helpers, min(self.config.indirect_checks, len(helpers))):
            self._send_updates(
                helper.address, lambda u: PingReq(probe.probe_id, target.id, target.host, target.port, u)
            )
            probe.expected_nacks += 1

    def _conclude(self, probe: Probe, now: float) -> None:
        if probe.acked:
            return
        # Helpers that did answer with a nack prove our own links work; missing nacks
        # (or no helpers at all) suggest the fault may be ours.
        missing = probe.expected_nacks - probe.nacks if probe.expected_nacks else 1
        self.awareness.apply_delta(max(0, missing))
        self.table.suspect(probe.target, now)

    def _expire_relays(self, now: float) -> None:
        for relay_id in [i for i, r in self.relays.items() if r.nack_at <= now]:
            relay = self.relays.pop(relay_id)
            self._send_updates(relay.origin, lambda u: Nack(relay.origin_probe, u))

    def _next_probe_id(self) -> int:
        self._probe_ids += 1
        return self._probe_ids

    # --- dissemination ---------------------------------------------------------
    def _gossip_round(self) -> None:
        if not len(self.broadcasts):
            return
        recent = self._now - self.config.gossip_to_dead_time
        candidates = [m for m in self.table.others() if m.status not in GONE or m.status_since >= recent]
        for target in self.rng.sample(candidates, min(self.config.gossip_nodes, len(candidates))):
            if not len(self.broadcasts):
                return
            self._send_updates(target.address, Gossip)

    def _periodic_push_pull(self) -> None:
        if self.leaving:
            return
        peers = [m for m in self.table.others() if m.status is Status.ALIVE]
        if peers:
            self._push_pull_to([self.rng.choice(peers).address])

    def _push_pull_to(self, addresses: Sequence[Address]) -> None:
        for address in addresses:
            self._send_state(address, lambda s, i, n: Sync(True, s))

    def _publish_meta_if_due(self, now: float) -> None:
        if self._pending_meta is None or now < self._last_meta_at + self.config.meta_min_interval:
            return
        addresses, load = self._pending_meta
        self._pending_meta = None
        self._last_meta_at = now
        if (addresses, load) != (self.table.me.addresses, self.table.me.load):
            self.table.publish_meta(addresses, load, now)

    # --- output ----------------------------------------------------------------
    def _send_updates(
        self, address: Address, make_body: Callable[[list[bytes]], Body], first: list[bytes] | None = None
    ) -> None:
        limit = retransmit_limit(self.config.retransmit_mult, self.table.num_active())
        data = self.writer.with_updates(make_body, self.broadcasts, limit, self._now, first)
        self._out.append(Outgoing(address, data))

    def _send_state(self, address: Address, make_body: Callable[[list[bytes], int, int], Body]) -> None:
        blobs = [encode(r) for r in self.table.records()]
        for data in self.writer.chunked(blobs, make_body, self._now):
            self._out.append(Outgoing(address, data))

    def _begin(self, now: float) -> None:
        self._now = now
        self._out = []

    def _flush(self) -> list[Outgoing]:
        out, self._out = self._out, []
        return out
