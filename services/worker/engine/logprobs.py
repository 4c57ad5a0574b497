"""Log-probabilities of the sampled tokens, and of each row's most likely alternatives, for the rows
that ask (SamplingParams.logprobs): from the distribution the token was drawn from, after the logit
changes and the temperature (before top-k / top-p), as OpenAI documents them. One softmax and one
top-k over those rows only, read on the host with the step's tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.worker.engine.host_values import on_device
from services.worker.engine.sampling_params import SamplingParams

# What OpenAI reports for a token the distribution rules out; JSON has no -inf.
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


@dataclass
class Sampled:
    """What one step drew: a token per sampled request, and the logprobs of those that asked."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)

    def update(self, other: Sampled) -> None:
        self.tokens.update(other.tokens)
        self.logprobs.update(other.logprobs)


@dataclass
class PendingLogprobs:
    """The logprobs a step's rows asked for, as tensors where the logits are: read with the step's
    tokens (model_runner.PendingStep), so that computing them does not wait for the device."""

    request_ids: list[str]  # (R,)
    wants: list[int]  # (R,) alternatives each row asked for
    chosen: torch.Tensor  # (R,) the tokens drawn
    chosen_logp: torch.Tensor  # (R,)
    top_ids: torch.Tensor  # (R, k), k the most any row asked for
    top_logp: torch.Tensor  # (R, k)

    def read(self) -> dict[str, TokenLogprobs]:
        chosen, chosen_logp = self.chosen.tolist(), self.chosen_logp.tolist()
        top_ids, top_logp = self.top_ids.tolist(), self.top_logp.tolist()
        result = {}
        for j, (request_id, want) in enumerate(zip(self.request_ids, self.wants, strict=True)):
            top = tuple(zip(top_ids[j][:want], top_logp[j][:want], strict=True))
            result[request_id] = TokenLogprobs(chosen[j], chosen_logp[j], top)
        return result


def token_logprobs(
    logits: torch.Tensor,  # (S, V) as sampled from
    params: Sequence[SamplingParams],  # (S,)
    tokens: torch.Tensor,  # (S,) the tokens drawn
    request_ids: Sequence[str],  # (S,)
) -> PendingLogprobs | None:  # None: no row asked
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    device = logits.device
    index = on_device(rows, torch.int64, device)
    temperature = on_device([params[i].temperature or 1.0 for i in rows], torch.float32, device)
    scaled = logits[index].float() / temperature[:, None]  # (R, V)
    # log p = x - logsumexp(x), read only where needed: no (R, V) matrix of log-probabilities.
    norm = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (R, 1)
    chosen = tokens[index].to(device)
    chosen_logp = (scaled.gather(1, chosen[:, None]) - norm).squeeze(1).clamp(min=FLOOR)  # (R,)
    wants = [params[i].logprobs or 0 for i in rows]
    k = max(wants)
    top_x, top_ids = scaled.topk(k, dim=-1) if k else (scaled[:, :0], scaled[:, :0].long())  # (R, k) each
    top_logp = (top_x - norm).clamp(min=FLOOR)
    return PendingLogprobs([request_ids[i] for i in rows], wants, chosen, chosen_logp, top_ids, top_logp)
