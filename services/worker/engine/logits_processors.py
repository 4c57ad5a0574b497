"""What a request asks of its logits before a token is drawn, applied to the whole batch at once:
logit bias, no end before `min_tokens`, and the repetition, frequency and presence penalties
(as OpenAI and vLLM define them). Rows that ask for none of it are not touched."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

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
) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    _add_bias(logits, [(i, params[i]) for i in rows if params[i].logit_bias])
    too_early = [(i, params[i]) for i in rows if positions[i] - prompt_lens[i] < params[i].min_tokens]
    _mask_ends(logits, too_early, eos_token_ids)
    penalised = [i for i in rows if params[i].penalised]
    if penalised:
        _penalise(logits, penalised, params, histories, prompt_lens)
    return logits


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
) -> None:
    """Sparse: only the (row, token) pairs a row has seen are read and written, so the cost is
    the batch's tokens so far, not rows × vocabulary."""
    device, vocab = logits.device, logits.shape[1]
    repeating = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repeating:
        row, token = _unique_pairs(repeating, [histories[i] for i in repeating], vocab, device)  # prompt and output
        penalty = torch.tensor([params[i].repetition_penalty for i in range(len(params))], device=device)[row]
        seen = logits[row, token]
        logits[row, token] = torch.where(seen > 0, seen / penalty, seen * penalty)
    outputs = [histories[i][prompt_lens[i] :] for i in rows]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
    presence = torch.tensor([p.presence_penalty for p in params], device=device)
    row, token = _pairs(rows, outputs, device)  # every output token, repeats included
    if row.numel():
        logits.index_put_((row, token), -frequency[row], accumulate=True)  # frequency × count
        row, token = _unique_pairs(rows, outputs, vocab, device)
        logits[row, token] -= presence[row]


def _pairs(rows: list[int], sequences: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) for every token of every row's sequence: one tensor each for the batch."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    tokens = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    return row.to(device), tokens.to(device)


def _unique_pairs(
    rows: list[int], sequences: list[Sequence[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    row, token = _pairs(rows, sequences, device)
    flat = torch.unique(row * vocab + token)
    return flat // vocab, flat % vocab
