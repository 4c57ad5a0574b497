"""Log-probabilities of the sampled tokens, and of each row's most likely alternatives, for the rows
that ask (SamplingParams.logprobs): from the distribution the token was drawn from, after the logit
changes and the temperature (before top-k / top-p), as OpenAI documents them. One softmax and one
top-k over those rows only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

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


def token_logprobs(
    logits: torch.Tensor,  # (S, V) as sampled from
    params: Sequence[SamplingParams],  # (S,)
    tokens: torch.Tensor,  # (S,) the tokens drawn
    request_ids: Sequence[str],  # (S,)
) -> dict[str, TokenLogprobs]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return {}
    index = torch.tensor(rows, device=logits.device)
    temperature = torch.tensor([params[i].temperature or 1.0 for i in rows], device=logits.device)
    scaled = logits[index].float() / temperature[:, None]  # (R, V)
    # log p = x - logsumexp(x), read only where needed: no (R, V) matrix of log-probabilities.
    norm = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (R, 1)
    chosen = tokens[index].to(logits.device)
    chosen_logp = (scaled.gather(1, chosen[:, None]) - norm).squeeze(1).clamp(min=FLOOR).tolist()  # (R,)
    k = max(params[i].logprobs or 0 for i in rows)
    top_x, top_ids = scaled.topk(k, dim=-1) if k else (scaled[:, :0], scaled[:, :0].long())  # (R, k) each
    top_logp, top_ids, chosen = (top_x - norm).clamp(min=FLOOR).tolist(), top_ids.tolist(), chosen.tolist()
    result = {}
    for j, i in enumerate(rows):
        want = params[i].logprobs or 0
        top = tuple(zip(top_ids[j][:want], top_logp[j][:want], strict=True))
        result[request_ids[i]] = TokenLogprobs(chosen[j], chosen_logp[j], top)
    return result
