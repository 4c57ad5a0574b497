"""The disaggregation benchmark's prompts: short questions for the decode streams, and long raw
prompts cut to a token count by the model's own tokenizer, each opening with words of its own so
no prefix cache (the unified worker's, the decode worker's) holds any block of another's."""

from __future__ import annotations

import random

from shared.models.spec import resolve_model
from shared.models.tokenizer import Tokenizer

WORDS = (
    "harbour lantern granite orchard meadow river copper signal winter basalt tide compass "
    "ledger timber canal furnace glacier pepper thistle quarry saddle vessel willow beacon "
    "cobalt ember falcon garnet hollow island juniper kettle lumber marble nectar onyx prairie "
    "quiver raven summit tundra umber valley walnut yarrow zephyr anchor bramble cinder dune"
).split()
TOPICS = (
    "a lighthouse keeper", "a river barge", "a mountain railway", "a clockmaker's shop", "a desert caravan",
    "an orbiting station", "a coastal village", "a glass foundry", "a night market", "a polar expedition",
)  # fmt: skip


def tokenizer_of(model: str) -> Tokenizer:
    return Tokenizer.from_folder(resolve_model(model).tokenizer_folder)


def stream_question(index: int) -> str:
    """A different short question per stream: the streams share only the chat template's blocks."""
    return f"Story {index}: write a long, detailed story about {TOPICS[index % len(TOPICS)]}, chapter by chapter."


def long_prompt(tokenizer: Tokenizer, tokens: int, tag: str) -> str:
    """Text that `tokenizer` (special tokens added, as the edge counts a raw prompt) makes `tokens`
    tokens: seeded sentences, cut at the character offset where token `tokens` begins."""
    rng = random.Random(tag)
    sentences = [f"Record {tag}."]
    while sum(len(s) for s in sentences) < tokens * 8:  # a token is about four characters: room to cut
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
    text = " ".join(sentences)
    encoding = tokenizer.backend.encode(text, add_special_tokens=True)
    if len(encoding.ids) <= tokens:
        raise ValueError(f"built only {len(encoding.ids)} tokens for {tokens}")
    text = text[: encoding.offsets[tokens][0]]
    return text


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=True))
