"""Sampler: greedy, temperature, top-k, top-p and seeds; the inverse-CDF draw, its C++ kernel against
its reference; SamplingParams validation."""

import math

import pytest
import torch

from kernels import cpu_inverse_cdf
from services.worker.engine.sampler import (
    ARGMAX_CHUNK,
    Sampler,
    argmax_rows,
    inverse_cdf,
    inverse_cdf_ref,
    make_generator,
    nucleus,
)
from services.worker.engine.sampling_params import SamplingParams

V = 1000


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3.0


def test_greedy_is_argmax() -> None:
    logits = random_logits(8)
    tokens = Sampler()(logits, [SamplingParams(temperature=0.0)] * 8)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("width", [ARGMAX_CHUNK + 1, 3 * ARGMAX_CHUNK, 3 * ARGMAX_CHUNK + 77, 49152])
def test_argmax_rows_equals_argmax_ties_included(width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    spread = torch.randn(16, width, generator=generator)
    tied = torch.randint(0, 4, (16, width), generator=generator).float()  # many positions share the top
    for x in (spread, tied, -tied):
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_takes_nan_as_largest_and_an_all_minus_inf_row_at_0() -> None:
    width = 2 * ARGMAX_CHUNK + 5
    x = torch.zeros(5, width)
    x[0, 1500] = float("nan")
    x[0, 1700] = float("nan")
    x[1, width - 1] = 2.0  # in the short last chunk
    x[2] = float("-inf")
    x[3, ARGMAX_CHUNK] = float("inf")
    x[4, 7] = float("nan")
    x[4, 9] = float("inf")
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [1500, width - 1, 0, ARGMAX_CHUNK, 7]


def test_argmax_rows_of_no_rows() -> None:
    assert argmax_rows(torch.zeros(0, 3 * ARGMAX_CHUNK)).shape == (0,)


def test_greedy_over_a_wide_vocabulary_is_argmax() -> None:
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(1))
    tokens = Sampler()(logits, [SamplingParams(temperature=0.0)] * 64)
    assert torch.equal(tokens, logits.argmax(-1))


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    torch.manual_seed(0)
    tokens = Sampler()(logits, params)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = random_logits(16, seed=1)
    torch.manual_seed(1)
    by_k = Sampler()(logits, [SamplingParams(temperature=1.0, top_k=1)] * 16)
    by_p = Sampler()(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 16)
    assert torch.equal(by_k, logits.argmax(-1))
    assert torch.equal(by_p, logits.argmax(-1))


def test_top_k_only_draws_among_the_k_best() -> None:
    logits = random_logits(1, seed=2).expand(2000, V).contiguous()
    torch.manual_seed(2)
    tokens = Sampler()(logits, [SamplingParams(temperature=5.0, top_k=3)] * 2000)
    best3 = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) == best3  # all three drawn at this temperature, nothing else


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.full((3000, 4), -1e9)
    logits[:, :3] = torch.tensor([0.5, 0.3, 0.2]).log()  # token 3 has no mass at all
    torch.manual_seed(3)
    tokens = Sampler()(logits, [SamplingParams(temperature=1.0, top_p=0.75)] * 3000)
    counts = torch.bincount(tokens, minlength=4)
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 already reaches 0.75
    assert 0.55 < counts[0] / 3000 < 0.70  # renormalised: 0.5 / 0.8 = 0.625


def test_the_nucleus_widens_past_its_first_candidates_when_a_row_needs_it() -> None:
    """Each row's kept tokens are the ones a full sort keeps: a nearly flat row whose top-p holds
    thousands, a peaked one that holds a few, top-k alone (100, and 3), both."""
    width = 6000
    generator = torch.Generator().manual_seed(11)
    logits = torch.stack([-torch.linspace(0, 0.01, width), torch.randn(width, generator=generator) * 6,
                          torch.randn(width, generator=generator), torch.randn(width, generator=generator),
                          torch.randn(width, generator=generator) * 3])
    inverse = torch.tensor([1.0, 1 / 0.7, 1.0, 2.0, 1.5])
    top_k = torch.tensor([width, width, 100, 3, 500])
    top_p = torch.tensor([0.5, 0.9, 1.0, 1.0, 0.8])
    kept, tokens = nucleus(logits, inverse, top_k, top_p)
    for row in range(5):
        probs, order = torch.softmax(logits[row] * inverse[row], dim=-1).sort(descending=True)
        want = (torch.arange(width) < top_k[row]) & (probs.cumsum(0) - probs < top_p[row])
        got = tokens[row][kept[row] > float("-inf")]
        assert set(got.tolist()) == set(order[want].tolist())
    assert (kept[0] > float("-inf")).sum() > 2000  # past 64 and 512 candidates


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(20000, 3).contiguous()
    torch.manual_seed(4)
    tokens = Sampler()(logits, [SamplingParams(temperature=1.0)] * 20000)
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.02)


def test_seeded_requests_repeat_whatever_shares_the_batch() -> None:
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = random_logits(4, seed=5)

    def run(other_rows: int) -> list[int]:
        generator = make_generator(1234, "cpu")
        out = []
        for step in range(20):
            batch = torch.cat([logits[step % 4 : step % 4 + 1], random_logits(other_rows, seed=100 + step)])
            rows = [params] + [SamplingParams(temperature=1.0)] * other_rows
            out.append(int(sampler(batch, rows, [generator] + [None] * other_rows)[0]))
        return out

    first = run(other_rows=0)
    assert run(other_rows=5) == first
    assert len(set(first)) > 1  # it really samples
    other = [int(sampler(logits[s % 4 : s % 4 + 1], [params], [make_generator(99, "cpu")])[0]) for s in range(20)]
    assert other != first


