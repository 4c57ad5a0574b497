"""Tokenizer: the same ids and chat prompts as Hugging Face's tokenizer on the same folder."""

import json
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from shared.models.smollm2 import smollm2_folder
from shared.models.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Japan?"},
        {"role": "assistant", "content": "Tokyo"},
        {"role": "user", "content": "And of Italy? 🇮🇹 «bitte»"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_folder(smollm2_folder())


@pytest.fixture(scope="module")
def theirs():
    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, theirs, messages, add_generation_prompt: bool) -> None:
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.render_chat(messages, add_generation_prompt) == text
    expected = theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_default_system_prompt_only_without_a_system_message(ours: Tokenizer) -> None:
    assert "named SmolLM, trained by Hugging Face" in ours.render_chat(CONVERSATIONS[0])
    assert "SmolLM" not in ours.render_chat(CONVERSATIONS[1])


@pytest.mark.parametrize("text", ["Hello 12345 world!", "  spaced\tout\n\nlines  ", "naïve 😀 日本語", "<|im_start|>user"])
def test_encode_decode_match_transformers(ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_specials_and_vocabulary(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert ours.eos_token_ids == (2,)
    assert ours.encode("<|im_end|>") == [2]
    assert ours.decode([ours.encode("Hi")[0], 2]) == "Hi"


def test_unknown_ids_decode_to_replacement_char(ours: Tokenizer) -> None:
    hi = ours.encode("Hi")
    assert ours.decode(hi + [60000, 128255] + hi) == "Hi\ufffd\ufffdHi"


def _folder_with_template(tmp_path: Path, template: str, as_file: bool) -> Path:
    source = smollm2_folder()
    (tmp_path / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text())
    if as_file:
        (tmp_path / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_template_sees_special_tokens_and_can_raise(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}"
    )
    tok = Tokenizer.from_folder(_folder_with_template(tmp_path, template, as_file=True))
    assert tok.render_chat([{"role": "user", "content": "é<b>"}]) == '<|im_start|>"é<b>"<|im_end|>'
    with pytest.raises(jinja2.TemplateError, match="no tools here"):
        tok.render_chat([{"role": "tool", "content": "x"}])


def test_template_whitespace_control_like_transformers(tmp_path: Path) -> None:
    template = "{% for m in messages %}\n    {% if m['role'] == 'user' %}\n[{{ m['content'] }}]\n    {% endif %}\n{% endfor %}"
    folder = _folder_with_template(tmp_path, template, as_file=False)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    expected = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, tokenize=False)
    assert Tokenizer.from_folder(folder).render_chat(messages) == expected == "[a]\n[b]\n"


def test_no_template_is_a_clear_error(tmp_path: Path) -> None:
    folder = _folder_with_template(tmp_path, "", as_file=False)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_folder(folder).render_chat(CONVERSATIONS[0])
