"""Weighted virtual token counters: backlogged tenants stay within the service-difference bound,
idle time cannot be banked, weights give proportional service, and in the real scheduler a
tenant that arrives behind a hot one is served next, not last."""

from __future__ import annotations

import random

import pytest

from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import Scheduler, SchedulerConfig
from services.worker.engine.tenant_order import FCFS
from services.worker.engine.vtc import VirtualTokenCounters, VTCCosts

COSTS = VTCCosts(w_in=1.0, w_out=2.0, w_cached=0.1)


def request(tenant: str, n: int, prompt: int = 32) -> Request:
    return Request(f"{tenant}-{n}", list(range(prompt)), SamplingParams(max_tokens=8), tenant)


def serve(order: VirtualTokenCounters, rng: random.Random, outputs: tuple[int, int] = (1, 16)) -> Request:
    """Admit the next request and generate its whole output, as the scheduler would report it."""
    chosen = order.pop_next()
    order.on_admitted(chosen, 0)
    for _ in range(rng.randint(*outputs)):
        chosen.num_computed_tokens = chosen.num_tokens - 1  # a decode step: one token sampled
        order.on_scheduled({chosen: 1})
        chosen.append_output_token(0)
    return chosen


def test_two_backlogged_tenants_stay_within_the_service_difference_bound():
    rng = random.Random(1)
    order = VirtualTokenCounters(COSTS)
    for i in range(200):
        order.add(request("a", i, prompt=rng.randint(8, 64)))
        order.add(request("b", i, prompt=rng.randint(8, 64)))
    # One request's whole charge at most: the longest prompt and output of the trace.
    bound = 64 * COSTS.w_in + 16 * COSTS.w_out
    for _ in range(200):
        serve(order, rng)
        assert abs(order.counters["a"] - order.counters["b"]) <= bound


def test_a_tenant_back_from_idle_cannot_bank_its_idle_time():
    rng = random.Random(2)
    order = VirtualTokenCounters(COSTS)
    for i in range(100):
        order.add(request("hot", i))
    for _ in range(50):
        serve(order, rng)  # hot alone: its counter runs far ahead of the idle tenant's 0
    for i in range(20):
        order.add(request("cold", i))
    served = [serve(order, rng).tenant for _ in range(20)]
    # Lifted to hot's counter on arrival: they take turns, cold does not get 20 in a row.
    assert order.counters["cold"] > 0 and 6 <= served.count("cold") <= 14, served


def test_weights_give_proportional_service():
    rng = random.Random(3)
    order = VirtualTokenCounters(VTCCosts(weights={"gold": 2.0}))
    for i in range(300):
        order.add(request("gold", i))
        order.add(request("base", i))
    served = [serve(order, rng, outputs=(8, 8)).tenant for _ in range(300)]
    assert served.count("gold") / served.count("base") == pytest.approx(2.0, rel=0.1)


def test_cached_prompt_tokens_are_charged_at_their_own_weight():
    order = VirtualTokenCounters(COSTS)
    order.add(request("a", 0, prompt=100))
    chosen = order.pop_next()
    order.on_admitted(chosen, 96)
    assert order.counters["a"] == pytest.approx(4 * COSTS.w_in + 96 * COSTS.w_cached)


def test_queue_semantics_match_fcfs_within_a_tenant_and_preempted_go_first_in_theirs():
    order = VirtualTokenCounters(COSTS)
    a0, a1, b0, p = request("a", 0), request("a", 1), request("b", 0), request("a", 9)
    for r in (a0, a1, b0):
        order.add(r)
    order.push_front(p)  # preempted: ahead of its tenant's own, not of b's
    assert len(order) == 4 and "a-1" in order and order.peek() is p
    assert order.pop_next() is p and order.pop_next() is a0  # a's head arrived before b's
    order.on_admitted(a0, 0)
    assert order.peek() is b0  # a was charged
    assert order.remove("a-1") is a1 and order.remove("a-1") is None
    with pytest.raises(ValueError):
        order.add(b0)


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_in_the_scheduler_a_tenant_behind_a_hot_one_is_served_next_under_vtc(policy):
    config = SchedulerConfig(max_num_seqs=1, max_batch_tokens=512)
    pool = BlockPool(64, 16, enable_caching=True)
    waiting = VirtualTokenCounters(COSTS) if policy == "vtc" else FCFS()
    scheduler = Scheduler(config, KVCacheManager(pool, config.max_model_len), waiting)
    for i in range(10):
        scheduler.add_request(Request(f"hot-{i}", list(range(i * 100, i * 100 + 20)), SamplingParams(max_tokens=2), "hot"))
    scheduler.add_request(Request("cold-0", list(range(5000, 5020)), SamplingParams(max_tokens=2), "cold"))
    admitted: list[str] = []
    while scheduler.requests:
        output = scheduler.schedule()
        admitted += [c.request_id for c in output.chunks if c.start_position == 0]
        scheduler.update_from_output(output, {c.request_id: 1 for c in output.chunks if c.sample})
        for request in list(scheduler.requests.values()):
            if request.reached_max_num_tokens:
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    assert admitted.index("cold-0") == (1 if policy == "vtc" else 10)


def test_the_engine_settings_choose_the_order_and_the_weights():
    from services.worker.engine.engine import waiting_order
    from services.worker.engine.settings import EngineSettings

    assert isinstance(waiting_order(EngineSettings(fair_share="fcfs")), FCFS)
    vtc = waiting_order(EngineSettings(tenant_weights="gold:2,base:0.5", vtc_output_weight=3.0))
    assert isinstance(vtc, VirtualTokenCounters)
    assert vtc.costs.weight("gold") == 2.0 and vtc.costs.weight("other") == 1.0 and vtc.costs.w_out == 3.0


def test_the_weight_a_request_carries_gives_its_tenant_that_share():
    """The edge puts the tenant's tier weight on each request; the engine's own setting, when it names the tenant, wins."""
    rng = random.Random(5)
    order = VirtualTokenCounters(VTCCosts(weights={"pinned": 1.0}))
    for i in range(300):
        for tenant, weight in (("enterprise", 4.0), ("free", 1.0), ("pinned", 4.0)):
            r = request(tenant, i)
            r.weight = weight
            order.add(r)
    served = [serve(order, rng, outputs=(8, 8)).tenant for _ in range(300)]
    assert served.count("enterprise") / served.count("free") == pytest.approx(4.0, rel=0.15)
    assert served.count("pinned") == pytest.approx(served.count("free"), rel=0.15)


def test_priority_orders_a_tenants_own_queue_and_not_the_others():
    order = VirtualTokenCounters(COSTS)
    for n, priority in enumerate([0, 0, -5, 3, -5]):
        r = request("a", n)
        r.priority = priority
        order.add(r)
    order.add(request("b", 0))
    a_order = [r.request_id for r in order if r.tenant == "a"]
    assert a_order == ["a-2", "a-4", "a-0", "a-1", "a-3"]  # by priority, then arrival
    # Priority does not let a tenant jump another: b (counter level with a) is next after a's first.
    admitted = [serve(order, random.Random(0), outputs=(1, 1)).request_id for _ in range(3)]
    assert admitted[0] == "a-2" and "b-0" in admitted[1:]
