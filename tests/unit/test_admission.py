"""Admission by tier as a pure function of (tier, fleet load, reserves), and the fleet's load
as gossip reports it: free is refused first, then pro, while enterprise keeps its reserve."""

from __future__ import annotations

import pytest

from services.edge.admission import WorkerLoad, admit, fleet_load, tier_limits
from services.edge.fleet_view import FleetView, worker_load
from services.edge.tenants import DEFAULT_TIERS, Tier

LIMITS = tier_limits(DEFAULT_TIERS, full_load=1.0)


def test_each_tier_may_fill_the_fleet_up_to_the_reserves_of_the_tiers_above_it():
    assert LIMITS == pytest.approx({"enterprise": 1.0, "pro": 0.8, "free": 0.7})
    assert tier_limits(DEFAULT_TIERS, full_load=2.0) == pytest.approx({"enterprise": 2.0, "pro": 1.6, "free": 1.4})


def test_tiers_of_equal_weight_keep_no_reserve_against_each_other():
    tiers = {"gold": Tier(4.0, 0.3), "gold-eu": Tier(4.0, 0.3), "basic": Tier(1.0, 0.0)}
    assert tier_limits(tiers, 1.0) == pytest.approx({"gold": 1.0, "gold-eu": 1.0, "basic": 0.4})


def test_reserves_over_the_whole_fleet_leave_the_lowest_tier_nothing():
    tiers = {"a": Tier(3.0, 0.6), "b": Tier(2.0, 0.5), "c": Tier(1.0, 0.0)}
    assert tier_limits(tiers, 1.0)["c"] == 0.0


@pytest.mark.parametrize(
    "load, admitted",
    [
        (None, {"free", "pro", "enterprise"}),  # no worker known yet: nothing to judge by
        (0.0, {"free", "pro", "enterprise"}),
        (0.69, {"free", "pro", "enterprise"}),
        (0.70, {"pro", "enterprise"}),  # free is refused first
        (0.79, {"pro", "enterprise"}),
        (0.80, {"enterprise"}),  # then pro
        (0.99, {"enterprise"}),  # enterprise keeps its reserve
        (1.00, set()),  # a full fleet takes nobody
        (3.00, set()),
    ],
)
def test_who_is_admitted_at_each_load(load, admitted):
    for tier in DEFAULT_TIERS:
        refusal = admit(tier, load, LIMITS, retry_after_ms=750)
        assert (refusal is None) == (tier in admitted), (tier, load)
        if refusal is not None:
            assert refusal.retry_after_ms == 750 and refusal.limit == pytest.approx(LIMITS[tier])
            assert tier in refusal.message


def test_a_tier_the_limits_do_not_know_is_held_to_the_lowest():
    assert admit("standard", 0.69, LIMITS, 1000) is None
    assert admit("standard", 0.70, LIMITS, 1000) is not None


@pytest.mark.parametrize(
    "workers, load",
    [
        ([], None),
        ([WorkerLoad()], 0.0),  # a worker that says nothing of its capacity
        ([WorkerLoad(running=4, waiting=0, max_running=4)], 1.0),
        ([WorkerLoad(running=4, waiting=2, max_running=4)], 1.5),  # a queue counts over full
        ([WorkerLoad(running=4, max_running=4), WorkerLoad(running=0, max_running=4)], 0.5),  # seats over the fleet
        ([WorkerLoad(running=2, max_running=4), WorkerLoad(running=9)], 0.5),  # an unbounded one adds no seats
        ([WorkerLoad(running=1, max_running=8, kv_usage=0.9)], 0.9),  # the KV pool can be what fills first
        ([WorkerLoad(kv_usage=0.5, waiting_tokens=2048, kv_tokens=8192)], 0.75),  # waiting prompts will need KV
        ([WorkerLoad(kv_usage=1.0), WorkerLoad(kv_usage=0.0)], 0.5),
    ],
)
def test_fleet_load(workers, load):
    assert fleet_load(workers) == (None if load is None else pytest.approx(load))


def test_gossiped_load_is_read_as_input_never_trusted():
    good = {"running": 3, "waiting": 1, "max_running": 4, "kv_usage": 0.5, "waiting_tokens": 10, "kv_tokens": 100}
    assert worker_load(good) == WorkerLoad(3, 1, 4, 0.5, 10, 100)
    assert worker_load({}) == WorkerLoad()  # an older worker, before capacity was gossiped
    bad = {"running": -1, "waiting": "7", "max_running": True, "kv_usage": float("nan"), "kv_tokens": float("inf")}
    assert worker_load(bad) == WorkerLoad()


def test_chats_admitted_since_the_last_report_count_until_the_workers_report_them():
    class Gossip:  # one worker with 10 seats, 5 taken, as its last report said
        def alive(self, role: str) -> list:
            return [type("Member", (), {"load": {"running": 5, "max_running": 10}})()]

    now = [0.0]
    view = FleetView(clock=lambda: now[0], report_lag_s=2.0)
    assert view.load() is None  # not joined yet
    view.watch(Gossip())
    assert view.load() == pytest.approx(0.5)
    for i in range(4):
        view.admitted(f"r{i}", 100)
    view.ended("r3")  # over before any report: it loads nobody
    assert view.load() == pytest.approx(0.8)  # a burst between two reports is not all let in
    assert admit("free", view.load(), LIMITS, 1000) is not None
    now[0] = 2.5  # reported by now: in the worker's figures
    assert view.load() == pytest.approx(0.5)
    assert fleet_load([WorkerLoad(running=5, max_running=10)], admitted_since=5) == pytest.approx(1.0)
    kv = WorkerLoad(running=1, max_running=100, kv_usage=0.5, kv_tokens=1000)
    assert fleet_load([kv], admitted_since=1, admitted_tokens=300) == pytest.approx(0.8)  # their prompts will need KV
