"""What a prompt chunk costs its step, in tokens of a fresh prompt's work.

A step's token budget bounds how long the step takes, and so how long every decoding stream in it
waits for its next token. Counting a chunk by its tokens holds only while the chunk's attention is
small beside its projections: each of its tokens also attends to every position before it, so a long
prompt's late chunks cost more than its first. SmolLM2 on a CPU, a 4,000-token prompt in chunks of
496 beside 16 decodes: 0.68 s for the first chunk's step, 1.46 s for the last.

In multiply-adds a layer, a prompt token's projections cost the layer's weights and each position it
attends to costs 2 x the query width (its scores and its weighted sum of values), so a chunk of c
tokens after p cached ones costs its projections times 1 + (p + c/2) / K, where K, the model's
`attention_parity`, is the context at which the two are equal (SmolLM2: 3,072; llama-8b: ~26,600).
"""

from __future__ import annotations

import math

from shared.models.shapes import ModelConfig

ROUNDING = 1e-6  # float error allowed in the square roots: a fresh chunk takes its whole budget, no more


def attention_parity(config: ModelConfig) -> int:
    """Positions attended to that cost a prompt token as much as its projections do."""
    hidden, head_dim = config.hidden_size, config.head_dim
    projections = hidden * head_dim * (2 * config.num_heads + 2 * config.num_kv_heads) + 3 * hidden * config.intermediate_size
    return max(1, round(projections / (2 * config.num_heads * head_dim)))


def work(tokens: int, start: int, parity: int) -> float:
    """A chunk of `tokens` prompt tokens after `start` cached ones, in units of one token's projections."""
    return tokens * (1 + (start + tokens / 2) / parity)


def fresh_tokens(amount: float, parity: int) -> float:
    """The tokens of a prompt's first chunk that take this much work (the inverse of work(t, 0))."""
    return parity * (math.sqrt(1 + 2 * amount / parity) - 1)


def largest_chunk(remaining: int, start: int, budget: int, parity: int) -> tuple[int, int]:
    """(tokens, charge): the most of `remaining` prompt tokens after `start` cached ones that take no more
    work than `budget` tokens of a fresh prompt, at least one, and the budget they use."""
    most = min(remaining, budget)
    base = 1 + start / parity
    allowed = parity * (math.sqrt(base * base + 2 * work(budget, 0, parity) / parity) - base)
    tokens = max(1, min(most, math.floor(allowed + ROUNDING)))
    return tokens, min(budget, max(tokens, math.ceil(fresh_tokens(work(tokens, start, parity), parity) - ROUNDING)))
