"""A batch's grammar masks applied to its logits in one step: rows with a grammar keep only the tokens
their grammar allows next; the other rows are not touched."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(
    logits: torch.Tensor,  # (S, V), changed in place
    rows: torch.Tensor,  # (R,) int64: the rows that have a grammar
    bitmask: torch.Tensor,  # (R, ceil(V / 32)) int32: bit j of word w allows token 32 * w + j
) -> torch.Tensor:
    vocab = logits.shape[1]
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]  # (R, V)
    if allowed.shape[1] < vocab:  # a mask narrower than the logits allows nothing past its end
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
