"""LLMEngine, the model's GenerationEngine: chat in, text out; rejections for that request only;
abort; stop strings; usage with prefix-cache hits; whole characters only; `drivetrain generate`.
Steps in turn and overlapped alike."""

from __future__ import annotations

import json

import pytest

from services import cli
from services.worker.engine.engine import Engine
from services.worker.engine.llm_engine import LLMEngine, build_llm_engine
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import (
    EngineOutput,
    EngineRequest,
    Message,
    RequestRejected,
)
from shared.models.spec import resolve_model

SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=11)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["off", "on"], ids=["in-turn", "overlapped"])
def llm(request: pytest.FixtureRequest) -> LLMEngine:
    """Each test runs with steps in turn and overlapped (engine.overlap_scheduling, a GPU's default)."""
    settings = EngineSettings(num_kv_blocks=24, overlap_scheduling=request.param)
    return build_llm_engine(resolve_model("tiny", max_model_len=512), settings, "cpu")


def chat(request_id: str, text: str, sampling: SamplingParams = SAMPLED) -> EngineRequest:
    return EngineRequest(request_id, "tenant-a", [Message("user", text)], sampling)


def drain(llm: LLMEngine) -> dict[str, list[EngineOutput]]:
    outputs: dict[str, list[EngineOutput]] = {}
    for _ in range(1000):
        if not llm.has_unfinished_requests():
            return outputs
        for output in llm.step():
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError("the engine did not finish")


def text_of(outputs: list[EngineOutput]) -> str:
    return "".join(o.text for o in outputs)


def test_chat_streams_text_and_reports_usage_with_cached_tokens(llm: LLMEngine) -> None:
    prompt_len = len(llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}]))
    llm.add_request(chat("a", "Tell me a story."))
    first = drain(llm)["a"]
    assert first[-1].finish_reason == "length" and all(not o.finished for o in first[:-1])
    assert first[-1].usage.prompt_tokens == prompt_len and first[-1].usage.completion_tokens == 12
    assert first[-1].usage.cached_tokens == 0

    llm.add_request(chat("b", "Tell me a story."))  # the same prompt: every full block is a hit
    second = drain(llm)["b"]
    assert second[-1].usage.cached_tokens == (prompt_len - 1) // 16 * 16 > 0
    assert text_of(second) == text_of(first)  # same seed, same prompt, cached or not
    assert llm.request_ids() == []


@pytest.mark.parametrize(
    ("settings", "shares"),
    [
        (EngineSettings(num_kv_blocks=24), False),
        (EngineSettings(num_kv_blocks=24, cache_groups="tenant-a:public, tenant-b:public"), True),
        (EngineSettings(num_kv_blocks=24, cache_isolation=False), True),
    ],
    ids=["isolated", "one-group", "isolation-off"],
)
def test_a_tenant_gets_no_cached_tokens_from_another_tenants_prompt_unless_they_share_a_group(settings, shares):
    # A shared cache is a timing side channel: B could learn how A's prompts begin from its first token's speed.
    llm = build_llm_engine(resolve_model("tiny", max_model_len=512), settings, "cpu")
    text = "The secret plan begins with a long preamble that fills several blocks of the cache."
    llm.add_request(EngineRequest("a", "tenant-a", [Message("user", text)], SAMPLED))
    drain(llm)
    llm.add_request(EngineRequest("b", "tenant-b", [Message("user", text)], SAMPLED))
    llm.add_request(EngineRequest("a2", "tenant-a", [Message("user", text)], SAMPLED))
    outputs = drain(llm)
    assert (outputs["b"][-1].usage.cached_tokens > 0) is shares
    assert outputs["a2"][-1].usage.cached_tokens > 0  # a tenant still shares with itself


def test_starts_are_announced_once_before_computing_and_load_is_reported(llm: LLMEngine) -> None:
    announced: list[tuple[list[str], int]] = []
    llm.start_listener = lambda ids: announced.append((list(ids), llm.engine.num_steps))
    llm.add_request(chat("a", "First."))
    llm.step()
    llm.add_request(chat("b", "Second."))
    load = llm.load()
    assert load.running == 1 and load.waiting == 1 and 0 < load.kv_usage < 1
    assert load.free_kv_blocks < 23 and load.prefix_hit_rate == 0.0 and load.steps == 1
    drain(llm)
    # Each announced once, before the step that first computes it ran (num_steps not yet counted).
    assert announced == [(["a"], 0), (["b"], 1)]
    assert llm.load().running == 0 and llm.load().free_kv_blocks == 23


