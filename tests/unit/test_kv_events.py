"""KV-cache events end to end without a broker: the block pool's notes, the worker's records, the
edge's index and reader, and that edge and engine hash a prompt's blocks alike."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.edge.kv_events import consume_kv_events
from services.edge.kv_index import KVIndex
from services.edge.placement import Policy
from services.edge.placer import Placer
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.kv_events import (
    MAX_KEYS_PER_RECORD,
    KVEventBatch,
    KVEventCollector,
    kv_records,
)
from shared import wire
from shared.membership import MemberView, Status
from shared.models.block_hash import block_key, hash_full_blocks
from shared.partition_owners import REQUESTS_ADDRESS
from shared.seal import Seal

BLOCK_SIZE = 4
SECRET = b"fleet-secret"
TOPIC = "p.kv-events"


def computed(manager: KVCacheManager, request: Request) -> None:
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)


def test_the_block_pool_tells_its_listener_what_it_stores_evicts_and_clears():
    pool = BlockPool(4, BLOCK_SIZE)  # 3 usable blocks
    collector = KVEventCollector()
    pool.listener = collector
    manager = KVCacheManager(pool, max_model_len=64)
    first = Request("a", list(range(9)), SamplingParams(max_tokens=1))  # 2 full blocks, 3 allocated
    computed(manager, first)
    stored = [block_key(h.value) for h in hash_full_blocks(list(range(9)), BLOCK_SIZE)]
    assert collector.drain() == KVEventBatch(stored=stored)
    assert collector.drain() is None
    manager.free(first)
    computed(manager, Request("b", list(range(100, 109)), SamplingParams(max_tokens=1)))  # evicts both
    batch = collector.drain()
    assert sorted(batch.evicted) == sorted(stored) and len(batch.stored) == 2
    pool.reset_prefix_cache()
    assert collector.drain() == KVEventBatch(cleared=True)


def test_within_one_interval_only_a_blocks_last_state_is_sent():
    collector = KVEventCollector(max_pending=3)
    collector.block_stored(b"\x00" * 7 + b"\x01")
    collector.block_evicted(b"\x00" * 7 + b"\x01")
    collector.block_evicted(b"\x00" * 7 + b"\x02")
    collector.block_stored(b"\x00" * 7 + b"\x02")
    assert collector.drain() == KVEventBatch(stored=[1], evicted=[0])  # keys: the first 63 bits
    for i in range(5):
        collector.block_stored(bytes([i]) * 8)
    assert len(collector.drain().stored) == 3 and collector.num_dropped == 2


def test_a_large_batch_goes_out_in_records_of_bounded_size_cleared_first():
    batch = KVEventBatch(stored=list(range(MAX_KEYS_PER_RECORD + 5)), evicted=[7, 8], cleared=True)
    records = kv_records("w", BLOCK_SIZE, batch)
    assert [len(r.stored) + len(r.evicted) for r in records] == [MAX_KEYS_PER_RECORD, 7]
    assert [r.cleared for r in records] == [True, False]
    assert sorted(k for r in records for k in r.stored) == batch.stored
    assert kv_records("w", BLOCK_SIZE, KVEventBatch()) == []


def test_the_index_follows_a_workers_events_in_bounded_memory():
    index = KVIndex(max_blocks_per_worker=3)
    index.apply(wire.KvEvents("w0", BLOCK_SIZE, stored=[1, 2, 3]))
    assert index.matched_blocks("w0", [1, 2, 3, 4]) == 3
    assert index.matched_blocks("w0", [2, 3]) == 2 and index.matched_blocks("w0", [9, 1]) == 0
    index.apply(wire.KvEvents("w0", BLOCK_SIZE, stored=[4], evicted=[2]))
    assert index.matched_blocks("w0", [1, 2, 3]) == 1
    index.apply(wire.KvEvents("w0", BLOCK_SIZE, stored=[5, 6]))  # 1, 3, 4, 5, 6: the oldest go
    assert index.num_blocks("w0") == 3 and index.matched_blocks("w0", [4, 5, 6]) == 3
    index.apply(wire.KvEvents("w0", BLOCK_SIZE, stored=[7], cleared=True))
    assert index.num_blocks("w0") == 1
    index.apply(wire.KvEvents("w0", 8, stored=[9]))  # a new block size: what it held before is void
    assert index.block_sizes() == {8} and index.num_blocks("w0") == 1
    index.forget("w0")
    assert index.num_blocks("w0") == 0 and index.matched_blocks("w0", [9]) == 0


def test_edge_and_engine_hash_a_prompt_alike_under_its_tenants_salt():
    settings = EngineSettings(cache_groups="acme:shared, beta:shared")
    tokens = list(range(30))  # 7 full blocks of 4
    pool = BlockPool(16, BLOCK_SIZE)
    collector = KVEventCollector()
    pool.listener = collector
    manager = KVCacheManager(pool, max_model_len=64)
    computed(manager, Request("r", tokens, SamplingParams(max_tokens=1), "acme", settings.cache_salt("acme")))
    stored = collector.drain().stored
    index = KVIndex()
    index.apply(wire.KvEvents("w0", BLOCK_SIZE, stored=stored))
    placer = Placer(Policy.PREFIX_AFFINITY, 1.25, settings, lambda messages: tokens, index)
    assert placer._prompt_keys("beta", []) == {BLOCK_SIZE: stored}  # same group, same salt
    assert index.matched_blocks("w0", placer._prompt_keys("gamma", [])[BLOCK_SIZE]) == 0  # another salt
    view = MemberView("w0", "worker", ("h", 1), {REQUESTS_ADDRESS: "0"}, {}, Status.ALIVE, 1, 1)
    other = MemberView("w1", "worker", ("h", 2), {REQUESTS_ADDRESS: "1"}, {}, Status.ALIVE, 1, 1)
    placer.members = lambda: [other, view]
    assert all(placer.place(f"q{i}", "acme", [], None, now=0.0) == ("w0", 0) for i in range(5))


class Records:
    """A consumer standing in for aiokafka's: one poll of these records, then nothing."""

    def __init__(self, values: list[object]) -> None:
        self._values = values

    async def getmany(self, timeout_ms: int) -> dict:
        values, self._values = self._values, []
        if not values:
            await asyncio.sleep(timeout_ms / 1000)
        records = [SimpleNamespace(topic=TOPIC, partition=0, offset=i, value=v) for i, v in enumerate(values)]
        return {"tp": records} if records else {}


