"""The asyncio Membership shell: three members over real UDP on loopback, and the shell on the in-memory network."""

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest

from shared.membership import (
    InMemoryNetwork,
    Membership,
    MembershipSettings,
    Status,
    members_json,
    members_table,
    query_members,
)
from shared.membership.loop_thread import LoopThread

# Anything stuck fails fast, with a stack dump, instead of at the suite-wide limit.
pytestmark = pytest.mark.timeout(60)

CONFIG = MembershipSettings()


async def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def statuses(member: Membership) -> dict[str, Status]:
    return {m.id: m.status for m in member.members()}


async def test_three_members_over_udp_join_share_load_and_detect_a_crash():
    edge = Membership(CONFIG, "edge-0", "edge", addresses={"internal": "127.0.0.1:9100"}, load={"connections": 0})
    worker = Membership(CONFIG, "worker-0", "worker", load={"running": 0})
    router = Membership(CONFIG, "router-0", "router")
    try:
        await edge.start()
        events = edge.subscribe()
        assert await worker.start([edge.address]) >= 2
        assert await router.start([edge.address]) >= 2
        everyone = {"edge-0", "worker-0", "router-0"}
        for member in (edge, worker, router):
            await wait_for(lambda m=member: {i for i, s in statuses(m).items() if s is Status.ALIVE} == everyone,
                           3.0, f"{member.id} to see all three alive")
        assert [m.id for m in router.alive(role="edge")] == ["edge-0"]
        assert router.member("edge-0").addresses == {"internal": "127.0.0.1:9100"}

        worker.set_load({"running": 5, "free_kv_blocks": 900})
        await wait_for(lambda: router.member("worker-0").load.get("running") == 5, 2.0, "load to reach the router")

        rows = await query_members(edge.address, CONFIG)
        assert {r["id"] for r in rows} == everyone and json.loads(members_json(rows)) == rows
        assert "worker-0" in members_table(rows)

        await worker.close()  # a crash: no goodbye
        took = await wait_for(lambda: edge.member("worker-0").status is Status.DEAD
                              and router.member("worker-0").status is Status.DEAD, 6.0, "the crash to be detected")
        assert took < 4.0
        seen = []
        while not events.empty():
            event = events.get_nowait()
            if event.member.id == "worker-0":
                seen.append((event.old_status, event.new_status))
        assert seen[-2:] == [(Status.ALIVE, Status.SUSPECT), (Status.SUSPECT, Status.DEAD)]
        assert edge.drops() == {} and router.drops() == {}
    finally:
        for member in (router, worker, edge):
            await member.close()


def hold_the_loop(seconds: float) -> None:
    """Python work that keeps this thread's loop from running (it yields the interpreter between bytecodes)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@contextlib.asynccontextmanager
async def worker_beside_others(config: MembershipSettings):
    """worker-0's service loop is this test's; edge-0's and router-0's run on another thread.
    Yields the three and the (member, status) changes edge-0 saw, with the threads it saw them on."""
    others = LoopThread("others")
    edge = Membership(config, "edge-0", "edge", own_thread=True)
    router = Membership(config, "router-0", "router", own_thread=True)
    worker = Membership(config, "worker-0", "worker", own_thread=True)
    changes = []
    edge.on_change(lambda event: changes.append((event.member.id, event.new_status, threading.current_thread().name)))
    try:
        await others.run(edge.start())
        await others.run(router.start([edge.address]))
        await worker.start([edge.address])
        await wait_for(lambda: len(edge.alive()) == 3 and len(worker.alive()) == 3, 3.0, "all three alive")
        # The views change on the gossip threads; the events reach the edge's loop a moment later.
        await wait_for(lambda: {m for m, status, _ in changes if status is Status.ALIVE} == {"router-0", "worker-0"},
                       3.0, "the edge's loop to hear of both joins")
        yield edge, router, worker, changes
    finally:
        await worker.close()
        await others.run(router.close())
        await others.run(edge.close())
        others.close()


async def test_a_member_whose_service_loop_is_held_longer_than_a_suspicion_lasts_stays_alive():
    """Gossip answers on its own thread: seconds of load on the service's loop are no crash."""
    async with worker_beside_others(CONFIG) as (edge, router, worker, changes):
        hold_the_loop(3.0)  # suspicion lasts 0.6-1.2 s here
        await asyncio.sleep(0.5)
        assert [status for member_id, status, _ in changes if member_id == "worker-0"] == [Status.ALIVE]  # its join
        assert [m.status for m in (edge.member("worker-0"), router.member("worker-0"))] == [Status.ALIVE] * 2
        worker.set_load({"running": 7})
        await wait_for(lambda: edge.member("worker-0").load.get("running") == 7, 2.0, "load set from the service's loop")
        assert {thread for _, _, thread in changes} == {"others"}  # events reach the loop that started the member