def test_a_seeded_row_draws_one_number_a_step() -> None:
    """Its generator moves by one uniform number a step, not one a token: sampling costs the same
    whatever the vocabulary, and a seed's stream is the rows' own."""
    generator, twin = make_generator(7, "cpu"), make_generator(7, "cpu")
    Sampler()(random_logits(1), [SamplingParams(temperature=1.0, seed=7)], [generator])
    torch.rand((), dtype=torch.float64, generator=twin)
    assert torch.equal(generator.get_state(), twin.get_state())


DRAWS = {"kernel": inverse_cdf, "reference": inverse_cdf_ref}


@pytest.fixture(scope="module")
def kernel_built() -> None:
    assert cpu_inverse_cdf.available()  # make test installs what building it takes


@pytest.mark.parametrize("draw", DRAWS.values(), ids=DRAWS.keys())
def test_the_draw_picks_the_token_whose_share_holds_it(draw, kernel_built) -> None:
    logits = torch.tensor([0.6, 0.3, 0.1, 0.0]).log().expand(6, 4).contiguous()  # the last: -inf, weight 0
    drawn = torch.tensor([0.0, 0.59, 0.61, 0.89, 0.95, 1 - 2.0**-53], dtype=torch.float64)
    assert draw(logits, torch.ones(6), drawn).tolist() == [0, 0, 1, 1, 2, 2]  # never the token of weight 0
    gaps = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0]] * 3)  # weight only at 1 and 3
    ends = torch.tensor([0.0, 0.5, 1 - 2.0**-53], dtype=torch.float64)
    assert draw(gaps, torch.ones(3), ends).tolist() == [1, 3, 3]


@pytest.mark.parametrize("width", [1, 7, 63, 64, 65, 1000, 49152])
def test_the_kernel_draws_what_the_reference_draws(width: int, kernel_built) -> None:
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(48, width, generator=generator) * 4
    logits[3, : width // 2] = float("-inf")  # a top-k or top-p mask
    inverse = torch.rand(48, generator=generator) * 3 + 0.1
    drawn = torch.rand(48, dtype=torch.float64, generator=generator)
    assert torch.equal(inverse_cdf(logits, inverse, drawn), inverse_cdf_ref(logits, inverse, drawn))


@pytest.mark.parametrize("draw", DRAWS.values(), ids=DRAWS.keys())
def test_a_row_that_is_not_finite_gets_a_token_in_range(draw, kernel_built) -> None:
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, nan, 2.0], [-inf, -inf, -inf], [inf, 0.0, 0.0], [nan, nan, nan]])
    tokens = draw(logits, torch.ones(4), torch.full((4,), 0.5, dtype=torch.float64))
    assert ((tokens >= 0) & (tokens < 3)).all()


def test_a_tiny_temperature_is_greedy(kernel_built) -> None:
    logits = random_logits(8, seed=9)
    for top_p in (1.0, 0.5):
        tokens = Sampler()(logits, [SamplingParams(temperature=1e-45, top_p=top_p)] * 8)
        assert torch.equal(tokens, logits.argmax(-1))


def test_the_least_likely_tokens_keep_their_share() -> None:
    """49,151 tokens of one part in 10^6 each after one that holds the rest: a draw at the middle of
    every 4,096th one's share picks it, with the whole vocabulary's sums to walk past."""
    width, tiny = 49152, 1e-6
    logits = torch.full((1, width), math.log(tiny))
    logits[0, 0] = math.log(1 - tiny * (width - 1))
    edges = torch.tensor([1 - tiny * (width - 1) + tiny * k + tiny / 2 for k in range(0, width - 1, 4096)])
    for draw in DRAWS.values():
        tokens = draw(logits.expand(len(edges), width).contiguous(), torch.ones(len(edges)), edges.double())
        assert tokens.tolist() == list(range(1, width, 4096))


def test_the_kernel_refuses_bad_arguments(kernel_built) -> None:
    ok = {"logits": torch.zeros(2, 5), "inv_temperature": torch.ones(2), "drawn": torch.zeros(2, dtype=torch.float64)}
    for bad in ({"logits": torch.zeros(2, 5, dtype=torch.float64)}, {"logits": torch.zeros(2, 0)},
                {"logits": torch.zeros(2, 10)[:, ::2]}, {"inv_temperature": torch.ones(3)},
                {"drawn": torch.zeros(2)}, {"drawn": torch.zeros(2, 1, dtype=torch.float64)}):
        with pytest.raises(RuntimeError):
            cpu_inverse_cdf.inverse_cdf(**{**ok, **bad})


def test_seed_without_generator_is_refused() -> None:
    with pytest.raises(ValueError, match="generator"):
        Sampler()(random_logits(1), [SamplingParams(temperature=1.0, seed=7)])


def test_row_count_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="rows"):
        Sampler()(random_logits(2), [SamplingParams()])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_construction_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_are_valid() -> None:
    SamplingParams()
    SamplingParams(temperature=0.0, top_p=1.0, top_k=50, seed=3, stop=("\n\n",))
