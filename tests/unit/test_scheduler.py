"""Scheduler: token budget, chunked prefill, caps, preemption and recomputation, abort, static batching."""

import random

import pytest

from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KVCacheManager
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import PLACEHOLDER, Scheduler, SchedulerConfig, SchedulerOutput
from services.worker.engine.tenant_order import FCFS
from services.worker.engine.types import Failure, FailureCode, RequestRejected

BLOCK_SIZE = 16


def make_scheduler(num_blocks: int = 11, enable_caching: bool = True, **config) -> Scheduler:
    scheduler_config = SchedulerConfig(**config)
    pool = BlockPool(num_blocks, BLOCK_SIZE, enable_caching=enable_caching)
    return Scheduler(scheduler_config, KVCacheManager(pool, scheduler_config.max_model_len))


def add(
    scheduler: Scheduler, request_id: str, num_prompt: int, max_tokens: int = 8, first: int = 0
) -> Request:
    """Queue a request whose prompt is first, first + 1, ...: distinct `first`s share no prefix."""
    prompt = list(range(first, first + num_prompt))
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens))
    scheduler.add_request(request)
    return request


def shape(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(id, start, number of tokens, sample) per chunk, in output order."""
    return [(c.request_id, c.start_position, c.num_tokens, c.sample) for c in output.chunks]


def step(scheduler: Scheduler, token: int = 1) -> SchedulerOutput:
    """One engine step where the model samples `token` for every request that samples."""
    output = scheduler.schedule()
    sampled = {c.request_id: token for c in output.chunks if c.sample}
    scheduler.update_from_output(output, sampled)
    return output


def test_decodes_first_then_a_prefill_chunk_within_the_budget():
    scheduler = make_scheduler(max_batch_tokens=20)
    a = add(scheduler, "a", 10)
    assert shape(step(scheduler, token=100)) == [("a", 0, 10, True)]
    add(scheduler, "b", 30)

    output = scheduler.schedule()
    assert shape(output) == [("a", 10, 1, True), ("b", 0, 19, False)]
    assert output.chunks[0].token_ids == [100]
    assert output.num_scheduled_tokens == 20
    scheduler.update_from_output(output, {"a": 101})
    assert a.output_token_ids == [100, 101]

    assert shape(step(scheduler)) == [("a", 11, 1, True), ("b", 19, 11, True)]


def test_running_decodes_go_before_an_older_request_still_in_prefill():
    scheduler = make_scheduler(max_batch_tokens=16, long_prefill_token_threshold=8)
    add(scheduler, "a", 40)
    add(scheduler, "b", 4)
    assert shape(step(scheduler)) == [("a", 0, 8, False), ("b", 0, 4, True)]
    assert shape(step(scheduler)) == [("b", 4, 1, True), ("a", 8, 8, False)]


def test_chunked_prefill_splits_a_long_prompt_with_right_positions_and_blocks():
    scheduler = make_scheduler(max_batch_tokens=16)
    request = add(scheduler, "a", 40)
    outputs, tables = [], []
    for _ in range(3):
        outputs.append(step(scheduler, token=7))
        tables.append(outputs[-1].block_ids(outputs[-1].chunks[0], BLOCK_SIZE))
    assert [shape(o) for o in outputs] == [
        [("a", 0, 16, False)],
        [("a", 16, 16, False)],
        [("a", 32, 8, True)],
    ]
    assert outputs[1].chunks[0].token_ids == list(range(16, 32))
    assert tables == [[1], [1, 2], [1, 2, 3]]
    assert request.output_token_ids == [7]
    assert request.num_computed_tokens == 40


def test_beside_decodes_a_chunk_after_its_prefix_takes_no_more_work_than_a_fresh_one():
    # Parity 32: 20 tokens after 32 cost 20 x (1 + (32 + 10) / 32) = 46.25 units, 21 cost 48.9, and the
    # budget left, 32 fresh tokens, 32 x (1 + 16 / 32) = 48.
    scheduler = make_scheduler(num_blocks=40, max_batch_tokens=33, attention_parity=32)
    add(scheduler, "a", 4, max_tokens=20)
    step(scheduler)
    add(scheduler, "b", 200, first=100)
    assert shape(step(scheduler)) == [("a", 4, 1, True), ("b", 0, 32, False)]
    add(scheduler, "c", 4, first=500)
    output = step(scheduler)
    assert shape(output) == [("a", 5, 1, True), ("b", 32, 20, False)]  # c waits: b took the budget
    assert output.num_scheduled_tokens == 21
    assert scheduler.num_waiting == 1
    later = [{rid: n for rid, _, n, _ in shape(step(scheduler))}["b"] for _ in range(4)]
    assert later == sorted(later, reverse=True) and later[-1] < later[0] < 20  # deeper, smaller


def test_alone_a_prompt_s_chunks_count_their_tokens_only():
    scheduler = make_scheduler(max_batch_tokens=16, attention_parity=8)
    add(scheduler, "a", 40)
    assert [shape(step(scheduler)) for _ in range(3)] == [
        [("a", 0, 16, False)], [("a", 16, 16, False)], [("a", 32, 8, True)],
    ]


def test_without_a_parity_chunks_beside_decodes_count_their_tokens():
    scheduler = make_scheduler(num_blocks=40, max_batch_tokens=33)
    add(scheduler, "a", 4, max_tokens=20)
    step(scheduler)
    add(scheduler, "b", 200, first=100)
    step(scheduler)
    assert shape(step(scheduler)) == [("a", 5, 1, True), ("b", 32, 32, False)]


def test_unchunked_prompt_that_does_not_fit_the_rest_of_the_budget_waits():
    scheduler = make_scheduler(max_batch_tokens=32, enable_chunked_prefill=False)
    add(scheduler, "a", 20)
    add(scheduler, "b", 20, first=100)
    assert shape(step(scheduler)) == [("a", 0, 20, True)]
    assert scheduler.num_waiting == 1
    assert shape(step(scheduler)) == [("a", 20, 1, True), ("b", 0, 20, True)]


def test_unchunked_prompt_larger_than_the_budget_runs_whole_as_the_only_new_prompt():
    scheduler = make_scheduler(max_batch_tokens=32, enable_chunked_prefill=False)
    add(scheduler, "a", 10)
    step(scheduler)
    add(scheduler, "big", 50, first=100)
    add(scheduler, "big2", 40, first=200)
    output = step(scheduler)
    assert shape(output) == [("a", 10, 1, True), ("big", 0, 50, True)]
    assert output.num_scheduled_tokens == 51
    assert shape(step(scheduler)) == [("a", 11, 1, True), ("big", 50, 1, True), ("big2", 0, 40, True)]


def test_max_num_seqs_caps_the_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in ("a", "b", "c"):
        add(scheduler, request_id, 5)
    assert [c.request_id for c in step(scheduler).chunks] == ["a", "b"]
    assert [c.request_id for c in step(scheduler).chunks] == ["a", "b"]
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert [c.request_id for c in step(scheduler).chunks] == ["b", "c"]


def test_out_of_blocks_preempts_the_newest_request_itself_when_it_is_newest():
    scheduler = make_scheduler(num_blocks=11, enable_caching=False, max_batch_tokens=256)
    a = add(scheduler, "a", 64)  # 4 blocks
    b = add(scheduler, "b", 80, first=500)  # 5 blocks; one block stays free
    step(scheduler, token=1000)
    # Both cross a block boundary now: a is older and takes the last free block.
    output = step(scheduler, token=2000)
    assert shape(output) == [("a", 64, 1, True)]
    assert output.preempted_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1
    assert a.output_token_ids == [1000, 2000]

    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    output = scheduler.schedule()
    # Readmitted: recomputes its prompt and the token it had already generated.
    assert shape(output) == [("b", 0, 81, True)]
    assert output.chunks[0].token_ids == list(range(500, 580)) + [1000]
    assert b.status is RequestStatus.RUNNING
    assert b.num_preemptions == 1 and scheduler.num_preemptions == 1


def test_preempted_request_reuses_its_own_cached_blocks_on_readmission():
    scheduler = make_scheduler(num_blocks=11, max_batch_tokens=256)
    add(scheduler, "a", 64)
    b = add(scheduler, "b", 80, first=500)
    step(scheduler, token=1000)
    assert step(scheduler).preempted_ids == ["b"]
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    output = scheduler.schedule()
    assert shape(output) == [("b", 80, 1, True)]
    assert output.chunks[0].token_ids == [1000]
    assert b.num_cached_tokens == 0  # usage reports only first-admission hits


def test_an_older_request_preempts_the_newest_running_one():
    scheduler = make_scheduler(num_blocks=11, enable_caching=False, max_batch_tokens=256)
    a = add(scheduler, "a", 80)  # 5 full blocks
    add(scheduler, "b", 70)  # 5 blocks, the last one partial: the pool is full
    step(scheduler)
    output = scheduler.schedule()
    assert shape(output) == [("a", 80, 1, True)]
    assert output.preempted_ids == ["b"]
    # b's blocks hold no cached KV, so they return to the head, in table order.
    assert output.block_ids(output.chunks[0], BLOCK_SIZE) == [1, 2, 3, 4, 5, 6]
    assert a.status is RequestStatus.RUNNING


def test_preempting_a_request_already_scheduled_this_step_takes_back_its_chunk():
    scheduler = make_scheduler(num_blocks=5, max_batch_tokens=64, long_prefill_token_threshold=16)
    add(scheduler, "a", 64, max_tokens=1)
    add(scheduler, "b", 16, max_tokens=4, first=500)
    assert shape(step(scheduler)) == [("a", 0, 16, False), ("b", 0, 16, True)]
    assert shape(step(scheduler)) == [("b", 16, 1, True), ("a", 16, 16, False)]
    # b's decode is scheduled first, then a's chunk needs a block and b is newest.
    # b's full block 2 stays cached; its uncached partial block 3 is reused first.
    output = scheduler.schedule()
    assert shape(output) == [("a", 32, 16, False)]
    assert output.preempted_ids == ["b"]
    assert output.num_scheduled_tokens == 16
    assert output.block_ids(output.chunks[0], BLOCK_SIZE) == [1, 4, 3]


def test_no_new_admissions_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=11, enable_caching=False, max_batch_tokens=256)
    add(scheduler, "a", 64)
    add(scheduler, "b", 80)
    step(scheduler)
    add(scheduler, "c", 4)
    output = scheduler.schedule()
    assert output.preempted_ids == ["b"]
    assert [c.request_id for c in output.chunks] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_abort_frees_blocks_at_once_and_stale_output_is_ignored():
    scheduler = make_scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    a = add(scheduler, "a", 40)
    output = scheduler.schedule()
    assert pool.num_free_blocks == 7
    assert scheduler.abort_request("a")
    assert pool.num_free_blocks == 10
    assert a.status is RequestStatus.FINISHED_ABORTED
    scheduler.update_from_output(output, {"a": 5})
    assert a.output_token_ids == []
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_ids == ["a"]
    assert not scheduler.abort_request("a")


def test_abort_of_a_waiting_request_removes_it_from_the_queue():
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "a", 4)
    add(scheduler, "b", 4)
    step(scheduler)
    assert scheduler.abort_request("b")
    assert scheduler.num_waiting == 0
    scheduler.finish_request("a", RequestStatus.FINISHED_LENGTH)
    assert scheduler.schedule().is_empty


def test_prefix_hit_on_admission_skips_cached_tokens_and_reports_them():
    scheduler = make_scheduler(max_batch_tokens=256)
    add(scheduler, "a", 40)
    step(scheduler)
    b = add(scheduler, "b", 40)
    output = scheduler.schedule()
    assert shape(output) == [("a", 40, 1, True), ("b", 32, 8, True)]
    assert output.block_ids(output.chunks[1], BLOCK_SIZE)[:2] == [1, 2]
    assert b.num_cached_tokens == 32


def test_check_request_reasons():
    scheduler = make_scheduler(num_blocks=11, max_model_len=200)
    too_long = scheduler.check_request(Request("x", list(range(201)), SamplingParams()))
    assert too_long.code is FailureCode.PROMPT_TOO_LONG
    assert "201" in too_long.message and "200" in too_long.message
    # 150 prompt tokens + up to 40 generated: 189 tokens of KV, 12 blocks > 10.
    too_big = Request("y", list(range(150)), SamplingParams(max_tokens=40))
    too_big_failure = scheduler.check_request(too_big)
    assert too_big_failure.code is FailureCode.PROMPT_TOO_LONG and "10 blocks" in too_big_failure.message
    assert scheduler.check_request(Request("z", [], SamplingParams())) == Failure(FailureCode.INVALID_REQUEST, "the prompt is empty")
    fits = Request("ok", list(range(150)), SamplingParams(max_tokens=10))
    assert scheduler.check_request(fits) is None
    with pytest.raises(RequestRejected) as rejected:
        scheduler.add_request(too_big)
    assert rejected.value.failure.code is FailureCode.PROMPT_TOO_LONG
    assert not scheduler.has_unfinished_requests()


def test_max_num_tokens_is_capped_by_max_model_len():
    scheduler = make_scheduler(max_model_len=100)
    request = add(scheduler, "a", 90, max_tokens=50)
    assert request.max_num_tokens == 100
    assert not request.reached_max_num_tokens


def test_finish_request_takes_finished_statuses_only():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 4)
    with pytest.raises(ValueError):
        scheduler.finish_request("a", RequestStatus.RUNNING)
    assert scheduler.finish_request("a", RequestStatus.FINISHED_LENGTH)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.status.finish_reason == "length"


def test_static_batching_holds_new_requests_until_the_batch_has_finished():
    scheduler = make_scheduler(static_batching=True)
    add(scheduler, "a", 4)
    add(scheduler, "b", 4)
    assert [c.request_id for c in step(scheduler).chunks] == ["a", "b"]
    add(scheduler, "c", 4)
    assert [c.request_id for c in step(scheduler).chunks] == ["a", "b"]
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert [c.request_id for c in step(scheduler).chunks] == ["b"]
    scheduler.finish_request("b", RequestStatus.FINISHED_STOPPED)
    assert [c.request_id for c in step(scheduler).chunks] == ["c"]


def test_static_batch_keeps_filling_while_only_the_budget_held_it_back():
    scheduler = make_scheduler(static_batching=True, max_batch_tokens=16)
    add(scheduler, "a", 16)
    add(scheduler, "b", 16)
    assert shape(step(scheduler)) == [("a", 0, 16, True)]
    assert shape(step(scheduler)) == [("a", 16, 1, True), ("b", 0, 15, False)]
    add(scheduler, "c", 4)
    assert shape(step(scheduler)) == [("a", 17, 1, True), ("b", 15, 1, True)]
    assert shape(step(scheduler)) == [("a", 18, 1, True), ("b", 16, 1, True)]


def test_continuous_batching_admits_new_requests_at_once():
    scheduler = make_scheduler()
    add(scheduler, "a", 4)
    step(scheduler)
    add(scheduler, "c", 4)
    assert [c.request_id for c in step(scheduler).chunks] == ["a", "c"]


def test_fcfs_puts_preempted_requests_in_front_in_their_order():
    order = FCFS()
    requests = [Request(name, [1], SamplingParams()) for name in ("a", "b", "c", "d")]
    order.add(requests[0])
    order.add(requests[1])
    order.push_front(requests[3])
    order.push_front(requests[2])
    assert [r.request_id for r in order] == ["c", "d", "a", "b"]
    assert order.remove("d") is requests[3]
    assert order.pop_next() is requests[2]
    assert order.peek() is requests[0]
    with pytest.raises(ValueError):
        order.add(requests[0])


class FakeRunner:
    """Stands in for the model: writes each token into its KV slot and checks every slot read. A
    decode of a pending token (PLACEHOLDER) takes the token the step before drew for it."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], int] = {}

    def run(self, scheduler: Scheduler, output: SchedulerOutput, drawn_before: dict[str, int]) -> dict[str, int]:
        sampled = {}
        for chunk in output.chunks:
            request = scheduler.get_request(chunk.request_id)
            end = chunk.start_position + chunk.num_tokens
            assert end == request.num_computed_tokens  # a step counts as computed once scheduled
            block_ids = output.block_ids(chunk, BLOCK_SIZE)
            for position in range(chunk.start_position):
                slot = (block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE)
                assert self.kv[slot] == request.all_token_ids[position], (chunk.request_id, position)
            token_ids = [drawn_before[chunk.request_id]] if chunk.token_ids == [PLACEHOLDER] else chunk.token_ids
            for offset, token in enumerate(token_ids):
                position = chunk.start_position + offset
                self.kv[(block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE)] = token
            if chunk.sample:
                sampled[chunk.request_id] = (end * 7) % 5  # few values: shared prefixes
        return sampled


def check_pool_invariants(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    refs: dict[int, int] = {}
    for request_id, blocks in manager.req_to_blocks.items():
        row = manager.req_to_row[request_id]
        table = manager.block_tables.array[row]
        assert table[: len(blocks)].tolist() == [block.block_id for block in blocks] and not table[len(blocks) :].any()
        for block in blocks:
            refs[block.block_id] = refs.get(block.block_id, 0) + 1
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs.get(block.block_id, 0)
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
    assert set(manager.req_to_blocks) == {r.request_id for r in scheduler.running}


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
@pytest.mark.parametrize(
    "chunked,static,parity", [(True, False, 0), (False, False, 0), (True, True, 0), (True, False, 12)],
    ids=["chunked", "whole", "static", "chunks-by-work"],
)
def test_random_workload_never_reads_wrong_kv_and_finishes_everything(chunked, static, parity, overlap):
    """Overlapped: each step is scheduled before the one before it is back (its decodes carry
    PLACEHOLDER), as the engine does while a GPU runs that step."""
    rng = random.Random(1234)
    scheduler = make_scheduler(
        num_blocks=24,
        max_batch_tokens=48,
        max_num_seqs=6,
        enable_chunked_prefill=chunked,
        static_batching=static,
        attention_parity=parity,
    )
    runner = FakeRunner()
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(10, 60))] for _ in range(3)]
    submitted = 0
    in_flight: tuple[SchedulerOutput, dict[str, int]] | None = None
    placeholders = 0

    def finish(output: SchedulerOutput, sampled: dict[str, int]) -> None:
        for request, _ in scheduler.update_from_output(output, sampled):
            if request.num_output_tokens >= request.sampling.max_tokens:
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
            elif rng.random() < 0.01:
                scheduler.abort_request(request.request_id)

    for _ in range(5000):
        if submitted < 60 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
            request = Request(f"r{submitted}", prompt, SamplingParams(max_tokens=rng.randrange(1, 60)))
            scheduler.add_request(request)
            submitted += 1
        output = scheduler.schedule()
        if chunked:
            assert output.num_scheduled_tokens <= 48
        placeholders += sum(chunk.token_ids == [PLACEHOLDER] for chunk in output.chunks)
        sampled = runner.run(scheduler, output, in_flight[1] if in_flight else {})
        if overlap:
            if in_flight is not None:
                finish(*in_flight)
            in_flight = (output, sampled)
        else:
            finish(output, sampled)
        check_pool_invariants(scheduler)
        if submitted == 60 and not scheduler.has_unfinished_requests():
            break
    assert submitted == 60
    assert not scheduler.has_unfinished_requests()
    assert (placeholders > 0) == overlap
    assert scheduler.kv_cache_manager.num_prefix_hit_tokens > 0
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 23
