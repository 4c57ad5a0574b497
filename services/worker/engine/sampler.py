"""Pick one next token per row of a batch of logits, each row under its own request's
SamplingParams: greedy, temperature, top-k, top-p, and per-request seeds."""

from collections.abc import Sequence

import torch

from kernels import cpu_inverse_cdf
from services.worker.engine.host_values import on_device
from services.worker.engine.sampling_params import SamplingParams

# The width of the chunks argmax_rows cuts a row into.
ARGMAX_CHUNK = 1024
FLOAT32_MAX = torch.finfo(torch.float32).max
FIRST_CANDIDATES = 64  # a top-k or top-p row's likeliest tokens looked at first (see nucleus)


def make_generator(seed: int, device: str | torch.device) -> torch.Generator:
    """The random stream of one seeded request; the request keeps it for its whole life so that
    each step draws the next numbers, whatever else shares the batch."""
    return torch.Generator(device=device).manual_seed(seed)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # (N, V) -> (N,) int64
    """The first position of each row's largest value (NaN counting as largest), as `argmax(dim=-1)`
    gives it. On a CPU, PyTorch's argmax walks a row one value at a time: 64 rows of SmolLM2's
    49,152 logits took 0.89 ms of a ~60 ms step, against 0.16 ms here, where the rows' chunks take
    their maxima vectorised and only the chunk holding each row's largest is searched by argmax
    (2-core Zen 5 EPYC). The first chunk holding the largest value holds its first position, so ties
    resolve as argmax's do. One row takes argmax itself: a compiled one-row step's logits, fresh from
    the graph's threads, took 0.36 ms through the chunks' operations against 0.14 through argmax's
    one (SmolLM2, 2-core Zen 4, medians of ~500 steps each; alone, 0.043 against 0.058)."""
    if x.device.type != "cpu" or x.shape[-1] <= ARGMAX_CHUNK or x.shape[0] == 1:
        return x.argmax(dim=-1)
    rows, width = x.shape
    whole = width - width % ARGMAX_CHUNK
    tops = x[:, :whole].reshape(rows, whole // ARGMAX_CHUNK, ARGMAX_CHUNK).amax(dim=-1)  # (N, whole / chunk)
    if whole < width:
        tops = torch.cat([tops, x[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    start = tops.argmax(dim=-1, keepdim=True) * ARGMAX_CHUNK  # (N, 1)
    # The last chunk may be short: its positions past the row repeat the last one, after it.
    positions = (start + torch.arange(ARGMAX_CHUNK)).clamp_(max=width - 1)  # (N, chunk)
    return positions.gather(1, x.gather(1, positions).argmax(dim=-1, keepdim=True)).squeeze(1)


def uniforms(
    params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None, device: torch.device,
) -> torch.Tensor:  # (N,) float64 in [0, 1)
    """One uniform number per row: a seeded row's from its own generator, the others' from the global one."""
    drawn = torch.rand(len(params), dtype=torch.float64, device=device)
    for row, p in enumerate(params):
        generator = generators[row] if generators is not None else None
        if generator is not None:
            drawn[row] = torch.rand((), dtype=torch.float64, generator=generator, device=device)
        elif p.seed is not None and p.temperature > 0:
            raise ValueError(f"row {row} has seed {p.seed} but no generator: see make_generator")
    return drawn


def inverse_cdf(
    logits: torch.Tensor,  # (N, V); -inf where a token may not be drawn
    inv_temperature: torch.Tensor,  # (N,) > 0
    drawn: torch.Tensor,  # (N,) float64 in [0, 1)
) -> torch.Tensor:  # (N,) int64
    """Each row's token whose share of the row's running weight, w = softmax(logits * inv_temperature),
    holds `drawn`: token v is picked for draws in [W_<v, W_<=v) / W, so with probability w_v / W, and
    a token of weight 0 never. One number a row, where an exponential race takes one a token (64 rows
    of SmolLM2's vocabulary on a 2-core Zen 4: 59 ms of such a sampler's 89 went to drawing them).
    Float32 rows on a CPU take the C++ kernel (kernels/cpu_inverse_cdf.py), the others
    `inverse_cdf_ref`. A row that is not finite gets a token in range, no more."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_inverse_cdf.available():
        return cpu_inverse_cdf.inverse_cdf(logits.contiguous(), inv_temperature.float().contiguous(), drawn.contiguous())
    return inverse_cdf_ref(logits, inv_temperature, drawn)


def scaled_from_max(logits: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:  # (N, V)
    """(logits - each row's largest) * inv_temperature: the largest's 0 stays 0 at any finite inverse."""
    return (logits - logits.amax(dim=-1, keepdim=True)) * inv_temperature[:, None]


def inverse_cdf_ref(logits: torch.Tensor, inv_temperature: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """inverse_cdf by tensor operations. The sums are float64: a float32 running sum over 49,152 tokens
    would round away the share of the least likely ones."""
    weights = torch.softmax(scaled_from_max(logits, inv_temperature), dim=-1)  # (N, V)
    cumulative = weights.cumsum(dim=-1, dtype=torch.float64)  # (N, V)
    total = cumulative[:, -1:].contiguous()  # (N, 1)
    picked = torch.searchsorted(cumulative, drawn[:, None] * total, right=True)  # (N, 1): first sum above
    # A draw whose product rounds up to the total finds no sum above it: the last token of any weight.
    last = torch.searchsorted(cumulative, total)  # (N, 1): first sum equal to the total
    return torch.minimum(picked, last).clamp_(max=logits.shape[-1] - 1).squeeze(1)


def nucleus(
    logits: torch.Tensor,  # (R, V)
    inv_temperature: torch.Tensor,  # (R,)
    top_k: torch.Tensor,  # (R,) int64, 1..V
    top_p: torch.Tensor,  # (R,) in (0, 1]
) -> tuple[torch.Tensor, torch.Tensor]:  # (R, W) the candidates' logits, -inf where cut; (R, W) their tokens
    """Each row's top_k likeliest tokens, of which those while the probability before them is under
    top_p (the first always stays). On a CPU the candidates are the W likeliest, W widened eightfold
    until every row's cut falls among them: sorting 64 rows of SmolLM2's vocabulary took 118 ms, their
    likeliest 64 3 ms (2-core Zen 4), and a nucleus of 0.9 at temperature 0.7 is mostly a few tokens.
    Elsewhere the whole vocabulary, sorted: asking whether to widen would wait for the device."""
    vocab = logits.shape[1]
    scaled = scaled_from_max(logits, inv_temperature)  # (R, V)
    log_total = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (R, 1)
    width = min(vocab, FIRST_CANDIDATES) if logits.device.type == "cpu" else vocab
    while True:
        values, tokens = scaled.topk(width, dim=-1)  # (R, W) each, most likely first
        probs = torch.exp(values - log_total)
        mass_before = probs.cumsum(dim=-1) - probs
        keep = (torch.arange(width, device=logits.device)[None, :] < top_k[:, None]) & (mass_before < top_p[:, None])
        if width == vocab or not keep[:, -1].any():  # every row cut before its last candidate
            return logits.gather(1, tokens).masked_fill_(~keep, float("-inf")), tokens
        width = min(vocab, width * 8)


class Sampler:
    """Vectorised over the batch; rows with top-k or top-p draw among their likeliest tokens only (see
    nucleus); only seeded rows draw their number row by row, from their own generators."""

    @torch.no_grad()
    def __call__(
        self,
        logits: torch.Tensor,  # (N, V) float32
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,  # per row; None = global RNG
    ) -> torch.Tensor:  # (N,) int64
        n = logits.shape[0]
        if len(params) != n:
            raise ValueError(f"{n} rows of logits but {len(params)} SamplingParams")
        greedy_tokens = argmax_rows(logits)  # (N,)
        if all(p.temperature == 0.0 for p in params):
            return greedy_tokens
        device = logits.device
        is_greedy = on_device([p.temperature == 0.0 for p in params], torch.bool, device)
        # Greedy rows get temperature 1 here only to avoid dividing by 0; their draw is discarded. A tiny
        # temperature's inverse stays finite, so the likeliest token's weight is exp(0), not exp(0 * inf).
        inverse = [min(1.0 / (p.temperature or 1.0), FLOAT32_MAX) for p in params]
        inv_temperature = on_device(inverse, torch.float32, device)

        drawn = uniforms(params, generators, device)
        cutting = [row for row, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if len(cutting) < n:
            picked = inverse_cdf(logits, inv_temperature, drawn)  # (N,): right for the rows that cut nothing
        else:
            picked = torch.zeros(n, dtype=torch.int64, device=device)
        if cutting:
            rows = on_device(cutting, torch.int64, device)
            vocab = logits.shape[1]
            top_k = on_device([params[r].top_k or vocab for r in cutting], torch.int64, device)
            top_p = on_device([params[r].top_p for r in cutting], torch.float32, device)
            kept, tokens = nucleus(logits.index_select(0, rows), inv_temperature[rows], top_k, top_p)
            chosen = inverse_cdf(kept, inv_temperature[rows], drawn[rows])  # (R,) into each row's candidates
            picked = picked.index_copy(0, rows, tokens.gather(1, chosen[:, None]).squeeze(1))
        return torch.where(is_greedy, greedy_tokens, picked)
