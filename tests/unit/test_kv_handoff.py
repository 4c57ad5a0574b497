"""A request prefilled on one engine and decoded on another produces exactly what one engine
alone does, moves exactly its prompt's blocks (fewer when the receiver's prefix cache holds some),
and leaves no block held on either side, whether the handoff lands, fails or is taken back."""

from __future__ import annotations

import dataclasses

import pytest

from services.worker.engine.engine import Engine
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import (
    EngineOutput,
    EngineRequest,
    HandoffReady,
    Message,
)
from services.worker.engine.weights import load_model
from shared.models.spec import resolve_model

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
SETTINGS = EngineSettings(num_kv_blocks=64, block_size=8)
PROMPT = "Tell me a long story about the sea, the wind and a lighthouse keeper who never slept."


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return load_model(resolve_model("tiny"), "cpu")[1]


@pytest.fixture
def make_engine(tiny, tokenizer):
    def make() -> LLMEngine:
        return LLMEngine(Engine(tiny, SETTINGS, max_model_len=512, eos_token_ids=()), tokenizer)

    return make


def chat(request_id: str, text: str = PROMPT, sampling: SamplingParams = GREEDY) -> EngineRequest:
    return EngineRequest(request_id, "tenant-a", [Message("user", text)], sampling)


def drain(llm: LLMEngine) -> list[EngineOutput]:
    outputs = []
    for _ in range(500):
        if not llm.has_unfinished_requests():
            return outputs
        outputs.extend(llm.step())
    raise AssertionError("the engine did not finish")


def prefill(sender: LLMEngine, request: EngineRequest) -> tuple[EngineOutput, HandoffReady]:
    sender.add_request(dataclasses.replace(request, handoff=True))
    outputs = drain(sender)
    assert len(outputs) == 1 and not outputs[0].finished
    assert outputs[0].handoff is not None and sender.load().running == 0
    return outputs[0], outputs[0].handoff


def move(sender: LLMEngine, receiver: LLMEngine, request: EngineRequest, ready: HandoffReady) -> int:
    """The KV of `ready` from sender to receiver, layer by layer; the bytes moved."""
    have = receiver.reserve_import(request, list(ready.prompt_token_ids), list(ready.output_token_ids))
    assert have is not None
    moved = 0
    for layer in range(ready.layout.num_layers):
        k, v = sender.read_kv_layer(request.request_id, layer, have)
        receiver.write_kv_layer(request.request_id, layer, k, v)
        moved += len(k) + len(v)
    receiver.commit_import(request.request_id, ready.cached_tokens)
    sender.release_handoff(request.request_id)
    return moved


def kv_bytes(ready: HandoffReady, num_blocks: int) -> int:
    return num_blocks * ready.layout.num_layers * 2 * ready.layout.block_bytes


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_a_handed_off_request_produces_what_one_engine_alone_does(make_engine, sampling: SamplingParams) -> None:
    unified, sender, receiver = make_engine(), make_engine(), make_engine()
    free = {name: e.load().free_kv_blocks for name, e in [("sender", sender), ("receiver", receiver)]}
    unified.add_request(chat("a", sampling=sampling))
    alone = drain(unified)

    first, ready = prefill(sender, chat("a", sampling=sampling))
    moved = move(sender, receiver, chat("a", sampling=sampling), ready)
    rest = drain(receiver)

    assert first.text + "".join(o.text for o in rest) == "".join(o.text for o in alone)
    assert rest[-1].usage == alone[-1].usage and rest[-1].finish_reason == alone[-1].finish_reason
    assert moved == kv_bytes(ready, cdiv(len(ready.prompt_token_ids), SETTINGS.block_size)) > 0
    assert sender.load().free_kv_blocks == free["sender"] and receiver.load().free_kv_blocks == free["receiver"]
    assert sender.request_ids() == [] and receiver.request_ids() == []


def test_a_prefix_the_receiver_holds_is_not_moved_again_and_serves_its_cache(make_engine) -> None:
    unified, sender, receiver = make_engine(), make_engine(), make_engine()
    unified.add_request(chat("a"))
    alone = "".join(o.text for o in drain(unified))
    receiver.add_request(chat("warm"))  # the receiver computed this prompt before: its full blocks are cached
    drain(receiver)

    first, ready = prefill(sender, chat("a"))
    moved = move(sender, receiver, chat("a"), ready)
    assert first.text + "".join(o.text for o in drain(receiver)) == alone
    num_blocks = cdiv(len(ready.prompt_token_ids), SETTINGS.block_size)
    num_full = len(ready.prompt_token_ids) // SETTINGS.block_size
    assert moved == kv_bytes(ready, num_blocks - num_full)

    # The blocks it received entered its prefix cache: the same prompt again is served from it.
    receiver.add_request(chat("again"))
    again = drain(receiver)
    assert again[-1].usage.cached_tokens == (len(ready.prompt_token_ids) - 1) // SETTINGS.block_size * SETTINGS.block_size


def test_a_failed_or_cancelled_handoff_frees_every_block(make_engine) -> None:
    sender, receiver = make_engine(), make_engine()
    free_sender, free_receiver = sender.load().free_kv_blocks, receiver.load().free_kv_blocks
    _, ready = prefill(sender, chat("a"))
    assert sender.load().free_kv_blocks < free_sender
    assert receiver.reserve_import(chat("a"), list(ready.prompt_token_ids), list(ready.output_token_ids)) == 0
    k, v = sender.read_kv_layer("a", 0, 0)
    receiver.write_kv_layer("a", 0, k, v)  # the transfer breaks after one layer
    receiver.cancel_import("a")
    assert receiver.load().free_kv_blocks == free_receiver and receiver.request_ids() == []

    cancelled = sender.abort_request("a")  # the client went away while it was parked
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    assert sender.load().free_kv_blocks == free_sender and sender.request_ids() == []


def test_a_parked_request_taken_back_decodes_where_it_was_prefilled(make_engine) -> None:
    unified, sender = make_engine(), make_engine()
    unified.add_request(chat("a", sampling=SAMPLED))
    alone = "".join(o.text for o in drain(unified))
    first, _ = prefill(sender, chat("a", sampling=SAMPLED))
    assert sender.resume_handoff("a")
    assert first.text + "".join(o.text for o in drain(sender)) == alone


def test_a_receiver_refuses_blocks_it_cannot_hold_and_layers_of_the_wrong_size(make_engine, tiny, tokenizer) -> None:
    sender = make_engine()
    small = LLMEngine(Engine(tiny, dataclasses.replace(SETTINGS, num_kv_blocks=4), max_model_len=512, eos_token_ids=()), tokenizer)
    _, ready = prefill(sender, chat("a", sampling=dataclasses.replace(GREEDY, max_tokens=300)))
    with pytest.raises(Exception, match="KV cache"):  # more than its whole pool: never
        small.reserve_import(chat("a"), list(ready.prompt_token_ids), list(ready.output_token_ids))

    receiver = make_engine()
    assert receiver.reserve_import(chat("a"), list(ready.prompt_token_ids), list(ready.output_token_ids)) == 0
    with pytest.raises(ValueError, match="bytes"):
        receiver.write_kv_layer("a", 0, b"\0" * 10, b"\0" * 10)
    receiver.cancel_import("a")
    sender.release_handoff("a")
    assert sender.request_ids() == [] and receiver.request_ids() == []
