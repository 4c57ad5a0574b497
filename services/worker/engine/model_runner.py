"""Runs one scheduled step: a SchedulerOutput becomes flat tensors, the model runs over the paged
KV cache (decode steps through CUDA graphs on a GPU), and each chunk that ends a request's known
tokens gets its next token sampled.

`launch` queues the step and returns at once on a GPU; its tokens are read later (`PendingStep`),
so the engine can schedule the next step meanwhile. A decode whose input token that step draws
(PLACEHOLDER) takes it from the device tensor the step before drew, with no trip through the host."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import psutil
import torch

from kernels import cpu_elementwise, cpu_inverse_cdf, cpu_paged_decode, cpu_prefill_attention, cpu_token_bitmask
from services.worker.engine.attention import AttentionMetadata
from services.worker.engine.block_pool import NULL_BLOCK_ID
from services.worker.engine.cpu_graphs import CpuDecodeGraphs
from services.worker.engine.cuda_graphs import CudaGraphRunner
from services.worker.engine.grammar_mask import apply_token_bitmask
from services.worker.engine.grammar_matchers import GrammarMatchers
from services.worker.engine.host_values import on_device
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.logits_processors import PendingTokens, process_logits
from services.worker.engine.logprobs import PendingLogprobs, Sampled, token_logprobs
from services.worker.engine.model import (
    LlamaModel,
    allocate_kv_cache,
    kv_bytes_per_block,
)
from services.worker.engine.sampler import Sampler, make_generator
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.scheduler import PLACEHOLDER, SchedulerOutput
from services.worker.engine.screened_output import (
    GRAPH_ROWS_SCREENED_FROM,
    SCREENED_AMONG_OTHERS,
    ScreenedOutput,
    screened_output_for,
    screens,
)
from services.worker.engine.settings import CpuCompile

log = logging.getLogger(__name__)

CPU_FULL_CONTEXTS = 4  # a CPU pool holds this many max-length requests by default...
CPU_KV_BYTES = 1 << 30  # ...but never more than this much memory
GPU_RESERVE_BYTES = 512 << 20  # left free for CUDA graphs, the allocator's slack and cuBLAS workspaces
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class RunnerConfig:
    """The runner's part of the engine's settings, every auto resolved (engine.resolve makes it)."""

    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_step_tokens: int  # the most tokens one step can hold: sizes the profiling run
    num_kv_blocks: int  # 0: size the pool from memory
    kv_memory_fraction: float  # GPU: share of device memory for weights, activations and KV
    cuda_graphs: bool
    cpu_compile: CpuCompile = "off"
    cpu_attention_kernel: bool = True  # CPU decode attention through the C++ kernel, where it builds
    cpu_graph_store: Path | None = None  # where compiled CPU decode graphs are kept between starts
    cpu_output_screen: bool = True  # untouched rows' output layer screened in bfloat16, where it pays
    kv_cache_dtype: torch.dtype | None = None  # None: the weights' dtype
    eos_token_ids: frozenset[int] = frozenset()  # masked before a request's min_tokens, unless it ignores EOS


@dataclass
class StepInputs:
    """One step as tensors, plus which rows are sampled for which request."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (S,) rows of the T tokens whose logits are sampled
    sample_ids: list[str]  # (S,) the request of each sampled row
    sampling: list[SamplingParams]  # (S,)
    sample_positions: list[int]  # (S,) position the sampled token will take (seeds its draw)
    histories: list[Sequence[int]]  # (S,) each sampled request's tokens so far, for its penalties
    prompt_lens: list[int]  # (S,)
    placeholder_rows: np.ndarray  # (P,) rows of the T tokens whose input is PLACEHOLDER
    placeholder_ids: list[str]  # (P,) the request of each
    placeholder_samples: list[int]  # (P,) the sampled row of each (a decode samples its one token)

    @property
    def num_seqs(self) -> int:
        return self.meta.context_lens.shape[0]

    def of_sampled(self, rows: list[int]) -> StepInputs:
        """The same step with only these sampled rows (their order kept), for drawing part of its tokens."""
        return dataclasses.replace(
            self, sample_rows=self.sample_rows[on_device(rows, torch.int64, self.sample_rows.device)],
            sample_ids=[self.sample_ids[r] for r in rows], sampling=[self.sampling[r] for r in rows],
            sample_positions=[self.sample_positions[r] for r in rows],
            histories=[self.histories[r] for r in rows], prompt_lens=[self.prompt_lens[r] for r in rows],
        )  # fmt: skip