async def test_a_member_whose_service_loop_stalls_past_the_stall_timeout_is_declared_dead_then_refutes():
    async with worker_beside_others(CONFIG.replace(stall_timeout=1.0)) as (edge, router, worker, changes):
        hold_the_loop(4.0)  # silent from 1 s on: suspected, then dead within another 2.5 s

        def seen_of_worker():
            return [status for member_id, status, _ in changes if member_id == "worker-0"]

        await wait_for(lambda: seen_of_worker()[-1] is Status.ALIVE, 3.0, "the member to come back")
        assert seen_of_worker()[1:3] == [Status.SUSPECT, Status.DEAD]


async def test_junk_datagrams_to_a_member_on_its_own_thread_are_dropped_and_counted():
    """What anyone on the network can send reaches the gossip thread: it must drop it, count it, and go on."""
    async with worker_beside_others(CONFIG) as (edge, router, worker, changes):
        junk = [b"", b"\xc1\xff\x00garbage", b"\x93\x01\xc0\xc0", b"\x00" * 60_000, json.dumps({"type": "ping"}).encode()]
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for datagram in junk * 4:
                sender.sendto(datagram, worker.address)
                await asyncio.sleep(0.005)  # within the socket's receive buffer
        finally:
            sender.close()
        await wait_for(lambda: sum(worker.drops().values()) >= len(junk) * 4, 3.0, "every datagram dropped and counted")
        await asyncio.sleep(0.5)
        assert [status for member_id, status, _ in changes if member_id == "worker-0"] == [Status.ALIVE]


async def test_graceful_stop_is_seen_as_left_and_callbacks_fire():
    network = InMemoryNetwork()
    a = Membership(CONFIG, "a", "edge", transport_factory=network.open)
    b = Membership(CONFIG, "b", "worker", transport_factory=network.open)
    changes = []
    try:
        await a.start()
        unregister = a.on_change(lambda e: changes.append((e.member.id, e.old_status, e.new_status)))
        await b.start([a.address])
        await wait_for(lambda: a.member("b") is not None, 2.0, "b to join")
        await b.stop()
        await wait_for(lambda: a.member("b").status is Status.LEFT, 2.0, "a to see b leave")
        assert changes == [("b", None, Status.ALIVE), ("b", Status.ALIVE, Status.LEFT)]
        unregister()
        assert a.snapshot()[0]["id"] == "a"
    finally:
        await a.close()
        await b.close()


async def test_unanswered_seeds_do_not_fail_start_and_are_retried():
    network = InMemoryNetwork()
    config = MembershipSettings(join_timeout=0.2)
    late = Membership(config, "late", "worker", transport_factory=network.open)
    seed = Membership(config, "seed", "edge", transport_factory=network.open)
    try:
        assert await late.start([("127.0.0.1", 10_002)]) == 1  # nothing there yet
        await seed.start()
        assert seed.address == ("127.0.0.1", 10_002)
        await wait_for(lambda: seed.member("late") is not None, 3.0, "the retried join to land")
    finally:
        await late.close()
        await seed.close()


def test_membership_refuses_to_run_without_a_secret():
    with pytest.raises(ValueError, match="secret"):
        Membership(MembershipSettings.lan(), "x", "edge")


async def test_seed_names_resolve_to_addresses():
    from shared.membership.shell import resolve_addresses

    assert await resolve_addresses([("localhost", 7946), ("10.1.2.3", 1), ("no-such-host.invalid", 2)], 2.0) == [
        ("127.0.0.1", 7946), ("10.1.2.3", 1),
    ]
