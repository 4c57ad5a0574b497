"""A prompt chunk's cost in tokens of a fresh prompt's work: the model's parity, the largest chunk a
budget allows after a cached prefix, and what it charges."""

import pytest

from services.worker.engine.chunk_cost import attention_parity, fresh_tokens, largest_chunk, work
from shared.models.shapes import SHAPES
from shared.models.spec import SMOLLM2, resolve_model


def test_parity_is_the_layer_weights_over_twice_the_query_width():
    # SmolLM2: 576 wide, 9 query heads and 3 KV heads of 64, MLP 1,536: 3,538,944 weights a layer / 1,152.
    assert attention_parity(resolve_model(SMOLLM2).config) == 3072
    assert attention_parity(SHAPES["tiny"]) == 288
    assert attention_parity(SHAPES["llama-8b"]) == 26624


@pytest.mark.parametrize("budget", [1, 2, 17, 480, 512, 8192])
def test_a_fresh_chunk_takes_the_whole_budget_and_is_charged_its_tokens(budget):
    assert largest_chunk(10**6, 0, budget, 288) == (budget, budget)
    assert largest_chunk(5, 0, budget, 288) == (min(5, budget), min(5, budget))


@pytest.mark.parametrize("parity", [16, 288, 3072])
@pytest.mark.parametrize("start", [1, 100, 1_000, 20_000])
def test_after_a_prefix_the_chunk_is_the_most_that_fits_the_budget_s_work(parity, start):
    budget = 480
    tokens, charge = largest_chunk(10**6, start, budget, parity)
    allowed = work(budget, 0, parity)
    if tokens > 1:
        assert work(tokens, start, parity) <= allowed + 1e-6
    assert work(tokens + 1, start, parity) > allowed
    assert tokens < budget
    assert tokens <= charge <= budget


def test_a_chunk_cut_short_by_its_prompt_leaves_the_rest_of_the_budget():
    tokens, charge = largest_chunk(50, 1_000, 480, 288)
    assert tokens == 50
    assert charge == pytest.approx(fresh_tokens(work(50, 1_000, 288), 288), abs=1)
    assert 50 < charge < 480


def test_a_prefix_too_long_for_any_token_still_moves_one():
    assert largest_chunk(10, 10**7, 4, 16) == (1, 4)


def test_equal_budgets_give_chunks_of_equal_work_through_a_long_prompt():
    start, works = 0, []
    while start < 8_000:
        tokens, _ = largest_chunk(8_000 - start, start, 496, 3072)
        works.append(work(tokens, start, 3072))
        start += tokens
    assert max(works[:-1]) <= work(496, 0, 3072) + 1e-6
    assert min(works[:-1]) >= 0.99 * work(496, 0, 3072)
