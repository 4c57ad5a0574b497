"""The peer benchmark's workloads (what every engine is asked to do, as token ids) and the one
primitive every engine implements: N greedy streams arriving together, fixed output length."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from shared.models.tokenizer import Tokenizer

SUBJECTS = (
    "the sea", "a lighthouse", "autumn leaves", "a city at night", "bread", "a violin", "rain on a roof",
    "the moon", "a mountain trail", "coffee", "an old library", "snow", "a train journey", "bees", "a garden",
    "the desert",
)
TASKS = (
    "Write a short poem about {}.", "Describe {} in three sentences.", "Give me two facts about {}.",
    "Tell a very short story about {}.",
)
LONG_TASK = "Summarise the following notes in one paragraph."
# Ends a user turn and opens the assistant's, as SmolLM2's chat template does.
ASSISTANT_TURN = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Run:
    """What one engine did for one request of a workload: wall seconds from submitting every
    prompt until the last stream's last token, seconds until the first token of any stream,
    and each stream's output ids."""

    seconds: float
    first_token_s: float
    tokens: list[list[int]]


class Peer(Protocol):
    """One engine under test: the same call for every workload."""

    name: str

    def run(self, prompts: list[list[int]], new_tokens: int) -> Run: ...


@dataclass(frozen=True)
class Workload:
    """One row of the comparison. `metric` says what is read off a Run: decode tok/s after the
    first token, the time to the first token, or useful tok/s (every stream's tokens / wall time)."""

    name: str
    streams: int
    new_tokens: int
    metric: str  # "decode_tok_s" | "ttft_s" | "useful_tok_s"
    long_prompt_tokens: int = 0  # > 0: one prompt of exactly this many tokens instead of short chats

    @property
    def higher_is_better(self) -> bool:
        return self.metric != "ttft_s"


def workloads(quick: bool, concurrent_new: int = 0) -> dict[str, Workload]:
    """concurrent_new: tokens each concurrent stream generates (0: 8 quick, else 128)."""
    new = 32 if quick else 128
    concurrent_new = concurrent_new or (8 if quick else 128)
    table = [
        Workload("decode_1", 1, new, "decode_tok_s"),
        Workload("ttft_1", 1, 1, "ttft_s"),
        Workload("concurrent_16", 16, concurrent_new, "useful_tok_s"),
        Workload("concurrent_64", 64, concurrent_new, "useful_tok_s"),
        Workload("ttft_2k", 1, 1, "ttft_s", long_prompt_tokens=1000 if quick else 2000),
    ]
    return {w.name: w for w in table}


def metric(workload: Workload, run: Run) -> float:
    if workload.metric == "ttft_s":
        return run.first_token_s
    if workload.metric == "decode_tok_s":
        return (workload.new_tokens - 1) / (run.seconds - run.first_token_s)
    return sum(len(t) for t in run.tokens) / run.seconds


def chat_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    """n distinct short chat prompts (about 40 tokens each, system prompt included)."""
    texts = [task.format(subject) for task in TASKS for subject in SUBJECTS]
    return [tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(n)]


def long_prompt(tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    """A chat prompt of exactly num_tokens: notes cut to fit, then the assistant's turn."""
    notes = " ".join(
        f"Note {i}: {TASKS[i % len(TASKS)].format(SUBJECTS[i % len(SUBJECTS)])} It was filed on day {i * 7 % 31 + 1}."
        for i in range(num_tokens // 8 + 16)
    )
    head = tokenizer.apply_chat_template([{"role": "user", "content": f"{LONG_TASK}\n\n{notes}"}])
    tail = tokenizer.encode(ASSISTANT_TURN)
    if len(head) < num_tokens:
        raise ValueError(f"the notes make only {len(head)} tokens, fewer than {num_tokens}")
    return head[: num_tokens - len(tail)] + tail


def prompts_for(workload: Workload, tokenizer: Tokenizer) -> list[list[int]]:
    if workload.long_prompt_tokens:
        return [long_prompt(tokenizer, workload.long_prompt_tokens)]
    return chat_prompts(tokenizer, workload.streams)


def describe(workload: Workload, prompts: list[list[int]]) -> dict:
    lengths = [len(p) for p in prompts]
    return {**asdict(workload), "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths)}
