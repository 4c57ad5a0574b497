"""Greedy agreement: do two engines on the same weights and dtype produce the same first tokens?
Each prompt runs alone (no padding, no batch) so only the arithmetic can part them."""

from __future__ import annotations

from peers_workloads import Peer


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(engine: Peer, reference: Peer, prompts: list[list[int]], new_tokens: int) -> dict:
    matches = [
        matching_prefix(engine.run([p], new_tokens).tokens[0], reference.run([p], new_tokens).tokens[0])
        for p in prompts
    ]
    return {
        "engine": engine.name, "reference": reference.name, "new_tokens": new_tokens,
        "matching_tokens_per_prompt": matches, "all_equal": all(m == new_tokens for m in matches),
    }
