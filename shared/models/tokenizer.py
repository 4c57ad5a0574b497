"""Text <-> token ids for a Hugging Face folder (tokenizer.json), and its chat template rendered
with jinja2 the way Hugging Face renders it, so prompts match what the model was trained on."""

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPLACEMENT_CHAR = "\ufffd"


class ChatTurn(Protocol):
    """One message of a conversation, whatever type carries it (a protocol frame, an engine request)."""

    role: str
    content: str


def template_messages(turns: Iterable[ChatTurn]) -> list[dict[str, str]]:
    """Messages as chat templates read them: the dicts Hugging Face's `apply_chat_template` takes."""
    return [{"role": turn.role, "content": turn.content} for turn in turns]


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str],
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens  # bos_token, eos_token, ...: what templates may reference
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, config.json and
        generation_config.json where present, for the template and the end-of-sequence ids)."""
        folder = Path(folder)
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok_config = _read_json(folder / "tokenizer_config.json")
        special = {
            key: _token_content(tok_config[key])
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if tok_config.get(key) is not None
        }
        template = _pick_template(tok_config.get("chat_template"))
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        eos_ids: list[int] = []
        if "eos_token" in special and backend.token_to_id(special["eos_token"]) is not None:
            eos_ids.append(backend.token_to_id(special["eos_token"]))
        for extra in ("generation_config.json", "config.json"):
            eos = _read_json(folder / extra).get("eos_token_id")
            eos_ids.extend(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(backend, template, special, tuple(dict.fromkeys(eos_ids)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of text; add_special_tokens applies the tokenizer's own post-processor (BOS for Llama 3)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; an id the vocabulary does not have (a random model's) becomes U+FFFD."""
        if all(0 <= i < self.vocab_size for i in ids):
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if 0 <= i < self.vocab_size:
                run.append(i)
                continue
            if run:
                parts.append(self.backend.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            parts.append(REPLACEMENT_CHAR)
        if run:
            parts.append(self.backend.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(parts)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text the chat template makes of messages (and of tools, for a template that lists them)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=None,
            **self.special_tokens,
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        # The template writes any BOS itself: adding special tokens again would double it.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _token_content(token: str | dict[str, Any]) -> str:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    return token["content"] if isinstance(token, dict) else token


def _pick_template(template: str | list[dict[str, str]] | None) -> str | None:
    # Some folders carry several named templates; the one named "default" is the chat template.
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used to mark assistant text for
    training masks) and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    # Templates come with model folders: run them sandboxed, with the same environment HF uses.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
