"""What a request asks of its logits before a token is drawn, applied to the whole batch at once:
logit bias, no end before `min_tokens`, and the repetition, frequency and presence penalties
(as OpenAI and vLLM define them). Rows that ask for none of it are not touched."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from services.worker.engine.sampling_params import SamplingParams


def process_logits(
    logits: torch.Tensor,  # (S, V) float32, changed in place
    params: Sequence[SamplingParams],  # (S,)
    histories: Sequence[Sequence[int]],  # (S,) each row's tokens so far: prompt, then output
    prompt_lens: Sequence[int],  # (S,)
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    _add_bias(logits, [(i, params[i]) for i in rows if params[i].logit_bias])
    too_early = [(i, params[i]) for i in rows if len(histories[i]) - prompt_lens[i] < params[i].min_tokens]
    _mask_ends(logits, too_early, eos_token_ids)
    penalised = [i for i in rows if params[i].penalised]
    if penalised:
        _penalise(logits, penalised, params, histories, prompt_lens)
    return logits


def _add_bias(logits: torch.Tensor, rows: list[tuple[int, SamplingParams]]) -> None:
    vocab = logits.shape[1]
    entries = [(row, token, bias) for row, p in rows for token, bias in p.logit_bias if token < vocab]
    if entries:
        row, token, bias = (torch.tensor(column, device=logits.device) for column in zip(*entries))
        logits.index_put_((row, token), bias.to(logits.dtype), accumulate=True)


def _mask_ends(logits: torch.Tensor, rows: list[tuple[int, SamplingParams]], eos_token_ids: frozenset[int]) -> None:
    vocab = logits.shape[1]
    entries = [
        (row, token)
        for row, p in rows
        for token in {*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)}
        if token < vocab
    ]
    if entries:
        row, token = (torch.tensor(column, device=logits.device) for column in zip(*entries))
        logits[row, token] = float("-inf")


def _penalise(
    logits: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
) -> None:
    device, vocab = logits.device, logits.shape[1]
    index = torch.tensor(rows, device=device)
    counts = _token_counts([histories[i][prompt_lens[i] :] for i in rows], vocab, device)  # (R, V) output only
    sub = logits[index]  # (R, V)
    repetition = torch.tensor([params[i].repetition_penalty for i in rows], device=device)[:, None]
    if bool((repetition != 1.0).any()):
        seen = _token_counts([histories[i] for i in rows], vocab, device) > 0  # prompt and output
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=device)[:, None]
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=device)[:, None]
    sub = sub - frequency * counts - presence * (counts > 0)
    logits[index] = sub


def _token_counts(sequences: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(R, V) how often each token occurs in each sequence: one scatter for the whole batch."""
    counts = torch.zeros(len(sequences), vocab, device=device)
    lengths = torch.tensor([len(s) for s in sequences])
    if int(lengths.sum()) == 0:
        return counts
    tokens = torch.tensor(list(itertools.chain.from_iterable(sequences)), device=device)
    row = torch.repeat_interleave(torch.arange(len(sequences)), lengths).to(device)
    counts.index_put_((row, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
    return counts
