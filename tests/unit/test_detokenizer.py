"""IncrementalDetokenizer over SmolLM2's byte-level BPE: split characters, stop strings, flush."""

import pytest

from services.worker.engine.detokenizer import IncrementalDetokenizer
from shared.models.smollm2 import smollm2_folder
from shared.models.tokenizer import Tokenizer

MIXED = "Grüße 😀👍🏽 日本語のテキスト — naïve café ✓ and 中文 too.\nNext line: 🎉"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(smollm2_folder())


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_split_characters_are_never_emitted_broken(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MIXED)
    # The premise: some single tokens hold only part of a character.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    pieces = stream(IncrementalDetokenizer(tokenizer), ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == MIXED
    assert pieces[-1] == ""  # everything was complete before the end


def test_each_push_decodes_a_short_window(tokenizer: Tokenizer) -> None:
    text = "word " * 400 + MIXED
    detok = IncrementalDetokenizer(tokenizer)
    widest = 0
    out = []
    for i in tokenizer.encode(text):
        out.append(detok.push(i))
        widest = max(widest, len(detok.token_ids) - detok.prefix_offset)
    assert "".join(out) + detok.flush() == text
    assert widest <= 8  # not the whole history


def test_unfinished_character_comes_out_at_flush(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer)
    head = "".join(detok.push(i) for i in ids[:-1])  # the emoji's last byte never arrives
    assert head == "ok"
    assert detok.flush().startswith(" \ufffd")


def test_stop_string_cuts_the_text(tokenizer: Tokenizer) -> None:
    text = "The answer is 42. STOP here and never more."
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    pieces = stream(detok, tokenizer.encode(text))
    assert "".join(pieces) == "The answer is 42. "
    assert detok.stopped and detok.stop_string == "STOP"
    assert detok.push(tokenizer.encode(" more")[0]) == ""  # nothing after the stop


def test_stop_string_split_across_tokens(tokenizer: Tokenizer) -> None:
    text = "alpha beta<|end|> gamma"
    ids = tokenizer.encode(text)
    stop = "a<|e"  # begins inside "beta" and ends inside the next tokens
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, stop=(stop,))
    pieces = stream(detok, ids)
    assert "".join(pieces) == "alpha bet"
    assert detok.stopped


def test_possible_stop_prefix_is_held_then_released(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("\n\nUser:",))
    emitted = [detok.push(i) for i in tokenizer.encode("Hi.\n\nUsers like it")]
    assert not detok.stopped
    assert "".join(emitted) + detok.flush() == "Hi.\n\nUsers like it"
    # While "\n\nUser" was a possible stop, none of it came out.
    partial = IncrementalDetokenizer(tokenizer, stop=("\n\nUser:",))
    assert "".join(partial.push(i) for i in tokenizer.encode("Hi.\n\nUser")) == "Hi."


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("world", "lo"))
    assert "".join(stream(detok, tokenizer.encode("hello world"))) == "hel"
    assert detok.stop_string == "lo"


def test_special_and_out_of_vocabulary_ids(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("Hi") + [eos, 100_000] + tokenizer.encode(" there")
    pieces = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(pieces) == "Hi\ufffd there"  # the special token is skipped, the unknown id is U+FFFD