def test_oversized_prompts_are_rejected_alone(llm: LLMEngine) -> None:
    llm.add_request(chat("ok", "Hello there."))
    with pytest.raises(RequestRejected) as too_long:
        llm.add_prompt("long", list(range(3, 600)), SAMPLED)  # 597 tokens > max_model_len 512
    assert too_long.value.failure.code == "prompt_too_long" and "512" in too_long.value.failure.message
    with pytest.raises(RequestRejected) as too_big:
        # Fits the context, but needs more KV than the pool's 23 blocks (368 tokens) hold.
        llm.add_prompt("big", list(range(3, 403)), SamplingParams(max_tokens=8))
    assert too_big.value.failure.code == "prompt_too_long" and "blocks" in too_big.value.failure.message
    with pytest.raises(RequestRejected) as empty:
        llm.add_prompt("empty", [], SAMPLED)
    assert empty.value.failure.code == "invalid_request"
    assert llm.request_ids() == ["ok"]
    assert drain(llm)["ok"][-1].finish_reason == "length"


def test_abort_frees_blocks_now_and_reports_cancelled(llm: LLMEngine) -> None:
    pool = llm.engine.kv_cache_manager.block_pool
    llm.add_request(chat("a", "First question, quite a long one, to hold a few blocks of cache."))
    llm.add_request(chat("b", "Second."))
    # Until a's first token is out: overlapped, a step's tokens come back with the next call.
    assert any(any(o.request_id == "a" for o in llm.step()) for _ in range(3))
    free_before = pool.num_free_blocks
    final = llm.abort_request("a")
    assert final.finish_reason == "cancelled" and final.usage.completion_tokens == 1
    assert pool.num_free_blocks > free_before  # before any further step
    assert llm.abort_request("a") is None and llm.request_ids() == ["b"]
    outputs = drain(llm)
    assert list(outputs) == ["b"] and outputs["b"][-1].finish_reason == "length"


def test_stop_string_ends_the_text_and_the_request(llm: LLMEngine) -> None:
    llm.add_request(chat("full", "Say something."))
    full = text_of(drain(llm)["full"])
    cut = len(full) // 2
    stop = full[cut : cut + 3]
    cut = full.find(stop)  # the first place the stop string shows up
    assert len(stop) == 3 and 0 < cut

    llm.add_request(chat("stopped", "Say something.", SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop=(stop,))))
    outputs = drain(llm)["stopped"]
    assert text_of(outputs) == full[:cut]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].usage.completion_tokens < 12
    pool = llm.engine.kv_cache_manager.block_pool
    assert not llm.has_unfinished_requests() and pool.num_free_blocks == pool.num_usable_blocks


def test_engine_error_reaches_only_its_request(llm: LLMEngine, faulty_runner) -> None:
    engine = Engine(llm.engine.runner.model, EngineSettings(num_kv_blocks=24), 512, runner_cls=faulty_runner)
    faulty = LLMEngine(engine, llm.tokenizer)
    for request_id in ("good1", "bad", "good2"):
        faulty.add_request(chat(request_id, f"Question {request_id}"))
    outputs = drain(faulty)
    assert outputs["bad"][-1].failure.code == "engine_error" and outputs["bad"][-1].finished
    assert outputs["good1"][-1].finish_reason == outputs["good2"][-1].finish_reason == "length"


def test_smollm2_streams_whole_characters() -> None:
    llm = build_llm_engine(resolve_model("smollm2"), EngineSettings(num_kv_blocks=32), "cpu")
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write the word 'cat' in Chinese characters."}])
    request = llm.add_prompt("zh", ids, SamplingParams(max_tokens=10, temperature=0.0))
    outputs = drain(llm)["zh"]
    # Some of these tokens are lone bytes of a character: the stream must hold them back.
    assert any("\ufffd" in llm.tokenizer.decode([t]) for t in request.output_token_ids)
    streamed = [o.text for o in outputs if not o.finished]
    assert streamed and all("\ufffd" not in piece for piece in streamed)
    assert len(streamed) < request.num_output_tokens - 1  # tokens that completed no character
    # Only the final flush may show an unfinished character (as U+FFFD), as decode does.
    assert "".join(o.text for o in outputs) == llm.tokenizer.decode(request.output_token_ids)


def test_generate_command_prints_json_per_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "tiny", "--device", "cpu", "--engine.num-kv-blocks", "64", "--raw", "--json",
            "--max-tokens", "5", "--prompt", "Once upon a time", "--prompt", "The sky is"]
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["Once upon a time", "The sky is"]
    assert all(len(r["token_ids"]) == 5 and isinstance(r["text"], str) for r in records)
    assert records[0]["token_ids"] != records[1]["token_ids"]
