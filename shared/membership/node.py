"""The SWIM node as a sans-I/O state machine: datagrams and clock ticks in, datagrams out; no sockets, no sleeping."""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from shared.membership.awareness import Awareness
from shared.membership.broadcast import BroadcastQueue
from shared.membership.codec import Codec, Drop
from shared.membership.member import GONE, Address, MemberEvent, MemberState, MemberView
from shared.membership.messages import (
    PIGGYBACKING,
    Ack,
    Body,
    Envelope,
    Gossip,
    MembersRequest,
    MembersResponse,
    Nack,
    Ping,
    PingReq,
    Sync,
    decode_record,
    decode_update,
    encode,
)
from shared.membership.probe import Prober
from shared.membership.replay import ReplayGuard
from shared.membership.settings import MembershipSettings
from shared.membership.sync import AntiEntropy
from shared.membership.table import MemberTable
from shared.membership.timing import retransmit_limit
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
        self, config: MembershipSettings, member_id: str, role: str, address: Address, *,
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
        self.prober = Prober(config, self.table, self.awareness, self.rng, self._send_updates, now)
        self.sync = AntiEntropy(config, self.table, self.rng, self._push_state, now)
        self._pending_meta: tuple[dict[str, str], dict[str, int | float]] | None = None
        self._last_meta_at = float("-inf")
        self._next_gossip = now
        self._next_prune = now + 1.0
        self._next_replay_prune = now + config.replay_window
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
        return self.table.active_peers() > 0

    def drain_events(self) -> list[MemberEvent]:
        events, self.table.events = self.table.events, []
        return events

    def pending_broadcasts(self) -> int:
        return len(self.broadcasts)

    def next_deadline(self) -> float:
        """When on_tick next has work to do; packets may bring it forward."""
        times = [self._next_prune, self.table.next_deadline(), self.sync.next_deadline(), self.prober.next_deadline()]
        if len(self.broadcasts):
            times.append(self._next_gossip)
        if self._pending_meta is not None:
            times.append(self._last_meta_at + self.config.meta_min_interval)
        return min(times)

    # --- commands --------------------------------------------------------------
    def join(self, seeds: Sequence[Address], now: float) -> list[Outgoing]:
        """Push our state to every seed (IP addresses) and ask for theirs; repeated until a seed answers,
        and again whenever we know nobody else."""
        self._begin(now)
        self.sync.join(seeds, self.address, now)
        return self._flush()

    def leave(self, now: float) -> list[Outgoing]:
        """Announce `left`; keep ticking a little while so the news spreads (the shell does)."""
        self._begin(now)
        if not self.leaving:
            self.table.leave(now)
            self.prober.probe = None
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
            if envelope.sender not in self.table.members:
                # A member talks to us that we never heard of: our views have drifted apart.
                self.sync.resync_with(envelope.sender, source, now)
        self._handle(envelope, body, source)
        return self._flush()

    def on_tick(self, now: float) -> list[Outgoing]:
        self._begin(now)
        self.prober.step(now)
        self.table.expire_suspicions(now)
        if now >= self._next_gossip:
            self._next_gossip = now + self.config.gossip_interval
            self._gossip_round()
        self.sync.step(now)
        self._publish_meta_if_due(now)
        if now >= self._next_prune:
            self._next_prune = now + 1.0
            self.table.prune(now)
        if now >= self._next_replay_prune:
            self._next_replay_prune = now + self.config.replay_window
            self.replay.prune(now)
        return self._flush()

    # --- packet handlers -------------------------------------------------------
    def _handle(self, envelope: Envelope, body: Body, source: Address) -> None:
        if isinstance(body, Ping):
            if body.target == self.id:
                self._send_updates(source, lambda u: Ack(body.probe, u))
                if body.view != self.table.digest:
                    self.sync.resync_with(envelope.sender, source, self._now)
        elif isinstance(body, PingReq):
            self.prober.relay(body, source, self._now)
        elif isinstance(body, Ack):
            self.prober.on_ack(body.probe)
        elif isinstance(body, Nack):
            self.prober.on_nack(body.probe)
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
            self.prober.order.add(member_id)
        self.table.joined.clear()

    # --- dissemination ---------------------------------------------------------
    def _gossip_round(self) -> None:
        if not len(self.broadcasts):
            return
        recent = self._now - self.config.gossip_to_dead_time
        targets = self.table.pick(
            self.rng, self.config.gossip_nodes, lambda m: m.status not in GONE or m.status_since >= recent
        )
        for target in targets:
            if not len(self.broadcasts):
                return
            self._send_updates(target.address, Gossip)

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

    def _push_state(self, address: Address) -> None:
        self._send_state(address, lambda s, i, n: Sync(True, s))

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