class Parked:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    async def park(self, record, reason: str) -> None:
        self.reasons.append(reason)


async def test_bad_kv_events_records_are_dead_lettered_and_the_good_ones_applied():
    good = Seal(SECRET, "w0").encode(TOPIC, wire.KvEvents("w0", BLOCK_SIZE, stored=[5]))
    forged = Seal(SECRET, "w1").encode(TOPIC, wire.KvEvents("w0", BLOCK_SIZE, stored=[6]))  # sealed by another
    wrong_kind = Seal(SECRET, "w0").encode(TOPIC, wire.Cancel(["x"]))
    other_key = Seal(b"another secret", "w0").encode(TOPIC, wire.KvEvents("w0", BLOCK_SIZE, stored=[7]))
    values = [None, b"", b"\xc1garbage", forged, wrong_kind, other_key, good]
    index, parked = KVIndex(), Parked()
    reading = asyncio.create_task(consume_kv_events(Records(values), Seal(SECRET, "edge-0"), index, parked))
    for _ in range(100):
        if index.num_blocks("w0"):
            break
        await asyncio.sleep(0.01)
    assert not reading.done()  # nothing on the topic stops the reader
    reading.cancel()
    assert index.matched_blocks("w0", [5]) == 1 and index.matched_blocks("w0", [6]) == 0
    assert len(parked.reasons) == 6
