"""The asyncio Membership shell: three members over real UDP on loopback, and the shell on the in-memory network."""

import asyncio
import json
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
