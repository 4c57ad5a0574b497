"""The output layer on a CPU: a bfloat16 screen, then float32 for the tokens it leaves open
(kernels/cpu_screened_output.cpp, services/worker/engine/screened_output.py). A greedy row's token must
be the one every float32 logit gives, near-ties, odd sizes and non-finite rows included; a sampled row's
must be drawn from the softmax of float32 logits, however often its proposals are refused; an engine
that uses it decodes the same greedy tokens as one that does not, and only rows whose logits nothing
touches take it."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import torch

from kernels import cpu_screened_output
from services.worker.engine import screened_output
from services.worker.engine.cpu_linear import use_cpu_linear_
from services.worker.engine.engine import Engine
from services.worker.engine.grammar_mask import apply_token_bitmask
from services.worker.engine.logits_processors import PendingTokens
from services.worker.engine.model import LlamaModel
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.screened_output import (
    GRAPH_ROWS_SCREENED_FROM,
    SCREENED_AMONG_OTHERS,
    ScreenedOutput,
    screened_output_for,
    screens,
)
from services.worker.engine.settings import EngineSettings
from shared.models.shapes import SHAPES
from tests.unit.engine_runs import finish

pytestmark = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="this CPU's oneDNN does not multiply bfloat16")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_screened_output.available()


GREEDY = SamplingParams(temperature=0.0)


def greedy_tokens(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return ScreenedOutput(weight).tokens(hidden, [GREEDY] * hidden.shape[0])


def exact_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # float64 logits' argmax
    return (hidden.double() @ weight.double().T).argmax(dim=1)


def random_layer(vocab: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, width, generator=generator) * 0.05, torch.randn(64, width, generator=generator) * 2


@pytest.mark.parametrize("vocab, width", [(49152, 576), (1000, 64), (1037, 50), (7, 3), (1, 16)])
def test_the_token_is_the_largest_exact_logit(vocab: int, width: int) -> None:
    weight, hidden = random_layer(vocab, width, seed=vocab + width)
    tokens = greedy_tokens(weight, hidden)
    assert tokens.dtype == torch.int64 and tokens.shape == (64,)
    exact = hidden.double() @ weight.double().T
    chosen = exact.gather(1, tokens[:, None]).squeeze(1)
    # float32's own sums may order two logits a few units of its last place apart differently
    assert torch.all(exact.amax(dim=1) - chosen <= 1e-5 * (hidden.norm(dim=1).double() * weight.norm(dim=1).max()))
    assert torch.equal(tokens, exact_argmax(hidden, weight)) or vocab > 1000  # a tie that close is rare


def test_tokens_the_screen_cannot_tell_apart_are_rescored_in_float32() -> None:
    """Each row's top two tokens lie ~1e-5 of a logit apart, far closer than bfloat16 can tell (their
    weights round to the same bfloat16 values): the float32 winner, every time, whichever comes first."""
    generator = torch.Generator().manual_seed(1)
    width, vocab, rows = 576, 4096, 32
    weight = torch.randn(vocab, width, generator=generator) * 0.01
    hidden = torch.randn(rows, width, generator=generator)
    expected = []
    for row in range(rows):
        favourite = (hidden[row] / hidden[row].norm()).bfloat16().float()  # exact in bfloat16
        first, second = 100 + 2 * row, 101 + 2 * row
        winner, loser = (first, second) if row % 2 == 0 else (second, first)
        weight[loser] = favourite
        nudge = 2e-4 * torch.sign(hidden[row]) / width * (favourite.abs() > 1e-3)  # under half of their last bit
        weight[winner] = favourite + nudge
        expected.append(winner)
    assert torch.equal(weight[100:164:2].bfloat16(), weight[101:164:2].bfloat16())  # the screen sees ties
    assert exact_argmax(hidden, weight).tolist() == expected
    assert greedy_tokens(weight, hidden).tolist() == expected


def test_logits_near_zero_whose_products_cancel_are_ranked_in_float32() -> None:
    """Every token's weights nearly orthogonal to the state: logits 2e-5 apart, where rounding the inputs
    to bfloat16 moves each by ~1e-3 (the bound's slack, not the output's rounding, must cover that)."""
    generator = torch.Generator().manual_seed(7)
    vocab, width = 2000, 256
    screen_missed = 0
    for _ in range(8):
        hidden = torch.randn(1, width, generator=generator, dtype=torch.float64)
        hidden *= 10 / hidden.norm()
        weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64) / width**0.5
        weight -= (weight @ hidden.T) @ hidden / hidden.norm() ** 2  # orthogonal: logits 0
        logits = torch.randperm(vocab, generator=generator, dtype=torch.float64) * 2e-5
        weight += logits[:, None] * hidden / hidden.norm() ** 2
        hidden, weight = hidden.float(), weight.float()
        screen = (hidden.bfloat16().float() @ weight.bfloat16().float().T).argmax(dim=1)
        exact = exact_argmax(hidden, weight)
        assert exact.item() == logits.argmax().item()
        assert greedy_tokens(weight, hidden).tolist() == exact.tolist()
        screen_missed += screen.item() != exact.item()
    assert screen_missed >= 4  # the case is one the bfloat16 product alone gets wrong


def test_equal_logits_give_the_first_token_as_argmax_does() -> None:
    weight, hidden = random_layer(300, 32, seed=2)
    weight[250] = weight[40] = weight[7] = hidden[0] / 4  # row 0's favourite, three times over
    tokens = greedy_tokens(weight, hidden[:1])
    assert tokens.tolist() == [7]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_row_that_is_not_finite_picks_as_argmax_over_float32_logits(bad: float) -> None:
    weight, hidden = random_layer(500, 40, seed=3)
    hidden[1, 5] = bad
    tokens = greedy_tokens(weight, hidden[:3])
    assert tokens.tolist() == (hidden[:3] @ weight.T).argmax(dim=1).tolist()


def test_no_rows_no_tokens() -> None:
    weight, hidden = random_layer(100, 16, seed=4)
    assert greedy_tokens(weight, hidden[:0]).shape == (0,)


def test_a_screen_row_of_nan_is_rescored_over_every_token() -> None:
    weight, hidden = random_layer(100, 16, seed=5)
    norms = weight.norm(dim=1)
    screen = (hidden @ weight.T).bfloat16()
    screen[0, 3] = float("nan")
    tokens = cpu_screened_output.screened_tokens(screen, hidden, weight, norms, *greedy_rows(hidden.shape[0]))
    assert tokens.tolist() == (hidden @ weight.T).argmax(dim=1).tolist()


def greedy_rows(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's temperature and numbers for `rows` greedy rows."""
    return torch.zeros(rows), torch.zeros(rows, 0, dtype=torch.float64)


