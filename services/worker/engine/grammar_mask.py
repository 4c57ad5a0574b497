"""A batch's grammar masks applied to its logits in one step: rows with a grammar keep only the tokens
their grammar allows next; the other rows are not touched. On the CPU, float32 logits take the C++
kernel (kernels/cpu_token_bitmask.py) where it is built; elsewhere, tensor operations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_token_bitmask

# What adding to a logit does for each value of one mask byte: 0 keeps the 8 tokens it allows,
# -inf removes the others. One table lookup per byte spares a pass per bit and a masked fill.
_PER_BYTE = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))  # (256, 8)


def apply_token_bitmask(
    logits: torch.Tensor,  # (S, V) float, changed in place
    rows: torch.Tensor,  # (R,) int64: the rows that have a grammar
    bitmask: torch.Tensor,  # (R, ceil(V / 32)) int32: bit j of word w allows token 32 * w + j
) -> torch.Tensor:
    if cpu_token_bitmask.serves(logits):
        cpu_token_bitmask.apply_token_bitmask(logits, rows.long().contiguous(), bitmask.contiguous())
        return logits
    vocab = logits.shape[1]
    table = _PER_BYTE.to(logits.device, logits.dtype)
    # Little-endian words: byte b of the flat mask holds tokens 8b .. 8b+7, lowest bit first.
    mask_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).long()
    penalty = table.index_select(0, mask_bytes).view(bitmask.shape[0], -1)  # (R, 32 W)
    if penalty.shape[1] < vocab:  # a mask narrower than the logits allows nothing past its end
        penalty = F.pad(penalty, (0, vocab - penalty.shape[1]), value=float("-inf"))
    logits.index_add_(0, rows.to(logits.device), penalty[:, :vocab])
    return logits
