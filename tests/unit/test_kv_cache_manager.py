"""KVCacheManager: prefix hits, all-or-nothing allocation, caching only computed full blocks, freeing."""

import pytest

from services.worker.engine.block_pool import BlockPool, hash_full_blocks
from services.worker.engine.block_tables import BlockTables
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16


def make_manager(num_blocks: int = 11, enable_caching: bool = True, max_model_len: int = 8192):
    pool = BlockPool(num_blocks, BLOCK_SIZE, enable_caching=enable_caching)
    return KVCacheManager(pool, max_model_len=max_model_len)


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=16))


def admit_and_compute(manager: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler and one step do: look up, allocate, then mark the prompt computed."""
    hits, num_hit = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new_ids is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    return new_ids


def test_first_request_misses_and_caches_only_full_blocks():
    manager = make_manager()
    request = make_request("a", list(range(55)))  # 3 full blocks + 7 tokens
    assert manager.get_computed_blocks(request) == ([], 0)
    assert manager.allocate_slots(request, 55) == [1, 2, 3, 4]
    # Nothing is cached before its KV is computed.
    assert manager.block_pool.num_cached_blocks == 0
    request.num_computed_tokens = 55
    manager.cache_blocks(request)
    blocks = manager.req_to_blocks["a"]
    assert [b.block_hash is not None for b in blocks] == [True, True, True, False]
    assert manager.block_pool.num_cached_blocks == 3


def test_second_request_with_same_prefix_shares_blocks():
    manager = make_manager()
    shared = list(range(48))
    first = make_request("a", shared + [900] * 7)
    admit_and_compute(manager, first)
    second = make_request("b", shared + [901] * 12)

    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 48
    assert [b.block_id for b in hits] == [1, 2, 3]
    assert manager.allocate_slots(second, second.num_tokens - num_hit, hits) == [5]
    assert manager.get_block_ids(second) == [1, 2, 3, 5]
    assert [b.ref_cnt for b in hits] == [2, 2, 2]
    assert manager.num_prefix_queries_tokens == 55 + 60
    assert manager.num_prefix_hit_tokens == 48
    assert manager.prefix_hit_rate == pytest.approx(48 / 115)


def test_hit_never_covers_the_last_prompt_token():
    manager = make_manager()
    prompt = list(range(48))
    admit_and_compute(manager, make_request("a", prompt))
    same = make_request("b", prompt)
    hits, num_hit = manager.get_computed_blocks(same)
    # All three blocks are cached, but the last token must run to give logits.
    assert num_hit == 32
    assert [b.block_id for b in hits] == [1, 2]


def test_hit_stops_at_first_differing_block():
    manager = make_manager()
    admit_and_compute(manager, make_request("a", list(range(64))))
    tokens = list(range(64))
    tokens[20] = 999  # second block differs, so the third cannot match either
    _, num_hit = manager.get_computed_blocks(make_request("b", tokens))
    assert num_hit == 16


def test_hits_on_free_cached_blocks_after_first_request_finished():
    manager = make_manager()
    first = make_request("a", list(range(40)))
    admit_and_compute(manager, first)
    manager.free(first)
    assert manager.block_pool.num_free_blocks == 10
    second = make_request("b", list(range(40)))
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 32
    assert manager.allocate_slots(second, 8, hits) == [3]  # block 3 was a's uncached tail
    assert [b.ref_cnt for b in hits] == [1, 1]
    assert manager.block_pool.num_free_blocks == 7


def test_forged_cache_entry_with_other_tokens_is_not_served():
    manager = make_manager()
    admit_and_compute(manager, make_request("a", list(range(32))))
    victim = make_request("b", [7] * 40)
    first_hash = hash_full_blocks(victim.all_token_ids, BLOCK_SIZE)[0]
    # Plant a cache entry under victim's hash value whose block holds other tokens.
    block = manager.block_pool.blocks[1]
    manager.block_pool.cached_blocks[first_hash.value] = block
    assert block.block_hash is not None and block.block_hash.token_ids != first_hash.token_ids
    assert manager.get_computed_blocks(victim) == ([], 0)


def test_allocate_slots_returns_none_and_changes_nothing_when_out_of_blocks():
    manager = make_manager()
    holder = make_request("hold", list(range(1000, 1000 + 16 * 8)))
    assert manager.allocate_slots(holder, holder.num_tokens) is not None
    request = make_request("a", list(range(40)))  # needs 3 blocks, 2 free
    free_before = list(manager.block_pool.free_queue)
    assert manager.allocate_slots(request, 40) is None
    assert list(manager.block_pool.free_queue) == free_before
    assert manager.get_block_ids(request) == []
    assert "a" not in manager.req_to_blocks
    assert manager.num_prefix_queries_tokens == 16 * 8


def test_free_cached_hits_count_against_the_new_blocks_they_would_share_room_with():
    manager = make_manager()
    first = make_request("a", list(range(49)))  # 3 cached blocks + 1 token
    admit_and_compute(manager, first)
    manager.free(first)
    holder = make_request("hold", list(range(1000, 1000 + 16 * 6)))
    assert manager.allocate_slots(holder, holder.num_tokens) == [4, 5, 6, 7, 8, 9]
    # Free now: 10 and the cached 3, 2, 1. b hits 1-3 and needs 2 more blocks: 5 > 4.
    second = make_request("b", list(range(48)) + list(range(500, 520)))
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 48
    free_before = list(manager.block_pool.free_queue)
    assert manager.allocate_slots(second, second.num_tokens - num_hit, hits) is None
    assert [b.ref_cnt for b in hits] == [0, 0, 0]
    assert list(manager.block_pool.free_queue) == free_before


def test_decode_allocates_a_block_only_at_block_boundaries():
    manager = make_manager()
    request = make_request("a", list(range(31)))
    assert manager.allocate_slots(request, 31) == [1, 2]
    request.num_computed_tokens = 31
    request.append_output_token(5)
    assert manager.allocate_slots(request, 1) == []  # position 31 fits block 2
    request.num_computed_tokens = 32
    request.append_output_token(6)
    assert manager.allocate_slots(request, 1) == [3]
    assert manager.get_block_ids(request) == [1, 2, 3]


def test_generated_tokens_are_cached_once_their_block_is_computed():
    manager = make_manager()
    request = make_request("a", list(range(30)))
    admit_and_compute(manager, request)
    for token in (100, 101):
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.cache_blocks(request)
    assert request.num_computed_tokens == 32
    assert manager.block_pool.num_cached_blocks == 2
    follow_up = make_request("b", list(range(30)) + [100, 101, 7])
    _, num_hit = manager.get_computed_blocks(follow_up)
    assert num_hit == 32


def test_free_releases_tail_first():
    manager = make_manager()
    request = make_request("a", list(range(40)))
    admit_and_compute(manager, request)
    manager.free(request)
    # Block 3 (partial, uncached) is reused first; of the cached, the tail goes first.
    assert list(manager.block_pool.free_queue) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert manager.get_block_ids(request) == []
    assert manager.usage == 0.0


def test_caching_disabled_never_hits():
    manager = make_manager(enable_caching=False)
    admit_and_compute(manager, make_request("a", list(range(64))))
    assert manager.get_computed_blocks(make_request("b", list(range(64)))) == ([], 0)
    assert manager.num_prefix_queries_tokens == 0


def test_allocating_past_max_model_len_is_an_error():
    manager = make_manager(max_model_len=32)
    with pytest.raises(ValueError):
        manager.allocate_slots(make_request("a", list(range(33))), 33)



def test_block_tables_keep_each_request_in_a_row_that_grows_with_it_and_is_nulled_when_freed():
    manager = make_manager(num_blocks=200, max_model_len=64)
    manager.block_tables = BlockTables(max_blocks_per_request=4, num_rows=2)  # so that 3 requests make it grow
    requests = [make_request(f"r{i}", list(range(100 * i, 100 * i + 20))) for i in range(3)]
    for request in requests:
        admit_and_compute(manager, request)
    assert len(manager.block_tables.array) == 4  # doubled for the third request
    tables = [manager.get_block_ids(request) for request in requests]
    assert [len(t) for t in tables] == [2, 2, 2] and len({b for t in tables for b in t}) == 6
    first = requests[0]
    assert manager.allocate_slots(first, 20) is not None  # 40 tokens: a third block, in the same row
    row = manager.block_row(first)
    assert manager.block_tables.array[row, :3].tolist() == manager.get_block_ids(first) and manager.block_tables.array[row, 3] == 0
    manager.free(first)
    assert not manager.block_tables.array[row].any() and manager.get_block_ids(first) == []
    again = make_request("again", list(range(500, 510)))
    admit_and_compute(manager, again)
    assert manager.block_row(again) == row  # a freed row is taken again before the array grows
