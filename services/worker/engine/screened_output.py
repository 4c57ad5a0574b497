"""The output layer on a CPU for rows whose logits nothing touches: a bfloat16 screen, then float32 only
where the screen cannot decide.

A float32 model's output layer is the largest product of a step: 49,152 x 576 weights for SmolLM2,
a fifth of a step's arithmetic at 64 rows and of its bytes at one. A row decoded greedily, or sampled at
a temperature from its whole vocabulary, with nothing done to its logits (no penalty, bias, top-k,
top-p, seed or log-probabilities; a grammar's rows are checked after the draw, model_runner.py), needs neither every logit nor all of their float32 bits: the
screen multiplies in bfloat16 (cpu_linear.py: in panels where the CPU has AVX512_BF16, else through
oneDNN), and the C++ kernel (kernels/cpu_screened_output.py)
rescores in float32 the tokens the screen's bounds leave open. A greedy row's token is the one every
float32 logit would have picked; a sampled row's is drawn from the same softmax of float32 logits, by
rejection from the bounds' envelope.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import cpu_screened_output
from services.worker.engine.cpu_linear import CpuLinear
from services.worker.engine.model import LlamaModel
from services.worker.engine.sampler import FLOAT32_MAX, inverse_cdf
from services.worker.engine.sampling_params import SamplingParams

# Compiled steps of fewer rows keep the output layer in their graph, read there by inductor's own
# one-row kernel (~2.9 ms for SmolLM2's), where after a graph that ends at the norm a row the screen does
# not serve takes oneDNN's one-row float32 product (4.4-5.0 ms alone) and one it serves the screen
# (~2.7 ms greedy, ~3 sampled). SmolLM2
# float32, one stream, compiled, median step over ~1,500 steps each, both orders of building the two
# engines (the first built ran ~1 ms a step slower; 2-core Zen 4): sampled at 0.7, 2.2 ms a step less
# with the output layer in the graph (13.2 against 16.5 ms, and 19.4 against 20.6 in a slower hour),
# greedy 0.3 ms more, within the machine's swing. Steps of more rows multiply the output layer through
# oneDNN in the graph or out of it, where the screen halves its time.
GRAPH_ROWS_SCREENED_FROM = 6
# A step whose other rows take every float32 logit screens its rows only where they are this many or more:
# fewer rows' products read the whole output layer for little arithmetic, so the screen's product and the
# others' float32 one each cost about what one float32 product of every row does (SmolLM2's, 2-core Zen 4:
# float32 5.5 ms at one row, 6.6 at 16, 20.2 at 64; the screen 2.6, 3.5, 11.2).
SCREENED_AMONG_OTHERS = 16
# Proposals a sampled row may make before its caller draws it from every float32 logit: over states of
# SmolLM2's own answers, a row refuses one at 0.7 with probability 0.015 on average, 0.15 at worst
# (kernels/cpu_screened_output.py), so all 8 refused is rarer than one row in a million.
ATTEMPTS = 8


class ScreenedOutput:
    """The screen's packed bfloat16 weight and the norms of the float32 rows it rescores from."""

    def __init__(self, weight: torch.Tensor) -> None:  # (V, C) float32, kept (not copied)
        self.weight = weight.detach().contiguous()
        self.screen = CpuLinear(self.weight.to(torch.bfloat16))
        self.norms = self.weight.norm(dim=1)  # (V,)

    def tokens(self, hidden: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # (S, C) -> (S,)
        """Each row's token, greedy or drawn as its params say (rows the screen serves only: see `screens`)."""
        hidden = hidden.contiguous()
        screen = self.screen(hidden.to(torch.bfloat16))  # (S, V) bfloat16
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        attempts = 0 if all(p.greedy for p in params) else ATTEMPTS
        drawn = torch.rand(len(params), 2 * attempts, dtype=torch.float64)
        tokens = cpu_screened_output.screened_tokens(screen, hidden, self.weight, self.norms, temperature, drawn)
        missed = (tokens == cpu_screened_output.FELL_BACK).nonzero().squeeze(1)
        if len(missed):
            logits = hidden.index_select(0, missed) @ self.weight.T  # (M, V) every float32 logit
            inverse = (1.0 / temperature.index_select(0, missed)).clamp_(max=FLOAT32_MAX)
            tokens[missed] = inverse_cdf(logits, inverse, torch.rand(len(missed), dtype=torch.float64))
        return tokens


def screened_output_for(model: LlamaModel) -> ScreenedOutput | None:
    """The screen for a float32 model on a CPU whose oneDNN multiplies bfloat16, whose output layer is
    oneDNN's (cpu_linear.py) and tied to the embedding (whose dense weight the rescoring reads), once the
    kernel builds; None elsewhere."""
    if not isinstance(model, LlamaModel) or not isinstance(model.lm_head, CpuLinear):
        return None
    weight = model.embed_tokens.weight
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not model.config.tie_word_embeddings
            or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    return ScreenedOutput(weight) if cpu_screened_output.available() else None


def screens(params: SamplingParams) -> bool:
    """Whether the screen can give a row its token: its logits untouched and no log-probabilities, and
    either greedy or drawn from its whole vocabulary by the shared random stream (no top-k or top-p; no
    seed, whose draws must not depend on the path its step took). A grammar's rows are the caller's to
    check: a draw from the whole vocabulary that the grammar allows is a draw from what its mask keeps."""
    return (not params.processes_logits and params.logprobs is None
            and (params.greedy or (params.top_k == 0 and params.top_p == 1.0 and params.seed is None)))
