"""What a request asks of its logits before a token is drawn, applied to the whole batch at once:
logit bias, no end before `min_tokens`, and the repetition, frequency and presence penalties
(as OpenAI and vLLM define them). Rows that ask for none of it are not touched.

Nothing here waits for the device: host values travel by pinned, non-blocking copies, and a token
the step before drew and the host has not read yet (an overlapped step, engine.py) is counted
where it lies, on the device. Repeated (row, token) pairs need no deduplication: a write through
them writes the same value for each repeat, and only the frequency penalty adds them up."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.engine.host_values import on_device
from services.worker.engine.sampling_params import SamplingParams


def process_logits(
    logits: torch.Tensor,  # (S, V) float32, changed in place
    params: Sequence[SamplingParams],  # (S,)
    histories: Sequence[Sequence[int]],  # (S,) each row's tokens so far: prompt, then output
    prompt_lens: Sequence[int],  # (S,)
    positions: Sequence[int],  # (S,) where each row's token lands: counts a token still on the device too
    eos_token_ids: frozenset[int],
    pending: PendingTokens | None = None,  # the rows whose last token is missing from their history
) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    _add_bias(logits, [(i, params[i]) for i in rows if params[i].logit_bias])
    too_early = [(i, params[i]) for i in rows if positions[i] - prompt_lens[i] < params[i].min_tokens]
    _mask_ends(logits, too_early, eos_token_ids)
    penalised = [i for i in rows if params[i].penalised]
    if penalised:
        _penalise(logits, penalised, params, histories, prompt_lens, pending)
    return logits


@dataclass(frozen=True)
class PendingTokens:
    """Rows whose latest token is not in their history yet: the step before drew it and it is still
    on the device, where this step reads it as its input."""

    rows: Sequence[int]  # (P,) sampled rows
    tokens: torch.Tensor  # (P,) int64 on the logits' device

    def of_sampled(self, rows: Sequence[int]) -> PendingTokens | None:
        """Those of the sampled rows `rows`, numbered as their order there; None where none is."""
        position = {row: i for i, row in enumerate(rows)}
        kept = [j for j, row in enumerate(self.rows) if row in position]
        if not kept:
            return None
        index = on_device(kept, torch.int64, self.tokens.device)
        return PendingTokens([position[self.rows[j]] for j in kept], self.tokens.index_select(0, index))


def _add_bias(logits: torch.Tensor, rows: list[tuple[int, SamplingParams]]) -> None:
    vocab = logits.shape[1]
    entries = [(row, token, bias) for row, p in rows for token, bias in p.logit_bias if token < vocab]
    if entries:
        rows, tokens, biases = (list(column) for column in zip(*entries))
        device = logits.device
        row, token = on_device(rows, torch.int64, device), on_device(tokens, torch.int64, device)
        logits.index_put_((row, token), on_device(biases, logits.dtype, device), accumulate=True)


def _mask_ends(logits: torch.Tensor, rows: list[tuple[int, SamplingParams]], eos_token_ids: frozenset[int]) -> None:
    vocab = logits.shape[1]
    entries = [
        (row, token)
        for row, p in rows
        for token in {*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)}
        if token < vocab
    ]
    if entries:
        rows, tokens = (list(column) for column in zip(*entries))
        device = logits.device
        logits[on_device(rows, torch.int64, device), on_device(tokens, torch.int64, device)] = float("-inf")


def _penalise(
    logits: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    pending: PendingTokens | None,
) -> None:
    """Sparse: only the (row, token) pairs a row has seen are read and written, so the cost is
    the batch's tokens so far, not rows × vocabulary."""
    device = logits.device
    repeating = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repeating:
        row, token = _pairs(repeating, [histories[i] for i in repeating], pending, device)  # prompt and output
        penalty = on_device([p.repetition_penalty for p in params], logits.dtype, device)[row]
        seen = logits[row, token]
        logits[row, token] = torch.where(seen > 0, seen / penalty, seen * penalty)
    row, token = _pairs(rows, [histories[i][prompt_lens[i] :] for i in rows], pending, device)  # output
    if row.numel():
        frequency = on_device([p.frequency_penalty for p in params], logits.dtype, device)
        presence = on_device([p.presence_penalty for p in params], logits.dtype, device)
        logits.index_put_((row, token), -frequency[row], accumulate=True)  # frequency × count
        logits[row, token] -= presence[row]  # once per token seen, however often


def _pairs(
    rows: list[int], sequences: list[Sequence[int]], pending: PendingTokens | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) on the device for every token of every row's sequence, then for each of the
    rows' pending tokens."""
    row = on_device(np.repeat(rows, [len(s) for s in sequences]), torch.int64, device)
    token = on_device(list(itertools.chain.from_iterable(sequences)), torch.int64, device)
    wanted = set(rows)
    late = [j for j, r in enumerate(pending.rows) if r in wanted] if pending is not None else []
    if not late:
        return row, token
    late_row = on_device([pending.rows[j] for j in late], torch.int64, device)
    late_token = pending.tokens.index_select(0, on_device(late, torch.int64, device))
    return torch.cat([row, late_row]), torch.cat([token, late_token])
