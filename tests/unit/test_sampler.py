"""Sampler: greedy, temperature, top-k, top-p and seeds; SamplingParams validation."""

import pytest
import torch

from services.worker.engine.sampler import ARGMAX_CHUNK, Sampler, argmax_rows, make_generator
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