def prepare_inputs(out: SchedulerOutput, block_size: int, pad_to: int = 0) -> StepInputs:
    """Host tensors for a non-empty step. pad_to > number of chunks appends one-token padding
    sequences (slot -1: nothing written; context 1 of the null block) for a captured graph."""
    # Column by column, each in one call: no Python loop over requests, which at hundreds of
    # them costs more than the rest of the step's host work.
    ids, token_ids, starts, rows, sample, sampling, histories, prompt_lens = zip(*out.chunks)
    num_real = len(ids)
    num_seqs = max(num_real, pad_to)
    lens = np.ones(num_seqs, dtype=np.int64)
    lens[:num_real] = np.fromiter(map(len, token_ids), dtype=np.int64, count=num_real)
    cu_seqlens = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(lens, out=cu_seqlens[1:])
    positions_start = np.zeros(num_seqs, dtype=np.int64)
    positions_start[:num_real] = starts
    context_lens = positions_start + lens  # (N,) this step's tokens included
    # The step's rows of the persistent tables, as wide as its longest context.
    width = cdiv(int(context_lens.max()), block_size)
    block_tables = np.full((num_seqs, width), NULL_BLOCK_ID, dtype=np.int32)  # (N, W)
    block_tables[:num_real] = out.block_tables[rows, :width]

    num_real_tokens = int(cu_seqlens[num_real])
    seq_of_row = np.repeat(np.arange(num_seqs), lens)  # (T,)
    positions = positions_start[seq_of_row] + np.arange(cu_seqlens[-1]) - cu_seqlens[seq_of_row]  # (T,)
    slots = block_tables[seq_of_row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    slots[num_real_tokens:] = -1  # padding rows write nothing
    input_ids = np.zeros(cu_seqlens[-1], dtype=np.int64)
    input_ids[:num_real_tokens] = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=num_real_tokens)

    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(block_tables),
        cu_seqlens_q=torch.from_numpy(cu_seqlens.astype(np.int32)),
        context_lens=torch.from_numpy(context_lens.astype(np.int32)),
        max_query_len=int(lens.max()),
    )
    # A pending token is the only input of its decode, so its row is its sequence's first.
    placeholder_seqs = np.flatnonzero(input_ids[cu_seqlens[:num_real]] == PLACEHOLDER)
    every_row = all(sample)  # a decode step samples every row
    sampled = np.arange(num_real) if every_row else np.flatnonzero(np.fromiter(sample, dtype=bool, count=num_real))

    def pick(column: tuple) -> list:
        return list(column) if every_row else [column[i] for i in sampled]

    return StepInputs(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        meta=meta,
        sample_rows=torch.from_numpy(cu_seqlens[1:][sampled] - 1),
        sample_ids=pick(ids),
        sampling=pick(sampling),
        sample_positions=context_lens[sampled].tolist(),
        histories=pick(histories),
        prompt_lens=pick(prompt_lens),
        placeholder_rows=cu_seqlens[placeholder_seqs],
        placeholder_ids=[ids[i] for i in placeholder_seqs],
        placeholder_samples=np.searchsorted(sampled, placeholder_seqs).tolist(),
    )


