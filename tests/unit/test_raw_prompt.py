"""A raw prompt (text or token ids, no chat template) from the wire to the engines, and as the edge counts it."""

from __future__ import annotations

import msgpack
import pytest

from services.edge.protocol import ProtocolError, parse_client_frame
from services.worker.convert import engine_request
from services.worker.echo import EchoEngine
from services.worker.engine.prompt_ids import prompt_token_ids
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.types import EngineRequest, Message, RequestRejected
from shared import wire
from shared.models.echo import count_prompt_pieces
from shared.models.prompt_length import prompt_limit, prompt_tokens
from shared.models.raw_prompt import RawPrompt
from shared.models.smollm2 import smollm2_folder
from shared.models.spec import resolve_model
from shared.models.tokenizer import Tokenizer

SAMPLING = SamplingParams(max_tokens=8)


def test_a_raw_prompt_is_text_or_ids_never_both():
    assert RawPrompt.of("hi") == RawPrompt(text="hi") and RawPrompt.of([1, 2]) == RawPrompt(token_ids=(1, 2))
    for wrong in ({}, {"text": "a", "token_ids": (1,)}):
        with pytest.raises(ValueError):
            RawPrompt(**wrong)


def test_the_wire_carries_a_raw_prompt_and_still_reads_old_records():
    for prompt in ("Once upon", [5, 7]):
        request = wire.ChatRequest("r", "e", "c", "t", [], prompt=prompt)
        assert wire.decode(wire.encode(request), wire.ChatRequest).prompt == prompt
    old = {"type": "chat", "request_id": "r", "edge_id": "e", "conn_id": "c", "tenant": "t", "v": 1,
           "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    decoded = wire.decode(msgpack.packb(old), wire.ChatRequest)
    assert decoded.prompt is None and decoded.messages[0].content == "hi"
    for bad in ({**old, "prompt": "x"}, {**old, "messages": [], "prompt": ""}, {**old, "messages": [], "prompt": []}):
        with pytest.raises(wire.WireError):  # both, or an empty prompt: dead-lettered, never run
            wire.decode(msgpack.packb(bad), wire.ChatRequest)


def test_the_worker_hands_the_engine_the_raw_prompt():
    assert engine_request(wire.ChatRequest("r", "e", "c", "t", [], prompt=[3, 4])).prompt == RawPrompt(token_ids=(3, 4))
    assert engine_request(wire.ChatRequest("r", "e", "c", "t", [], prompt="go")).prompt == RawPrompt(text="go")
    chat = engine_request(wire.ChatRequest("r", "e", "c", "t", [wire.Message("user", "hi")]))
    assert chat.prompt is None and chat.messages[0].content == "hi"


@pytest.mark.parametrize(
    ("prompt", "pieces"), [(RawPrompt(text="one two three"), ["one ", "two ", "three"]), (RawPrompt(token_ids=(5, 7)), ["5 ", "7"])]
)  # fmt: skip
def test_the_echo_model_echoes_a_raw_prompt_and_counts_it_as_the_edge_does(prompt, pieces):
    engine = EchoEngine()
    engine.add_request(EngineRequest("r1", "t", (), SAMPLING, prompt=prompt))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [o.text for o in outputs] == pieces
    assert outputs[-1].usage.prompt_tokens == len(pieces) == count_prompt_pieces(prompt)
    assert prompt_limit(resolve_model("echo")).measure(prompt) == (len(pieces), None)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(smollm2_folder())


def test_the_engine_prompt_skips_the_template_and_matches_the_edge_count(tokenizer):
    text = "The capital of France is"
    raw = EngineRequest("r", "t", (), SAMPLING, prompt=RawPrompt(text=text))
    assert prompt_token_ids(tokenizer, raw, tokenizer.vocab_size) == tokenizer.encode(text)
    ids = EngineRequest("r", "t", (), SAMPLING, prompt=RawPrompt(token_ids=(1, 2, 3)))
    assert prompt_token_ids(tokenizer, ids, tokenizer.vocab_size) == [1, 2, 3]
    chat = EngineRequest("r", "t", (Message("user", text),), SAMPLING)
    templated = prompt_token_ids(tokenizer, chat, tokenizer.vocab_size)
    assert len(templated) > len(tokenizer.encode(text))  # the template wraps the text in role markers
    count = prompt_tokens(resolve_model("smollm2"))
    assert count(RawPrompt(text=text)) == tokenizer.encode(text) and count(chat.messages) == templated
    assert count(RawPrompt(token_ids=(1, 2, 3))) == [1, 2, 3]


def test_token_ids_outside_the_vocabulary_are_refused_before_the_engine(tokenizer):
    request = EngineRequest("r", "t", (), SAMPLING, prompt=RawPrompt(token_ids=(1, 49152)))
    with pytest.raises(RequestRejected) as caught:
        prompt_token_ids(tokenizer, request, 49152)
    assert caught.value.failure.code == "invalid_request" and "outside the vocabulary" in caught.value.failure.message


def test_a_chat_frame_has_messages_or_a_prompt():
    frame = parse_client_frame('{"type":"chat","id":"c1","prompt":"Once upon"}')
    assert frame.messages == [] and frame.prompt_input() == RawPrompt(text="Once upon")
    assert parse_client_frame('{"type":"chat","id":"c1","prompt":[1,2]}').prompt_input() == RawPrompt(token_ids=(1, 2))
    for wrong in ('"prompt":"x","messages":[{"role":"user","content":"hi"}]', '"messages":[]', '"prompt":""', '"prompt":[]'):
        with pytest.raises(ProtocolError) as caught:
            parse_client_frame('{"type":"chat","id":"c1",' + wrong + "}")
        assert caught.value.code == "invalid_message" and caught.value.chat_id == "c1"
