"""Hugging Face transformers as peers, on the float32 folder with SDPA attention: `generate` over a
left-padded static batch, and its continuous batching manager (a paged cache, sized by hand)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from peers_workloads import Run
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.streamers import BaseStreamer

PAD_ID = 0  # left padding, masked out
CB_PAGE_SIZE = 256  # tokens per page of the continuous-batching cache (its default)
CB_BATCH_TOKENS = 512  # tokens per step, as Drivetrain's default step budget on a CPU
RESULT_WAIT_S = 600.0  # longest one continuous-batching request may take before the run fails


def load_hf(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
    # No end-of-sequence: every stream runs its full length, as every peer is asked to.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model


class _FirstToken(BaseStreamer):
    """generate puts the prompt first, then each step's tokens: the second put is the first token."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class HFGenerate:
    def __init__(self, folder: Path, dtype: torch.dtype = torch.float32) -> None:
        self.name = "hf_generate" if dtype == torch.float32 else f"hf_generate:{str(dtype).removeprefix('torch.')}"
        self.model = load_hf(folder, dtype)

    @torch.no_grad()
    def run(self, prompts: list[list[int]], new_tokens: int) -> Run:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])  # (B, P), padded on the left
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        streamer = _FirstToken()
        start = time.perf_counter()
        out = self.model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, streamer=streamer,
        )
        seconds = time.perf_counter() - start
        first = (streamer.at or start + seconds) - start
        return Run(seconds, first, out[:, width:].tolist())


class HFContinuous:
    """The manager is started for each run and stopped after it (kept for the next, so only the first
    run builds its cache): its thread must not share the cores with the other engines' runs."""

    def __init__(self, folder: Path, num_pages: int, max_num_seqs: int) -> None:
        self.name = "hf_continuous"
        self.model = load_hf(folder, torch.float32)
        self.generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID)
        self.batching = ContinuousBatchingConfig(
            page_size=CB_PAGE_SIZE, num_blocks=num_pages, max_batch_tokens=CB_BATCH_TOKENS,
            max_requests_per_batch=max_num_seqs, allow_block_sharing=False,  # no prefix caching, as the others
        )

    @staticmethod
    def pages_for(streams: list[tuple[int, int]]) -> int:
        """Pages that hold one workload's streams, (prompt tokens, new tokens) each, all at once."""
        return sum(math.ceil((prompt + new) / CB_PAGE_SIZE) for prompt, new in streams)

    def _manager(self):
        # The cached manager comes back with its paged attention switched on again.
        return self.model.init_continuous_batching(self.generation, self.batching)

    @torch.no_grad()
    def run(self, prompts: list[list[int]], new_tokens: int) -> Run:
        manager = self._manager()
        manager.start()
        try:
            start = time.perf_counter()
            ids = manager.add_requests(prompts, max_new_tokens=new_tokens, record_timestamps=True)
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=RESULT_WAIT_S)
                if result is None:
                    raise RuntimeError("continuous batching returned nothing in time")
                if result.error is not None:
                    raise RuntimeError(f"continuous batching failed: {result.error}")
                if result.is_finished():
                    results[result.request_id] = result
            seconds = time.perf_counter() - start
        finally:
            manager.stop(block=True, keep_for_next_session=True)
        outputs = [results[i] for i in ids]
        stamps = [o.timestamps[0] for o in outputs if o.timestamps]
        first = min(stamps) - start if stamps else seconds
        return Run(seconds, first, [list(o.generated_tokens) for o in outputs])
