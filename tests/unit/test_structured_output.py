"""Structured output's pure parts: the batched grammar mask, grammars from requests, the compile cache."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from kernels import cpu_token_bitmask
from services.edge.protocol import ChatFrame, ChatMessage
from services.edge.structured_request import (
    FunctionName,
    FunctionSpec,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    ToolSpec,
    request_grammar,
)
from services.worker.engine import grammar_mask
from services.worker.engine.grammar_compiler import GrammarCompiler
from services.worker.engine.grammar_mask import apply_token_bitmask
from services.worker.engine.grammar_matchers import GrammarMatchers
from services.worker.engine.types import Constraint
from shared import wire
from shared.models.spec import resolve_model
from shared.models.structured import InvalidGrammar, check_grammar
from shared.models.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(params=["kernel", "tensors"])
def mask_path(request, monkeypatch):
    """Each mask test runs through the C++ kernel and through the tensor operations that serve without it."""
    if request.param == "kernel":
        assert cpu_token_bitmask.available()  # built on this machine: the test reaches it
    else:
        monkeypatch.setattr(grammar_mask.cpu_token_bitmask, "serves", lambda logits: False)
    return request.param


def test_mask_keeps_only_allowed_tokens_and_leaves_other_rows_alone(mask_path):
    logits = torch.arange(3 * 40, dtype=torch.float32).reshape(3, 40)  # (S, V), V not a multiple of 32
    before = logits.clone()
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) - (1 << 31)  # tokens 3 and 31: bit 31 makes the int32 negative
    bitmask[0, 1] = 1 << 5  # token 37
    apply_token_bitmask(logits, torch.tensor([1]), bitmask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [3, 31, 37] and logits[1, 37] == before[1, 37]


def test_mask_of_random_words_equals_a_bit_by_bit_reading(mask_path):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 100, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32, generator=gen)
    bitmask[1, 1], bitmask[2, 2], bitmask[3, 3] = 0, -1, 0  # words that allow none and all of theirs
    allowed = torch.tensor([[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(100)] for r in range(5)])
    expected = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(apply_token_bitmask(logits, torch.arange(5), bitmask), expected)


def test_mask_narrower_than_the_logits_allows_nothing_past_its_end(mask_path):
    logits = torch.zeros(1, 40)
    apply_token_bitmask(logits, torch.tensor([0]), torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isfinite(logits[0, :32]).all() and torch.isinf(logits[0, 32:]).all()


def test_mask_kernel_refuses_a_row_the_logits_lack():
    with pytest.raises(RuntimeError, match="not a row"):
        cpu_token_bitmask.apply_token_bitmask(torch.zeros(2, 40), torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int32))


def frame(**fields) -> ChatFrame:
    return ChatFrame(type="chat", id="c", messages=[ChatMessage("user", "hi")], **fields)


WEATHER = ToolSpec("function", FunctionSpec("get_weather", parameters={"type": "object", "properties": {}}))


def test_request_grammars():
    assert request_grammar(frame()) is None
    assert request_grammar(frame(response_format=ResponseFormat("text"))) is None
    assert request_grammar(frame(response_format=ResponseFormat("json_object"))) == wire.Grammar("json_object")
    assert request_grammar(frame(structured_outputs=StructuredOutputs(choice=["a", "b"]))) == wire.Grammar(
        "choice", '["a", "b"]'
    )
    assert request_grammar(frame(tools=[WEATHER])) is None  # auto: the reply is parsed, not forced
    forced = request_grammar(frame(tools=[WEATHER], tool_choice=NamedToolChoice("function", FunctionName("get_weather"))))
    assert forced is not None and forced.kind == "lark" and '"const": "get_weather"' in forced.spec


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": StructuredOutputs(regex="[a-")},
        {"structured_outputs": StructuredOutputs(regex="a", choice=["a"])},
        {"tool_choice": "required"},  # no tools
        {"tools": [WEATHER], "tool_choice": NamedToolChoice("function", FunctionName("other"))},
        {"response_format": ResponseFormat("json_object"), "structured_outputs": StructuredOutputs(regex="a")},
    ],
)
def test_request_grammar_refusals(fields):
    with pytest.raises(InvalidGrammar):
        request_grammar(frame(**fields))


def test_schema_check_is_cached_and_names_the_problem():
    with pytest.raises(InvalidGrammar, match="objx"):
        check_grammar(wire.Grammar("json_schema", '{"type": "objx"}'))
    check_grammar(wire.Grammar("json_schema", json.dumps(SCHEMA)))
    from shared.models.structured import _grammar_error

    hits = _grammar_error.cache_info().hits
    check_grammar(wire.Grammar("json_schema", json.dumps(SCHEMA)))
    assert _grammar_error.cache_info().hits == hits + 1


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(resolve_model("tiny").tokenizer_folder)


def test_compiler_caches_one_matcher_per_grammar_and_hands_out_copies(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, (2,))
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    first, second = compiler.submit(constraint).result(30), compiler.matcher(constraint)
    assert compiler.num_cached == 1 and first is not second
    for token in tokenizer.encode('{"n": 4', add_special_tokens=False):
        assert first.consume_token(token)
    assert not second.is_accepting()  # a copy's state is its own
    with pytest.raises(InvalidGrammar):
        compiler.submit(Constraint("regex", "[a-")).result(30)
    compiler.close()


def test_matchers_fill_the_batch_mask_and_end_with_the_grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, (2,))
    matchers = GrammarMatchers(49152)
    matchers.add("r", compiler.matcher(Constraint("choice", '["yes", "no"]')))
    assert matchers.bitmask(["other"], torch.device("cpu")) is None
    rows, bitmask = matchers.bitmask(["other", "r"], torch.device("cpu"))
    assert rows.tolist() == [1] and bitmask.shape == (1, 49152 // 32)
    logits = torch.zeros(2, 49152)
    apply_token_bitmask(logits, rows, bitmask)
    allowed = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert yes[0] in allowed and len(allowed) < 10 and torch.isfinite(logits[0]).all()
    done = [matchers.accept("r", t) for t in yes]
    assert done[-1] and not any(done[:-1]) and not matchers.accept("unknown", 5)
    compiler.close()


def test_a_token_is_refused_exactly_where_the_batch_mask_leaves_it_out(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, (2,))
    matchers = GrammarMatchers(49152)
    matchers.add("r", compiler.matcher(Constraint("json_schema", json.dumps(SCHEMA))))
    candidates = list(range(0, 49152, 7))
    for text in ("", '{"n"', ": 1"):
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert not matchers.refused(["r"], [token]) and not matchers.accept("r", token)
        rows, bitmask = matchers.bitmask(["r"], torch.device("cpu"))
        logits = torch.zeros(1, 49152)
        apply_token_bitmask(logits, rows, bitmask)
        allowed = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
        refused = matchers.refused(["r"] * len(candidates), candidates)
        assert {candidates[i] for i in refused} == set(candidates) - allowed
        assert matchers.refused(["other", "r"], [candidates[refused[0]]] * 2) == [1]  # no grammar, no refusal
    compiler.close()


def test_a_request_whose_draws_its_grammar_keeps_refusing_is_checked_ever_less_often(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, (2,))
    matchers = GrammarMatchers(49152)
    matchers.add("r", compiler.matcher(Constraint("json_schema", json.dumps(SCHEMA))))
    never = tokenizer.encode("}", add_special_tokens=False)[0]  # not before the object opens
    allowed = tokenizer.encode("{", add_special_tokens=False)[0]
    gaps = []
    for _ in range(6):
        assert matchers.worth_checking("r") and matchers.refused(["r"], [never]) == [0]
        skipped = 0
        while not matchers.worth_checking("r"):
            skipped += 1
        gaps.append(skipped)
    assert gaps == [1, 3, 7, 15, 15, 15]
    # worth_checking has just said yes: a draw the grammar allows is taken, and the next step checks again
    assert matchers.refused(["r"], [allowed]) == [] and matchers.worth_checking("r")
    matchers.remove("r")
    assert matchers.worth_checking("r")
    compiler.close()


def test_llguidance_does_not_need_torch_at_the_edge():
    assert "torch" not in llguidance.__dict__
