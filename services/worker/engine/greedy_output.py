"""The output layer for greedy rows on a CPU: a bfloat16 screen, then float32 for the few tokens it leaves.

A float32 model's output layer is the largest product of a step: 49,152 x 576 weights for SmolLM2,
a fifth of a step's arithmetic at 64 rows and of its bytes at one. A row decoded greedily, with nothing
done to its logits (no penalty, bias, grammar or log-probabilities), needs only the argmax of them: the
screen multiplies in bfloat16 through oneDNN, and the C++ kernel (kernels/cpu_greedy_output.py) rescores
in float32 the tokens whose bounds reach the row's best (one to five of 49,152 over SmolLM2's own
answers), so the token is the one every float32 logit would have picked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import cpu_greedy_output
from services.worker.engine.cpu_linear import CpuLinear, pack, project
from services.worker.engine.model import LlamaModel
from services.worker.engine.sampling_params import SamplingParams

# Compiled steps of fewer rows keep the output layer in their graph, read there by inductor's own
# one-row kernel (~2.9 ms for SmolLM2's), where after a graph that ends at the norm a sampled row takes
# oneDNN's one-row float32 product (4.4-5.0 ms alone) and a greedy one the screen (~2.7 ms). SmolLM2
# float32, one stream, compiled, median step over ~1,500 steps each, both orders of building the two
# engines (the first built ran ~1 ms a step slower; 2-core Zen 4): sampled at 0.7, 2.2 ms a step less
# with the output layer in the graph (13.2 against 16.5 ms, and 19.4 against 20.6 in a slower hour),
# greedy 0.3 ms more, within the machine's swing. Steps of more rows multiply the output layer through
# oneDNN in the graph or out of it, where the screen halves its time.
GRAPH_ROWS_SCREENED_FROM = 6


class GreedyOutput:
    """The screen's packed bfloat16 weight and the norms of the float32 rows it rescores from."""

    def __init__(self, weight: torch.Tensor) -> None:  # (V, C) float32, kept (not copied)
        self.weight = weight.detach().contiguous()
        self.screen = pack(self.weight.to(torch.bfloat16))
        self.norms = self.weight.norm(dim=1)  # (V,)

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # (S, C) float32 final states -> (S,) int64
        hidden = hidden.contiguous()
        screen = project(hidden.to(torch.bfloat16), self.screen)  # (S, V) bfloat16
        return cpu_greedy_output.screened_argmax(screen, hidden, self.weight, self.norms)


def greedy_output_for(model: LlamaModel) -> GreedyOutput | None:
    """The screen for a float32 model on a CPU whose oneDNN multiplies bfloat16, whose output layer is
    oneDNN's (cpu_linear.py) and tied to the embedding (whose dense weight the rescoring reads), once the
    kernel builds; None elsewhere."""
    if not isinstance(model, LlamaModel) or not isinstance(model.lm_head, CpuLinear):
        return None
    weight = model.embed_tokens.weight
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not model.config.tie_word_embeddings
            or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    return GreedyOutput(weight) if cpu_greedy_output.available() else None


def argmax_only(params: Sequence[SamplingParams]) -> bool:
    """Whether every row wants only its likeliest token: greedy, its logits untouched, no log-probabilities
    (a grammar's rows are the caller's to exclude)."""
    return all(p.temperature == 0.0 and not p.processes_logits and p.logprobs is None for p in params)
