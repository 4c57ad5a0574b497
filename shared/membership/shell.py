"""Membership: the asyncio shell services use; it binds a transport, drives a Node on a clock and fans out events.

Services run it on a thread of its own (`own_thread`): on a service's loop, a burst of
work that held the loop longer than a suspicion lasts (a second or two of load on a few
cores) left probes unanswered, and the others declared a busy, healthy process dead and
failed its streams. On its own thread it answers within the interpreter's switch interval;
only a service loop stalled past `stall_timeout` silences it, as a hung process should be.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Self

from shared.membership.loop_thread import LoopThread
from shared.membership.member import GONE, Address, MemberEvent, MemberView, Status
from shared.membership.node import Node, Outgoing
from shared.membership.settings import MembershipSettings
from shared.membership.transport import Transport, TransportFactory, UdpTransport

log = logging.getLogger(__name__)

# The loop wakes at least this often even when the node has nothing due, so a stuck clock heals.
MAX_SLEEP = 0.5
# How often a service's loop says it is still running, to a membership on its own thread.
HOME_BEAT_S = 0.1
Callback = Callable[[MemberEvent], None]
Step = Callable[[Node], Iterable[Outgoing]]


class Membership:
    """One process's membership: start(seeds) / stop(), set_load / set_addresses, members / alive, events.

    Events reach callbacks and queues on the loop that called `start`, whichever thread gossips;
    on its own thread, a moment after `members` and `alive` already show the change.
    """

    def __init__(
        self, config: MembershipSettings, member_id: str, role: str,
        addresses: dict[str, str] | None = None, load: dict[str, int | float] | None = None, *,
        transport_factory: TransportFactory | None = None, clock: Callable[[], float] = time.time,
        rng: random.Random | None = None, own_thread: bool = False,
    ) -> None:
        if not config.secret:
            raise ValueError("membership needs a shared secret (MembershipSettings.secret)")
        self.config = config
        self.id = member_id
        self.role = role
        self._addresses = dict(addresses or {})
        self._load = dict(load or {})
        self._factory = transport_factory or UdpTransport.open
        self._clock = clock
        self._rng = rng
        self._node: Node | None = None
        self._transport: Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._sleep_until = 0.0
        self._has_peers = asyncio.Event()
        self._queues: list[tuple[asyncio.Queue[MemberEvent], bool]] = []
        self._callbacks: list[Callback] = []
        self.events_dropped = 0
        self._own_thread = own_thread
        self._thread: LoopThread | None = None
        self._home: asyncio.AbstractEventLoop | None = None  # the caller's loop, where events are dispatched
        # Held while the node changes and by readers on other threads; the gossiping thread's own reads need none.
        self._lock = threading.Lock()
        self._home_beat = time.monotonic()
        self._beating: asyncio.Task[None] | None = None
        self._stalled = False

    # --- lifecycle -------------------------------------------------------------
    async def start(self, seeds: Sequence[Address] = ()) -> int:
        """Bind, join through the seeds and wait (up to join_timeout) to hear from one; returns members known.

        Unreachable seeds are not an error: the node keeps re-contacting them until one answers.
        """
        if self._task is not None or self._thread is not None:
            raise RuntimeError("membership already started")
        self._home = asyncio.get_running_loop()
        if not self._own_thread:
            return await self._start(seeds)
        self._home_beat = time.monotonic()
        self._thread = LoopThread(f"gossip-{self.id}")
        self._beating = asyncio.create_task(self._beat(), name=f"membership-beat-{self.id}")
        try:
            return await self._thread.run(self._start(seeds))
        except BaseException:
            await self.close()
            raise

    async def _start(self, seeds: Sequence[Address]) -> int:
        self._transport = await self._factory(self.config.host, self.config.port, self._on_datagram)
        _, port = self._transport.address
        advertised = (self.config.advertised_host, port)
        # Others send to what we advertise on every packet; a name would cost a lookup each time.
        resolved = await resolve_addresses([advertised], self.config.join_timeout)
        address = resolved[0] if resolved else advertised
        self._node = Node(
            self.config, self.id, self.role, address, addresses=self._addresses, load=self._load,
            pid=os.getpid(), rng=self._rng, now=self._clock(),
        )
        joined = await resolve_addresses(seeds, self.config.join_timeout)
        self._advance(lambda node: node.join(joined, self._clock()))
        self._task = asyncio.create_task(self._run(), name=f"membership-{self.id}")
        if seeds:
            try:
                await asyncio.wait_for(self._has_peers.wait(), self.config.join_timeout)
            except TimeoutError:
                log.warning("membership %s: no seed answered within %.1fs; still trying", self.id, self.config.join_timeout)
        return len(self.members())

    async def stop(self) -> None:
        """Announce `left`, let it spread (up to leave_timeout), then close."""
        try:
            await self._on_own_loop(self._stop())
        finally:
            self._end_thread()

    async def close(self) -> None:
        """Stop at once without a word, as a crash would look to the others."""
        try:
            await self._on_own_loop(self._close())
        finally:
            self._end_thread()

    async def _on_own_loop(self, work: Coroutine[Any, Any, None]) -> None:
        if self._thread is None:
            await work
        else:
            await self._thread.run(work)

    def _end_thread(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            self._beating = None
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.close()

    async def _stop(self) -> None:
        if self._node is None or self._task is None:
            return
        self._advance(lambda node: node.leave(self._clock()))
        self._wake.set()
        deadline = time.monotonic() + self.config.leave_timeout
        while self._node.broadcasts.pending(self.id) is not None and time.monotonic() < deadline:
            await asyncio.sleep(self.config.gossip_interval / 2)
        await self._close()

    async def _close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._transport is not None:
            await self._transport.close()
            self._transport = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- what services change --------------------------------------------------
    def set_load(self, load: dict[str, int | float]) -> None:
        """Publish new load figures (coalesced to one update per meta_min_interval)."""
        self._load = fresh = dict(load)
        self._on_node(lambda node: node.set_meta(self._clock(), load=fresh))

    def set_addresses(self, addresses: dict[str, str]) -> None:
        self._addresses = fresh = dict(addresses)
        self._on_node(lambda node: node.set_meta(self._clock(), addresses=fresh))

    def _on_node(self, step: Step) -> None:
        """Take `step` on the loop that gossips, from any thread; before `start` the node takes the values as it is built."""
        if self._node is None:
            return
        thread = self._thread
        if not self._own_thread:
            self._take(step)
        elif thread is not None:  # none once stopped
            with contextlib.suppress(RuntimeError):  # stopping: its loop has closed
                thread.loop.call_soon_threadsafe(self._take, step)

    def _take(self, step: Step) -> None:
        self._advance(step)
        self._wake.set()

    # --- what services read ----------------------------------------------------
    @property
    def address(self) -> Address:
        if self._node is None:
            raise RuntimeError("membership not started")
        return self._node.address  # set when the node is built, never changed

    @property
    def node(self) -> Node:
        if self._node is None:
            raise RuntimeError("membership not started")
        return self._node

    def members(self) -> list[MemberView]:
        with self._lock:
            return self._node.members() if self._node else []

    def member(self, member_id: str) -> MemberView | None:
        with self._lock:
            return self._node.member(member_id) if self._node else None

    def alive(self, role: str | None = None) -> list[MemberView]:
        """Members currently alive (suspects excluded), optionally of one role."""
        return [m for m in self.members() if m.status is Status.ALIVE and (role is None or m.role == role)]

    def snapshot(self) -> list[dict]:
        return [m.to_dict() for m in sorted(self.members(), key=lambda m: (m.role, m.id))]

    def drops(self) -> dict[str, int]:
        with self._lock:
            return {str(reason): n for reason, n in self._node.drops.items()} if self._node else {}

    def subscribe(self, maxsize: int = 1024, include_updates: bool = False) -> asyncio.Queue[MemberEvent]:
        """A queue of status changes (and, if asked, address/load updates). A full queue drops new events."""
        queue: asyncio.Queue[MemberEvent] = asyncio.Queue(maxsize)
        self._queues.append((queue, include_updates))
        return queue

    def unsubscribe(self, queue: asyncio.Queue[MemberEvent]) -> None:
        self._queues = [(q, u) for q, u in self._queues if q is not queue]

    def on_change(self, callback: Callback) -> Callable[[], None]:
        """Call callback(event) on each status change, from the event loop; returns an unregister function."""
        self._callbacks.append(callback)

        def unregister() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return unregister

    # --- plumbing --------------------------------------------------------------
    async def _run(self) -> None:
        node = self._node
        assert node is not None
        while True:
            now = self._clock()
            delay = min(max(node.next_deadline() - now, 0.0), MAX_SLEEP)
            self._sleep_until = now + delay
            self._wake.clear()
            # asyncio.timeout, not wait_for: on 3.11, wait_for with a zero timeout can swallow
            # the cancellation `close` sends, and the loop would outlive its membership.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            if self._home_stalled():  # as frozen as the service: no probes of others, no answers
                await asyncio.sleep(HOME_BEAT_S)
                continue
            try:
                self._advance(lambda node: node.on_tick(self._clock()))
            except Exception:
                # A fault in one tick must not end membership for the whole process.
                log.exception("membership %s: tick failed", self.id)
                await asyncio.sleep(self.config.probe_interval)

    def _on_datagram(self, data: bytes, source: Address) -> None:
        node = self._node
        if node is None or self._task is None or self._home_stalled():
            return
        try:
            self._advance(lambda node: node.on_packet(data, source, self._clock()))
        except Exception:
            log.exception("membership %s: packet from %s failed", self.id, source)
            return
        if node.next_deadline() < self._sleep_until:
            self._wake.set()

    def _advance(self, step: Step) -> None:
        """Move the node on (under the lock readers take), send what it says, and hand on its events."""
        node = self._node
        if node is None:
            return
        with self._lock:
            out = list(step(node))
            events = node.drain_events()
        if self._transport is not None:
            for item in out:
                self._transport.send(item.address, item.data)
        if not events:
            return
        if any(e.new_status not in GONE and e.member.id != self.id for e in events):
            self._has_peers.set()
        if not self._own_thread or self._home is None:
            self._dispatch(events)
        else:
            with contextlib.suppress(RuntimeError):  # the service's loop has closed: nobody left to tell
                self._home.call_soon_threadsafe(self._dispatch, events)

    async def _beat(self) -> None:
        """On the service's loop: it still runs (a membership on its own thread answers only while it does)."""
        while True:
            self._home_beat = time.monotonic()
            await asyncio.sleep(HOME_BEAT_S)

    def _home_stalled(self) -> bool:
        if not self._own_thread:
            return False
        stalled_s = time.monotonic() - self._home_beat
        stalled = stalled_s > self.config.stall_timeout
        if stalled != self._stalled:
            self._stalled = stalled
            if stalled:
                log.warning("membership %s: the service's loop has not run for %.1f s; gossip goes silent", self.id, stalled_s)
            else:
                log.info("membership %s: the service's loop runs again; gossip resumes", self.id)
        return stalled

    def _dispatch(self, events: list[MemberEvent]) -> None:
        for event in events:
            changed = event.old_status != event.new_status
            for queue, include_updates in self._queues:
                if changed or include_updates:
                    try:
                        queue.put_nowait(event)
                    except asyncio.QueueFull:
                        self.events_dropped += 1
            if changed:
                for callback in list(self._callbacks):
                    try:
                        callback(event)
                    except Exception:
                        log.exception("membership %s: on_change callback failed", self.id)


async def resolve_addresses(seeds: Sequence[Address], timeout: float) -> list[Address]:
    """Addresses with names turned into IPv4 addresses (answers come from an IP, and are matched to seeds).

    A name that does not resolve is skipped with a warning: another seed, or a member
    joining us later, connects us instead.
    """
    loop = asyncio.get_running_loop()
    resolved: list[Address] = []
    for host, port in seeds:
        try:
            ipaddress.ip_address(host)
            resolved.append((host, port))
            continue
        except ValueError:
            pass
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_DGRAM), timeout
            )
        except (OSError, TimeoutError) as exc:
            log.warning("membership seed %s:%d does not resolve: %s", host, port, exc)
            continue
        resolved.append((infos[0][4][0], infos[0][4][1]))
    return resolved
