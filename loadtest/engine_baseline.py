"""Hugging Face `generate` on the same shape and batches as the engine benchmark: static batching
by construction, the baseline a user would otherwise reach for."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from shared.models.shapes import ModelConfig

Clock = Callable[[], float]


def hf_static_batches(
    config: ModelConfig, prompts: list[list[int]], lengths: np.ndarray, batch: int, device: torch.device,
    quick: bool, clock: Clock,
) -> dict:
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError:
        return {"skipped": "transformers is not importable"}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**config.to_hf()), dtype=dtype).eval()
    # The static cache makes generate compile its forward: worth it on a GPU only.
    modes = ["eager", "static_cache"] if device.type == "cuda" else ["eager"]
    # Full batches only; --quick: the first two (tok/s is per batch anyway).
    num_batches = min(2, len(prompts) // batch) if quick else len(prompts) // batch
    longest = [int(lengths[k * batch : (k + 1) * batch].max()) for k in range(num_batches)]
    result: dict = {"batches": num_batches, "batch": batch}
    for mode in modes:
        kwargs = {"cache_implementation": "static"} if mode == "static_cache" else {}
        # Warm-up; a static cache is compiled for the longest batch, which the others then reuse.
        _hf_generate(hf, prompts[:batch], max(longest) if kwargs else 8, device, kwargs, clock)
        useful, seconds = 0, 0.0
        for k in range(num_batches):
            seconds += _hf_generate(hf, prompts[k * batch : (k + 1) * batch], longest[k], device, kwargs, clock)
            useful += int(lengths[k * batch : (k + 1) * batch].sum())
        result[f"{mode}_tok_s"] = useful / seconds
    return result  # the model goes with this frame; the caller frees the memory


def _hf_generate(
    hf, prompts: list[list[int]], new_tokens: int, device: torch.device, kwargs: dict, clock: Clock
) -> float:
    ids = torch.tensor(prompts, device=device)  # (B, P): equal lengths, no padding needed
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = clock()
    with torch.no_grad():
        hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, **kwargs,
        )  # min_new_tokens: every row runs its full length, EOS or not
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - start