def layer_with_logits(logits: torch.Tensor, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (V, width) weight and a state of norm 10 whose logits are `logits` (within float32's rounding)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, width, generator=generator, dtype=torch.float64)
    hidden *= 10 / hidden.norm()
    weight = torch.randn(len(logits), width, generator=generator, dtype=torch.float64) * 0.3
    weight -= (weight @ hidden.T) @ hidden / hidden.norm() ** 2
    weight += logits.double()[:, None] * hidden / hidden.norm() ** 2
    return weight.float().contiguous(), hidden.float()


def tail_heavy_layer(temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ten likely tokens and 1,990 unlikely ones that together hold a good share of the weight, outside
    the window the kernel rescores: their proposals come from the screen's bounds, kept or refused.
    Returns the weight, the state and the softmax of its float32 logits at `temperature`."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.cat([torch.rand(10, generator=generator) * 2, torch.rand(1990, generator=generator) - 5.5])
    weight, hidden = layer_with_logits(logits * temperature, width=48, seed=12)  # the same shares at every T
    expected = torch.softmax((hidden.double() @ weight.double().T)[0] / temperature, dim=0)
    assert 0.2 < float(expected[10:].sum()) < 0.8  # the tail matters
    return weight, hidden, expected


def assert_drawn_from(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """The ten likely tokens' shares and the tail's, each within 5 sigma of `expected`'s."""
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    observed = torch.cat([counts[:10], counts[10:].sum(0, True)]) / len(tokens)
    expected = torch.cat([expected[:10], expected[10:].sum(0, True)])
    sigma = (expected * (1 - expected) / len(tokens)).sqrt()
    assert torch.all((observed - expected).abs() <= 5 * sigma + 1e-4), (observed, expected)


DRAWS, CHUNK = 60_000, 5_000


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0])
def test_a_sampled_row_draws_from_the_softmax_of_float32_logits(temperature: float) -> None:
    """The kernel alone, at its own bounds: its draws follow softmax(x / T), and rows that refuse every
    proposal are rarer than one in a thousand."""
    weight, hidden, expected = tail_heavy_layer(temperature)
    generator = torch.Generator().manual_seed(13)
    screen = (hidden.bfloat16() @ weight.bfloat16().T).expand(CHUNK, -1).contiguous()
    states, temperatures = hidden.expand(CHUNK, -1).contiguous(), torch.full((CHUNK,), temperature)
    drawn = []
    for _ in range(DRAWS // CHUNK):
        numbers = torch.rand(CHUNK, 2 * screened_output.ATTEMPTS, generator=generator, dtype=torch.float64)
        drawn.append(cpu_screened_output.screened_tokens(screen, states, weight, weight.norm(dim=1), temperatures,
                                                         numbers))
    tokens = torch.cat(drawn)
    kept = tokens[tokens != cpu_screened_output.FELL_BACK]
    assert len(tokens) - len(kept) <= DRAWS // 1000
    assert_drawn_from(kept, expected)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_rows_whose_proposals_are_mostly_refused_still_draw_from_the_softmax(temperature: float, monkeypatch) -> None:
    """Bounds made 8 times looser and only the greedy contenders rescored: most proposals are refused and
    some rows refuse all of theirs, which their caller draws from every float32 logit; the draws must
    still follow softmax(x / T) (a kernel that kept every proposal would put too much weight on the tail)."""
    weight, hidden, expected = tail_heavy_layer(temperature)
    looser = cpu_screened_output.slack
    monkeypatch.setattr(cpu_screened_output, "slack", lambda width: 8 * looser(width))
    monkeypatch.setattr(cpu_screened_output, "RESCORED_WINDOW", 0.0)
    torch.manual_seed(17)
    output, params = ScreenedOutput(weight), [SamplingParams(temperature=temperature)] * CHUNK
    tokens = torch.cat([output.tokens(hidden.expand(CHUNK, -1), params) for _ in range(DRAWS // CHUNK)])
    assert_drawn_from(tokens, expected)
    screen = (hidden.bfloat16() @ weight.bfloat16().T).expand(CHUNK, -1).contiguous()
    alone = cpu_screened_output.screened_tokens(
        screen, hidden.expand(CHUNK, -1).contiguous(), weight, weight.norm(dim=1), torch.full((CHUNK,), temperature),
        torch.rand(CHUNK, 2, dtype=torch.float64))  # one proposal a row: a refused one falls back
    assert int((alone == cpu_screened_output.FELL_BACK).sum()) >= CHUNK // 10


def test_greedy_and_sampled_rows_share_a_call_and_rows_without_numbers_fall_back() -> None:
    weight, hidden = random_layer(700, 24, seed=14)
    screen, norms = (hidden.bfloat16() @ weight.bfloat16().T), weight.norm(dim=1)
    temperature = torch.tensor([0.0, 0.8] * 32)
    drawn = torch.rand(64, 2 * screened_output.ATTEMPTS, dtype=torch.float64)
    tokens = cpu_screened_output.screened_tokens(screen, hidden, weight, norms, temperature, drawn)
    assert torch.equal(tokens[0::2], exact_argmax(hidden[0::2], weight))
    assert bool(((tokens[1::2] >= 0) & (tokens[1::2] < 700)).all())
    none = cpu_screened_output.screened_tokens(screen, hidden, weight, norms, temperature, drawn[:, :0].contiguous())
    assert torch.equal(none[0::2], tokens[0::2]) and bool((none[1::2] == cpu_screened_output.FELL_BACK).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_sampled_row_that_is_not_finite_falls_back_and_gets_a_token_in_range(bad: float) -> None:
    weight, hidden = random_layer(300, 20, seed=15)
    hidden[2, 4] = bad
    screen = (hidden.bfloat16() @ weight.bfloat16().T)
    temperature, drawn = torch.full((64,), 0.9), torch.rand(64, 2 * screened_output.ATTEMPTS, dtype=torch.float64)
    tokens = cpu_screened_output.screened_tokens(screen, hidden, weight, weight.norm(dim=1), temperature, drawn)
    assert tokens[2] == cpu_screened_output.FELL_BACK
    tokens = ScreenedOutput(weight).tokens(hidden, [SamplingParams(temperature=0.9)] * 64)
    assert bool(((tokens >= 0) & (tokens < 300)).all())


def test_rows_that_fall_back_are_drawn_from_every_float32_logit(monkeypatch) -> None:
    """No attempts: every sampled row is drawn by its caller, from the same softmax."""
    monkeypatch.setattr(screened_output, "ATTEMPTS", 0)
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    weight, hidden = layer_with_logits(logits, width=16, seed=16)
    rows = 20_000
    tokens = ScreenedOutput(weight).tokens(hidden.expand(rows, -1), [SamplingParams(temperature=1.0)] * rows)
    observed = torch.bincount(tokens, minlength=5).double() / rows
    expected = torch.softmax(logits.double(), dim=0)
    assert torch.all((observed - expected).abs() <= 5 * (expected * (1 - expected) / rows).sqrt())


@pytest.mark.parametrize("case", ["screen dtype", "rows", "width", "vocab", "norms", "empty vocab", "temperature rows",
                                  "negative temperature", "nan temperature", "odd numbers", "numbers dtype"])
def test_bad_arguments_raise_not_crash(case: str) -> None:
    weight, hidden = random_layer(100, 16, seed=6)
    temperature, drawn = torch.full((64,), 0.7), torch.rand(64, 4, dtype=torch.float64)
    args = {"screen": (hidden @ weight.T).bfloat16(), "hidden": hidden, "weight": weight, "norms": weight.norm(dim=1),
            "temperature": temperature, "drawn": drawn}
    if case == "screen dtype":
        args["screen"] = args["screen"].float()
    elif case == "rows":
        args["hidden"] = hidden[:3]
    elif case == "width":
        args["weight"] = weight[:, :8].contiguous()
    elif case == "vocab":
        args["weight"] = weight[:50].contiguous()
    elif case == "norms":
        args["norms"] = args["norms"][:10]
    elif case == "empty vocab":
        args.update(screen=args["screen"][:, :0], weight=weight[:0], norms=weight[:0, 0])
    elif case == "temperature rows":
        args["temperature"] = temperature[:5]
    elif case in ("negative temperature", "nan temperature"):
        args["temperature"] = temperature.clone().index_fill_(0, torch.tensor([9]), -1.0 if "neg" in case else torch.nan)
    elif case == "odd numbers":
        args["drawn"] = drawn[:, :3].contiguous()
    else:
        args["drawn"] = drawn.float()
    with pytest.raises(RuntimeError):
        cpu_screened_output.screened_tokens(**args)


def test_the_slack_covers_bfloat16s_rounding_of_both_inputs() -> None:
    assert 2 * 2.0**-9 < cpu_screened_output.slack(576) < 2 * 2.0**-9 * 1.05
    assert cpu_screened_output.slack(4096) > cpu_screened_output.slack(576)


def test_only_rows_whose_logits_nothing_touches_take_it() -> None:
    assert screens(SamplingParams(temperature=0.0)) and screens(SamplingParams(temperature=0.7))
    for other in (SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.7, top_p=0.9),
                  SamplingParams(temperature=0.7, top_k=40), SamplingParams(temperature=0.0, logprobs=0),
                  SamplingParams(temperature=0.7, logprobs=0), SamplingParams(temperature=0.0, repetition_penalty=1.2),
                  SamplingParams(temperature=0.7, frequency_penalty=0.5),
                  SamplingParams(temperature=0.0, logit_bias=((5, 3.0),)),
                  SamplingParams(temperature=0.0, min_tokens=4)):
        assert not screens(other), other


@pytest.fixture(scope="module")
def tied() -> LlamaModel:
    """The `tiny` shape, tied as shipped, with strong projections so that every output depends on the context."""
    model = LlamaModel(SHAPES["tiny"])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(
                0.0, 0.2 if "proj" in name else 1.0, generator=generator)
    return model.eval()


def engine_of(model: LlamaModel, screen: bool) -> Engine:
    settings = EngineSettings(num_kv_blocks=64, cpu_output_screen=screen)
    return Engine(use_cpu_linear_(copy.deepcopy(model)), settings, 512, eos_token_ids=())


def screened_steps(engine: Engine, requests: list[Request]) -> tuple[list[list[int]], int]:
    """The requests' tokens, and how many times the screen ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        tokens = finish(engine, requests)
    return tokens, sum(event.name == "drivetrain::screened_tokens" for event in profile.events())


def steps_with_logprobs(engine: Engine, requests: list[Request]) -> tuple[list[list[int]], dict[str, list], int]:
    """The requests' tokens, the log-probabilities each update carried by request, and how many times the
    screen ran."""
    for request in requests:
        engine.add_request(request)
    logprobs: dict[str, list] = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        while engine.has_unfinished_requests():
            for update in engine.step():
                if update.logprobs:
                    logprobs.setdefault(update.request_id, []).extend(update.logprobs)
    screened = sum(event.name == "drivetrain::screened_tokens" for event in profile.events())
    return [request.output_token_ids for request in requests], logprobs, screened


def test_an_engine_with_the_screen_decodes_the_tokens_of_one_without(tied: LlamaModel, one_torch_thread) -> None:
    with_screen, without = engine_of(tied, True), engine_of(tied, False)
    assert screened_output_for(with_screen.runner.model) is not None and with_screen.runner.screened_output is not None
    assert without.runner.screened_output is None
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(6)]
    ours, screened = screened_steps(with_screen, [Request(f"g{i}", p, greedy) for i, p in enumerate(prompts)])
    theirs, none = screened_steps(without, [Request(f"g{i}", p, greedy) for i, p in enumerate(prompts)])
    assert ours == theirs and screened >= greedy.max_tokens and none == 0


def test_an_engine_draws_unseeded_sampled_rows_through_the_screen(tied: LlamaModel, one_torch_thread) -> None:
    engine = engine_of(tied, True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    requests = [Request(f"s{i}", list(range(4 + i, 30 + i)), sampled) for i in range(4)]
    tokens, screened = screened_steps(engine, requests)
    assert screened >= sampled.max_tokens
    assert all(len(t) == 12 and all(0 <= token < SHAPES["tiny"].vocab_size for token in t) for t in tokens)


def test_rows_whose_logits_something_touches_take_every_logit(tied: LlamaModel, one_torch_thread) -> None:
    engine = engine_of(tied, True)
    for params in (SamplingParams(max_tokens=8, temperature=0.8, seed=3),
                   SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, ignore_eos=True),
                   SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
                   SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)):
        _, screened = screened_steps(engine, [Request("x", list(range(5, 30)), params)])
        assert screened == 0, params
    # one such row among greedy ones: the whole step takes every logit
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    mixed = [Request("a", list(range(5, 30)), plain), Request("b", list(range(9, 40)), dataclasses.replace(
        plain, logprobs=1))]
    _, screened = screened_steps(engine, mixed)
    assert screened == 0


def test_a_step_with_enough_screened_rows_screens_them_and_draws_the_others_from_every_logit(
        tied: LlamaModel, one_torch_thread) -> None:
    """SCREENED_AMONG_OTHERS greedy rows beside a row with log-probabilities, a penalised one, a seeded
    sampled one and a top-p one: the screen runs for the greedy rows, each of the others is drawn as it
    asks, and every token is the one an engine without the screen gives."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    others = [dataclasses.replace(greedy, logprobs=2), dataclasses.replace(greedy, repetition_penalty=1.3),
              dataclasses.replace(greedy, temperature=0.9, seed=4), dataclasses.replace(greedy, temperature=0.9,
                                                                                         top_p=0.8, seed=5)]
    params = [greedy] * SCREENED_AMONG_OTHERS + others

    def requests() -> list[Request]:
        return [Request(f"m{i}", list(range(3 + i, 24 + i)), p) for i, p in enumerate(params)]

    with_screen, without = engine_of(tied, True), engine_of(tied, False)
    ours, our_logprobs, screened = steps_with_logprobs(with_screen, requests())
    theirs, their_logprobs, none = steps_with_logprobs(without, requests())
    assert ours == theirs and none == 0 and screened >= greedy.max_tokens - 1  # the prompt step screens too
    assert all(len(t) == 10 for t in ours)
    asked = f"m{SCREENED_AMONG_OTHERS}"
    assert set(our_logprobs) == {asked} and len(our_logprobs[asked]) == 10
    assert [lp.token_id for lp in our_logprobs[asked]] == ours[SCREENED_AMONG_OTHERS]
    for mine, plain in zip(our_logprobs[asked], their_logprobs[asked], strict=True):
        assert mine.logprob == pytest.approx(plain.logprob, abs=1e-4) and len(mine.top) == 2
    fewer = engine_of(tied, True)
    _, screened = screened_steps(fewer, requests()[1:])  # one screened row short: every logit for all
    assert screened == 0


def test_pending_tokens_of_some_sampled_rows_are_numbered_as_those_rows() -> None:
    pending = PendingTokens([0, 2, 5], torch.tensor([10, 12, 15]))
    part = pending.of_sampled([5, 1, 2])
    assert part is not None and dict(zip(part.rows, part.tokens.tolist(), strict=True)) == {0: 15, 2: 12}
    assert pending.of_sampled([1, 3]) is None


def test_compiled_steps_of_few_rows_keep_the_output_layer_and_steps_of_more_are_screened(
        tied: LlamaModel, one_torch_thread) -> None:
    """A few rows' graph ends with the output layer, read there faster than the screen reads its own;
    a graph of more rows ends at the final norm, and its steps take the screen, or, sampled, the
    output layer after the graph. Either way the tokens of an engine without the screen."""
    settings = EngineSettings(num_kv_blocks=64, cpu_compile="on", cpu_graph_store=False)
    compiled = Engine(use_cpu_linear_(copy.deepcopy(tied)), settings, 512, eos_token_ids=())
    graphs = compiled.runner.decode_graphs
    assert graphs is not None and not graphs.failed and graphs.output_layers == (True, False)
    assert [graphs.ends_with_logits(rows) for rows in (1, GRAPH_ROWS_SCREENED_FROM - 1, GRAPH_ROWS_SCREENED_FROM)] == [
        True, True, False]
    plain = engine_of(tied, False)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for rows, screened_steps_at_least, screened_steps_at_most in ((1, 0, 1), (GRAPH_ROWS_SCREENED_FROM, 8, 99)):
        prompts = [list(range(3 + i, 30 + 2 * i)) for i in range(rows)]
        before = compiled.load().graph_steps
        ours, screened = screened_steps(compiled, [Request(f"c{rows}.{i}", p, greedy) for i, p in enumerate(prompts)])
        theirs, _ = screened_steps(plain, [Request(f"p{rows}.{i}", p, greedy) for i, p in enumerate(prompts)])
        assert ours == theirs
        assert screened_steps_at_least <= screened <= screened_steps_at_most  # a few rows: the prompt step only
        assert compiled.load().graph_steps >= before + greedy.max_tokens - 1
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)
    wide = [Request(f"s{i}", list(range(7 + i, 33 + i)), sampled) for i in range(GRAPH_ROWS_SCREENED_FROM)]
    before = compiled.load().graph_steps
    tokens, screened = screened_steps(compiled, wide)
    assert screened == 0 and all(len(t) == 8 for t in tokens)  # seeded: the output layer after the graph
    assert compiled.load().graph_steps >= before + sampled.max_tokens - 1
    unseeded = [Request(f"u{i}", list(range(7 + i, 33 + i)), dataclasses.replace(sampled, seed=None))
                for i in range(GRAPH_ROWS_SCREENED_FROM)]
    tokens, screened = screened_steps(compiled, unseeded)
    assert screened >= sampled.max_tokens - 1 and all(len(t) == 8 for t in tokens)



# --- rows under a grammar: drawn through the screen, checked, drawn again masked where refused ----------


@pytest.fixture(scope="module")
def tokenizer():
    from shared.models.spec import resolve_model
    from shared.models.tokenizer import Tokenizer

    return Tokenizer.from_folder(resolve_model("tiny").tokenizer_folder)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from services.worker.engine.grammar_compiler import GrammarCompiler

    made = GrammarCompiler(tokenizer, SHAPES["tiny"].vocab_size, (2,))
    yield made
    made.close()


def constrained_steps(engine: Engine, requests: list[Request], constraint, compiler) -> tuple[list[list[int]], int, int]:
    """The requests' tokens, each under its own matcher of the constraint; how many times the screen ran,
    and how many rows took their grammar's whole mask."""
    masked = 0
    bitmask = engine.grammars.bitmask

    def counted(sample_ids, device):
        nonlocal masked
        out = bitmask(sample_ids, device)
        masked += 0 if out is None else len(out[0])
        return out

    engine.grammars.bitmask = counted
    for request in requests:
        engine.add_request(request, compiler.matcher(constraint))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        while engine.has_unfinished_requests():
            engine.step()
    screened = sum(event.name == "drivetrain::screened_tokens" for event in profile.events())
    return [request.output_token_ids for request in requests], screened, masked


def top_token_texts(model: LlamaModel, prompt: list[int], tokenizer, ranks: range) -> tuple[list[str], torch.Tensor]:
    """The texts of the prompt's next tokens at these ranks of the model's float32 logits, and the logits."""
    with torch.no_grad():
        logits = model.dense_forward(torch.tensor(prompt))[-1]
    order = logits.argsort(descending=True).tolist()
    texts = [tokenizer.decode([order[r]], skip_special_tokens=False) for r in ranks]
    return [t for t in texts if t.strip() and '"' not in t and "\\" not in t], logits


def test_greedy_rows_under_a_grammar_give_the_tokens_of_an_engine_without_the_screen(
        tied: LlamaModel, tokenizer, compiler, one_torch_thread) -> None:
    from services.worker.engine.types import Constraint

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3 + i, 30 + 2 * i)) for i in range(SCREENED_AMONG_OTHERS)]
    texts, _ = top_token_texts(tied, prompts[0], tokenizer, range(0, 12, 2))
    constraint = Constraint("regex", "(" + "|".join(map(re.escape, texts)) + ")[a-z ]{0,40}")

    def requests() -> list[Request]:
        return [Request(f"g{i}", p, greedy) for i, p in enumerate(prompts)]

    ours, screened, masked = constrained_steps(engine_of(tied, True), requests(), constraint, compiler)
    theirs, none, every = constrained_steps(engine_of(tied, False), requests(), constraint, compiler)
    assert ours == theirs and none == 0 and screened >= 2
    assert 0 < masked < every  # some rows kept the screen's token; the others took their mask


def test_sampled_rows_under_a_grammar_draw_from_the_softmax_of_the_tokens_it_allows(
        tied: LlamaModel, tokenizer, compiler, one_torch_thread) -> None:
    """The first token of a prompt whose likeliest tokens the grammar partly allows, drawn 2,560 times at
    temperature 1: the screen's draw kept where allowed, drawn again masked where not, lands on each
    allowed token as often as the float32 softmax over the allowed tokens says, and never elsewhere."""
    from services.worker.engine.grammar_matchers import GrammarMatchers
    from services.worker.engine.types import Constraint

    prompt = list(range(11, 40))
    texts, logits = top_token_texts(tied, prompt, tokenizer, range(1, 16, 2))
    constraint = Constraint("choice", json.dumps(texts))
    matchers = GrammarMatchers(SHAPES["tiny"].vocab_size)
    matchers.add("r", compiler.matcher(constraint))
    rows, bitmask = matchers.bitmask(["r"], torch.device("cpu"))
    allowed_logits = logits.clone().unsqueeze(0)
    apply_token_bitmask(allowed_logits, rows, bitmask)
    expected = torch.softmax(allowed_logits[0].double(), dim=0)

    engine = engine_of(tied, True)
    drawn: list[int] = []
    masked_rows = 0
    sampled = SamplingParams(max_tokens=1, temperature=1.0, ignore_eos=True)
    for batch in range(40):
        tokens, screened, masked = constrained_steps(
            engine, [Request(f"s{batch}-{i}", prompt, sampled) for i in range(64)], constraint, compiler)
        assert screened >= 1
        drawn += [t[0] for t in tokens]
        masked_rows += masked
    assert 0.05 < masked_rows / len(drawn) < 0.95  # both ways of drawing were taken
    counts = torch.bincount(torch.tensor(drawn), minlength=len(expected)).double()
    assert counts[expected == 0].sum() == 0
    likely = (expected > 0.01).nonzero().flatten()
    for token in likely.tolist():
        p, n = float(expected[token]), len(drawn)
        assert abs(counts[token] - n * p) <= 5 * (n * p * (1 - p)) ** 0.5 + 1, (token, counts[token], n * p)