def mix_seed(seed: int, position: int) -> int:
    """A well-spread 63-bit seed for (request seed, token position) (splitmix64's finaliser).

    Each draw is seeded by where its token lands, not by how many draws came before, so a
    seeded request repeats exactly whatever shares its batch, and after a preemption too.
    """
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class PendingStep:
    """A launched step's draws. On a GPU the host copy of the tokens is queued behind the step's
    kernels and `ready` is recorded after it: `result` waits for the device only then."""

    sample_ids: list[str]
    tokens: torch.Tensor  # (S,) int64 on the host; filled when `ready` has passed
    logprobs: PendingLogprobs | None  # None: no row asked
    ready: torch.cuda.Event | None = None  # None: the tokens are there already (a CPU)

    def result(self) -> Sampled:
        if self.ready is not None:
            self.ready.synchronize()
        logprobs = self.logprobs.read() if self.logprobs is not None else {}
        return Sampled(dict(zip(self.sample_ids, self.tokens.tolist(), strict=True)), logprobs)


NOTHING_DRAWN = PendingStep([], torch.zeros(0, dtype=torch.int64), None)


def to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of `tokens` queued on the device's stream, and the event that marks it done."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def kv_cache_dtype(weights: torch.dtype, wanted: torch.dtype | None, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the weights' unless another is asked for, which only the CPU paths read."""
    if wanted is None or wanted == weights:
        return weights
    if device.type != "cpu":
        raise ValueError(f"a {wanted} KV cache under {weights} weights is a CPU option; on {device} the cache "
                         "keeps the weights' dtype")
    return wanted


class ModelRunner:
    def __init__(self, model: LlamaModel, config: RunnerConfig) -> None:
        self.model = model
        self.config = config
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.kv_dtype = kv_cache_dtype(self.dtype, config.kv_cache_dtype, self.device)
        self.block_size = config.block_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}  # seeded requests only
        # The last launched step's draws on the device, for the next step's PLACEHOLDER inputs.
        self._drawn: torch.Tensor = torch.zeros(0, dtype=torch.int64, device=self.device)  # (S,)
        self._drawn_ids: list[str] = []  # (S,) the request of each
        self.grammars: GrammarMatchers | None = None  # the engine's constrained requests (structured output)
        self.num_blocks = config.num_kv_blocks or self._size_kv_pool()
        self.kv_caches = allocate_kv_cache(model.config, self.num_blocks, self.block_size, self.device, self.kv_dtype)
        # Decided (and the kernel built) before any step runs or graph is traced: both call whichever it is.
        self.cpu_attention_kernel = (self.device.type == "cpu" and config.cpu_attention_kernel
                                     and cpu_paged_decode.supports(model.config.head_dim, self.kv_dtype))
        if self.device.type == "cpu":
            cpu_inverse_cdf.available()  # built now, not in the first sampled request's step
            cpu_token_bitmask.available()  # nor in the first constrained request's
        if self.device.type == "cpu" and self.dtype == torch.float32:
            cpu_elementwise.available()  # built now, not in the first request's prompt step
            cpu_prefill_attention.available()
        self.screened_output: ScreenedOutput | None = screened_output_for(model) if config.cpu_output_screen else None
        self.graphs: CudaGraphRunner | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            max_blocks = cdiv(config.max_model_len, self.block_size)
            self.graphs = CudaGraphRunner(model, self.kv_caches, config.max_num_seqs, max_blocks)
            self.graphs.capture()
        self.num_graph_steps = 0  # steps whose model ran as one graph: CUDA replays and CPU graph steps
        self.decode_graphs: CpuDecodeGraphs | None = None
        if config.cpu_compile != "off" and self.device.type == "cpu":
            self.decode_graphs = CpuDecodeGraphs(model, self.kv_caches, self.block_size,
                                                 attention_kernel=self.cpu_attention_kernel,
                                                 store=config.cpu_graph_store,
                                                 states_from_rows=None if self.screened_output is None
                                                 else GRAPH_ROWS_SCREENED_FROM)
            self.decode_graphs.start(background=config.cpu_compile == "background")
        log.info("KV cache: %d blocks of %d tokens on %s", self.num_blocks, self.block_size, self.device)

    def run(self, out: SchedulerOutput) -> Sampled:
        """The sampled token of every chunk with sample=True, by request id (and logprobs where asked)."""
        return self.launch(out).result()

    @torch.no_grad()
    def launch(self, out: SchedulerOutput) -> PendingStep:
        """Queue the step on the device; its draws are read through the PendingStep."""
        self.drop_requests(out.finished_ids + out.preempted_ids)
        if out.is_empty:
            return NOTHING_DRAWN
        inputs = self._to_device(prepare_inputs(out, self.block_size, self._graph_size(out)))
        pending = self._fill_placeholders(inputs) if len(inputs.placeholder_rows) else None
        screened = self._screened_rows(inputs)
        if screened:
            return self._screened_step(inputs, screened, pending)
        logits = self._logits(inputs)  # (S, V)
        if logits is None:
            return NOTHING_DRAWN
        return self._drawn_step(inputs, *self._sampled(logits, inputs, pending))

    def _sampled(self, logits: torch.Tensor, inputs: StepInputs, pending: PendingTokens | None,
                 ) -> tuple[torch.Tensor, PendingLogprobs | None]:
        """The tokens of the sampled rows' logits (S, V), each row processed, constrained and drawn as it asks."""
        logits = process_logits(
            logits, inputs.sampling, inputs.histories, inputs.prompt_lens, inputs.sample_positions,
            self.config.eos_token_ids, pending,
        )  # fmt: skip
        if self.grammars is not None and (masked := self.grammars.bitmask(inputs.sample_ids, self.device)) is not None:
            apply_token_bitmask(logits, *masked)  # constrained rows keep only what their grammar allows
        tokens = self.sampler(logits, inputs.sampling, self._generators_for(inputs))  # (S,)
        return tokens, token_logprobs(logits, inputs.sampling, tokens, inputs.sample_ids)

    def _drawn_step(self, inputs: StepInputs, tokens: torch.Tensor, logprobs: PendingLogprobs | None) -> PendingStep:
        self._drawn, self._drawn_ids = tokens, inputs.sample_ids
        host_tokens, ready = to_host(tokens)
        return PendingStep(inputs.sample_ids, host_tokens, logprobs, ready)

    def _screened_rows(self, inputs: StepInputs) -> list[int]:
        """The sampled rows whose tokens come from the output screen (screened_output.py): those whose
        logits nothing else touches, greedy or drawn from the whole vocabulary (a grammar's rows too: a
        draw their grammar refuses is drawn again, masked), where the plan for a step of its size ends at
        the final norm (a graph's, or the eager step's after it, whose output layer is oneDNN's float32
        product; with no graphs at all, every step), and they are every sampled row or at least
        SCREENED_AMONG_OTHERS of them; else none."""
        if self.screened_output is None:
            return []
        grammars = self.grammars
        if grammars is None or not len(grammars):
            rows = [row for row, params in enumerate(inputs.sampling) if screens(params)]
        else:
            rows = [row for row, (request_id, params) in enumerate(zip(inputs.sample_ids, inputs.sampling, strict=True))
                    if screens(params) and (request_id not in grammars or grammars.worth_checking(request_id))]
        if not rows or (len(rows) < len(inputs.sample_ids) and len(rows) < SCREENED_AMONG_OTHERS):
            return []
        return rows if self.decode_graphs is None or not self._graph_ends_with_logits(inputs) else []

    def _screened_step(self, inputs: StepInputs, screened: list[int], pending: PendingTokens | None) -> PendingStep:
        """The screened rows' tokens from the screen, where their grammar allows them; the others' from their
        float32 logits, as `_sampled` draws. Drawn from the whole vocabulary, a token the grammar allows is a
        draw from what its mask keeps (the argmax of those, for a greedy row), so only a refused row takes
        its mask and its row of logits."""
        states = self._final_states(inputs)  # (S, C)
        if states is None:
            return NOTHING_DRAWN
        everyone = len(screened) == len(inputs.sample_ids)
        index = on_device(screened, torch.int64, states.device)
        params = [inputs.sampling[row] for row in screened]
        drawn = self.screened_output.tokens(states if everyone else states[index], params)
        if self.grammars is not None and len(self.grammars):
            refused = set(self.grammars.refused([inputs.sample_ids[row] for row in screened], drawn.tolist()))
            screened = [row for i, row in enumerate(screened) if i not in refused]
        if len(screened) == len(inputs.sample_ids):
            return self._drawn_step(inputs, drawn, None)
        chosen = set(screened)
        others = [row for row in range(len(inputs.sample_ids)) if row not in chosen]
        tokens = torch.empty(len(inputs.sample_ids), dtype=torch.int64, device=states.device)
        tokens[index] = drawn
        index = on_device(others, torch.int64, states.device)
        drawn, logprobs = self._sampled(self.model.compute_logits(states[index]), inputs.of_sampled(others),
                                        pending.of_sampled(others) if pending is not None else None)
        tokens[index] = drawn
        return self._drawn_step(inputs, tokens, logprobs)

    def _graph_ends_with_logits(self, inputs: StepInputs) -> bool:
        return self.decode_graphs.ends_with_logits(inputs.input_ids.shape[0])

    def _fill_placeholders(self, inputs: StepInputs) -> PendingTokens:
        """Each PLACEHOLDER input becomes the token the last launched step drew for its request,
        which its history lacks until the host reads it (so its penalties take it from here)."""
        row_of = {request_id: row for row, request_id in enumerate(self._drawn_ids)}
        rows = [row_of[request_id] for request_id in inputs.placeholder_ids]  # KeyError: not drawn there
        source = on_device(rows, torch.int64, self.device)
        target = on_device(inputs.placeholder_rows.tolist(), torch.int64, self.device)
        tokens = self._drawn.index_select(0, source)
        inputs.input_ids.index_copy_(0, target, tokens)
        return PendingTokens(inputs.placeholder_samples, tokens)

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators) of finished or preempted requests."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def _graph_size(self, out: SchedulerOutput) -> int:
        """The captured batch size this step replays, or 0 to run eagerly."""
        if self.graphs is None or any(c.num_tokens != 1 for c in out.chunks):
            return 0
        return self.graphs.padded_size(len(out.chunks)) or 0

    def _logits(self, inputs: StepInputs) -> torch.Tensor | None:  # (S, V) float32; None: nothing sampled
        if self.decode_graphs is not None:
            out = self._through_graph(inputs)
            if out is not None:
                return out if self._graph_ends_with_logits(inputs) else self.model.compute_logits(out)
        states = self._eager_states(inputs)
        return None if states is None else self.model.compute_logits(states)

    def _final_states(self, inputs: StepInputs) -> torch.Tensor | None:  # (S, C); None: nothing sampled
        """The sampled rows' final hidden states, through a graph that ends at the final norm if one serves."""
        if self.decode_graphs is not None and not self._graph_ends_with_logits(inputs):
            states = self._through_graph(inputs)
            if states is not None:
                return states
        return self._eager_states(inputs)

    def _eager_states(self, inputs: StepInputs) -> torch.Tensor | None:  # (S, C); None: nothing sampled
        hidden = self._forward(inputs)  # (T or padded B, C)
        return hidden[inputs.sample_rows] if inputs.sample_ids else None

    def _through_graph(self, inputs: StepInputs) -> torch.Tensor | None:
        """A decode step's output through the CPU graphs, where they cover it (every row sampled)."""
        if len(inputs.sample_ids) != inputs.num_seqs:
            return None
        out = self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        self.num_graph_steps += out is not None
        return out

    def _forward(self, inputs: StepInputs) -> torch.Tensor:  # (T, C)
        meta = inputs.meta
        if self.graphs is not None and meta.decode_only and inputs.num_seqs in self.graphs.graphs:
            self.num_graph_steps += 1
            return self.graphs.replay(
                inputs.input_ids, inputs.positions, meta.slot_mapping, meta.block_tables, meta.context_lens
            )
        if self.cpu_attention_kernel:
            meta = dataclasses.replace(meta, cpu_attention_kernel=True)
        return self.model(inputs.input_ids, inputs.positions, meta, self.kv_caches)

    def _to_device(self, inputs: StepInputs) -> StepInputs:
        if self.device.type == "cpu":
            return inputs
        # Pinned host memory lets the copies overlap; they are queued before the model's kernels.
        # A blocking copy would first wait for the steps queued before (engine.py's overlap).
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory().to(self.device, non_blocking=True)

        meta = inputs.meta
        meta = AttentionMetadata(
            move(meta.slot_mapping), move(meta.block_tables), move(meta.cu_seqlens_q),
            move(meta.context_lens), meta.max_query_len,
        )
        return dataclasses.replace(
            inputs, input_ids=move(inputs.input_ids), positions=move(inputs.positions), meta=meta,
            sample_rows=move(inputs.sample_rows),
        )  # fmt: skip

    def _generators_for(self, inputs: StepInputs) -> list[torch.Generator | None] | None:
        if all(p.seed is None or p.greedy for p in inputs.sampling):
            return None
        generators: list[torch.Generator | None] = []
        for request_id, params, position in zip(inputs.sample_ids, inputs.sampling, inputs.sample_positions):
            if params.seed is None or params.greedy:
                generators.append(None)
                continue
            generator = self._generators.get(request_id)
            if generator is None:
                generator = self._generators[request_id] = make_generator(0, self.device)
            generator.manual_seed(mix_seed(params.seed, position))
            generators.append(generator)
        return generators

    # --- sizing the KV pool ---------------------------------------------------------------------

    def _size_kv_pool(self) -> int:
        per_block = kv_bytes_per_block(self.model.config, self.block_size, self.kv_dtype)
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget()
        else:
            wanted = CPU_FULL_CONTEXTS * cdiv(self.config.max_model_len, self.block_size) * per_block
            budget = min(wanted, CPU_KV_BYTES, _available_host_bytes() // 4)
        num_blocks = int(budget // per_block) + 1  # + the null block
        min_blocks = cdiv(self.config.max_model_len, self.block_size) + 1
        if num_blocks < min_blocks:
            log.warning(
                "KV pool of %d blocks cannot hold one %d-token request; raise the memory or lower max_model_len",
                num_blocks, self.config.max_model_len,
            )
        return max(2, num_blocks)

    def _gpu_kv_budget(self) -> int:
        """Bytes the KV pool may take: the fraction of device memory, less what is in use (weights,
        CUDA context, other processes) and the activation peak of the largest step."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.kv_memory_fraction) - (total - free) - activation_peak - GPU_RESERVE_BYTES
        log.info(
            "GPU memory: %.1f GiB total, %.1f GiB in use, activation peak %.2f GiB, KV budget %.1f GiB",
            total / 2**30, (total - free) / 2**30, activation_peak / 2**30, budget / 2**30,
        )
        return max(0, budget)

    @torch.no_grad()
    def _profile_run(self) -> None:
        """The largest step the scheduler can send: a full token budget in one sequence, then
        logits and top-p sampling for max_num_seqs rows."""
        num_tokens = min(self.config.max_step_tokens, self.config.max_model_len)
        num_blocks = cdiv(num_tokens, self.block_size) + 1
        caches = allocate_kv_cache(self.model.config, num_blocks, self.block_size, self.device, self.kv_dtype)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device) + self.block_size,
            block_tables=torch.arange(1, num_blocks, dtype=torch.int32, device=self.device)[None, :],
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), meta, caches)  # (T, C)
        rows = min(num_tokens, self.config.max_num_seqs)
        logits = self.model.compute_logits(hidden[:rows])  # (S, V)
        self.sampler(logits, [SamplingParams(temperature=1.0, top_p=0.9)] * rows)
        del caches, hidden, logits


def _available_host_bytes() -> int:
    """Memory the pool may take without swapping: free plus reclaimable page cache, which the
    free page count alone leaves out (a busy box's cache would shrink the pool to nothing)."""
    return psutil.virtual_memory().available
