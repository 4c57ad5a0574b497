"""The simulated fleet's cost model: how long one engine step takes, and one KV handoff.

A step's time is additive, as the engine spends it: a fixed cost per step (the weights read
once), a cost per decoding sequence, a cost per prompt token computed in the step, and a cost
per context token the decodes read from the KV cache. In a unified worker a prompt chunk and
the decodes share one step, so every decode in that step waits for the chunk: that is the
interference that disaggregation removes, and it is all this model needs to show it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepModel:
    fixed_s: float  # a: every step, whatever it holds
    per_seq_s: float  # c: each decoding sequence in the step
    prefill_token_s: float  # p: each prompt token computed in the step
    kv_read_token_s: float  # each context token the step's decodes read
    kv_bytes_per_token: int
    link_bytes_s: float  # prefill -> decode worker, one transfer at a time per sender
    token_budget: int  # tokens one step may schedule: decodes first, then prompt chunks
    max_num_seqs: int  # requests running on one worker at once
    kv_capacity_tokens: int  # KV cache of one worker, in tokens (reserved as prompt + output)

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.prefill_token_s, self.link_bytes_s) <= 0 or self.per_seq_s < 0:
            raise ValueError(f"step model needs positive costs: {self}")
        if self.max_num_seqs > self.token_budget:
            raise ValueError("max_num_seqs above the token budget: decodes alone could overrun a step")

    def step_s(self, num_decodes: int, prefill_tokens: int, context_tokens: int) -> float:
        return (
            self.fixed_s
            + self.per_seq_s * num_decodes
            + self.prefill_token_s * prefill_tokens
            + self.kv_read_token_s * context_tokens
        )

    def decode_step_s(self, batch: int, context_per_seq: float = 0.0) -> float:
        """A decode-only step: t(b) = a + c*b, plus the KV it reads."""
        return self.step_s(batch, 0, int(batch * context_per_seq))

    def prefill_s(self, prompt_tokens: int) -> float:
        """One prompt alone on an idle worker: ceil(P / budget) steps of chunks."""
        steps = math.ceil(prompt_tokens / self.token_budget)
        return steps * self.fixed_s + self.prefill_token_s * prompt_tokens

    def transfer_s(self, prompt_tokens: int) -> float:
        """The prompt's KV cache over the link, prefill worker to decode worker."""
        return prompt_tokens * self.kv_bytes_per_token / self.link_bytes_s

    def as_dict(self) -> dict:
        return asdict(self)
