"""Paged attention on the CPU through PyTorch's fused scaled_dot_product_attention, and our C++
kernels where they are built (cpu_paged_decode.py for decoding, cpu_prefill_attention.py for float32
prompts).

What a step's sequences read from the cache is worked out once per step (a CpuAttentionPlan),
then every layer does a few whole-block gathers and one attention call per group (with the fused
kernel, two for a prompt chunk after a cached prefix):
- decoding sequences are grouped by length (each group's contexts within a factor of two), so
  no sequence is padded to the batch's longest context;
- prompts computed whole in this step (nothing cached before them) attend causally in one call
  per group of like lengths, padded to the group's longest: a call per prompt cost more than its
  arithmetic at chat prompts' few dozen tokens;
- any other prompt chunk attends to its cached prefix and causally to itself: the C++ kernel in
  one call; the fused kernel in two, merged by their log-sum-exps, since a mask over the whole
  context would cost every masked pair too;
- new K/V are written by index into the flat cache.
`decode_group_attention` is one decode group in plain tensor operations, for a compiled graph;
`decode_group_attention_kernel` the same through the C++ kernel (cpu_paged_decode.py), which the
graphs call where it is built. The references in decode_attention.py and prefill_attention.py stay
the ground truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import cpu_prefill_attention
from kernels.checks import check_query_and_cache
from kernels.cpu_paged_decode import paged_decode_attention

PAD_BLOCK = 0  # a real block (the pool's null block) read for table entries past a context, then masked


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences that decode one token each, with contexts within a factor of two of each other."""

    rows: torch.Tensor  # (n,) query rows
    blocks: torch.Tensor  # (n, NB) int64 block ids; past a context: PAD_BLOCK
    visible: torch.Tensor | None  # (n, 1, 1, NB * block_size) bool; None when every position is visible
    length: int  # NB * block_size, the group's padded context
    # For the C++ kernel, where the plan was built for it: each position's flat slot, and the contexts.
    read_slots: torch.Tensor | None = None  # (n, NB * block_size) int64
    contexts: torch.Tensor | None = None  # (n,) int64


@dataclass(frozen=True)
class PromptChunk:
    """A chunk of several query tokens at the end of its sequence's context."""

    start: int  # its query rows are start:end
    end: int
    blocks: torch.Tensor  # (NB,) int64
    context_len: int

    @property
    def prefix(self) -> int:
        """Cached positions before the chunk's own."""
        return self.context_len - (self.end - self.start)


@dataclass(frozen=True)
class WholePrompts:
    """Prompts of lengths within a factor of two of each other, each computed whole in this step,
    laid out padded to the longest: past its end, a prompt repeats its last row and slot, which
    causal attention hides from its real positions."""

    rows: torch.Tensor  # (n, L) query row of each position
    slots: torch.Tensor  # (n, L) int64 flat cache slot of each position
    real: torch.Tensor  # (n * L,) bool: positions within their prompt
    real_rows: torch.Tensor  # (R,) the rows of the real positions, in their order


@dataclass(frozen=True)
class CpuAttentionPlan:
    write_slots: torch.Tensor  # (T',) int64 flat cache slots
    write_rows: torch.Tensor | None  # (T',) rows written; None: every row, in order
    decode_groups: list[DecodeGroup]
    prompt_chunks: list[PromptChunk]  # after a cached prefix
    num_rows: int
    whole_prompts: list[WholePrompts] = field(default_factory=list)
    # Gathers of every layer reuse two buffers: a fresh allocation per layer costs page faults.
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def single_group(self) -> bool:
        """Every row decodes, in one group in row order: its output is the step's output."""
        return (not self.prompt_chunks and not self.whole_prompts and len(self.decode_groups) == 1
                and self.decode_groups[0].rows.shape[0] == self.num_rows)

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor, buffer: str, dtype: torch.dtype) -> torch.Tensor:
        """(n, NB) block ids -> (n, Hkv, NB * block_size, D) in `dtype`: whole blocks copied into a reused
        buffer (converted as they are copied where the cache keeps another dtype than the queries)."""
        n, num_blocks = blocks.shape
        wanted = n * num_blocks
        held = self._buffers.get(buffer)
        if held is None or held.shape[0] < wanted or held.dtype != dtype:
            held = self._buffers[buffer] = cache.new_empty((self._most_blocks(), *cache.shape[1:]), dtype=dtype)
        if cache.dtype == dtype:
            gathered = torch.index_select(cache, 0, blocks.reshape(-1), out=held[:wanted])
        else:
            gathered = held[:wanted].copy_(cache[blocks.reshape(-1)])
        return gathered.view(n, num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)

    def _most_blocks(self) -> int:
        sizes = [g.blocks.numel() for g in self.decode_groups] + [c.blocks.numel() for c in self.prompt_chunks]
        return max(sizes, default=1)

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,  # (T,)
        block_tables: torch.Tensor,  # (N, M)
        cu_seqlens_q: torch.Tensor,  # (N+1,)
        context_lens: torch.Tensor,  # (N,)
        block_size: int,
        kernel: bool = False,  # decode groups through the C++ kernel (cpu_paged_decode.py), not fused attention
    ) -> CpuAttentionPlan:
        slots = slot_mapping.long()
        keep = slots >= 0
        write_rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
        write_slots = slots if write_rows is None else slots[write_rows]

        bounds = cu_seqlens_q.tolist()
        lengths = context_lens.tolist()
        tables = block_tables.long()
        decoding = []
        whole = []
        chunks = []
        for seq, context_len in enumerate(lengths):
            start, end = bounds[seq], bounds[seq + 1]
            if context_len == 0 or end == start:
                continue  # padding: its rows stay zero
            if end - start == 1:
                decoding.append(seq)
            elif end - start == context_len:
                whole.append(seq)
            else:
                blocks = tables[seq, : math.ceil(context_len / block_size)]
                chunks.append(PromptChunk(start, end, blocks, context_len))
        groups = [_decode_group(seqs, bounds, lengths, tables, block_size, kernel)
                  for seqs in _by_length(decoding, lengths)]
        prompts = [_whole_prompts(seqs, bounds, tables, block_size) for seqs in _by_length(whole, lengths)]
        return cls(write_slots, write_rows, groups, chunks, num_rows=bounds[-1], whole_prompts=prompts)


def _by_length(seqs: list[int], lengths: list[int]) -> list[list[int]]:
    """Longest first; a sequence joins the current group while its context is at least half the
    group's longest, so padding at most doubles any sequence's work."""
    groups: list[list[int]] = []
    for seq in sorted(seqs, key=lambda s: -lengths[s]):
        if groups and 2 * lengths[seq] >= lengths[groups[-1][0]]:
            groups[-1].append(seq)
        else:
            groups.append([seq])
    return [sorted(group) for group in groups]  # rows in order: one group of all rows is the output as is


def _decode_group(seqs: list[int], bounds: list[int], lengths: list[int], tables: torch.Tensor,
                  block_size: int, kernel: bool) -> DecodeGroup:
    contexts = torch.tensor([lengths[s] for s in seqs])  # (n,)
    num_blocks = math.ceil(int(contexts.max()) / block_size)
    index = torch.tensor(seqs)
    blocks = tables[index, :num_blocks]  # (n, NB)
    used = torch.arange(num_blocks)[None, :] < ((contexts + block_size - 1) // block_size)[:, None]
    blocks = torch.where(used, blocks, PAD_BLOCK)
    length = num_blocks * block_size
    visible = torch.arange(length)[None, :] < contexts[:, None]  # (n, S)
    rows = torch.tensor([bounds[s] for s in seqs])
    visible = None if bool(visible.all()) else visible[:, None, None, :]
    if not kernel:
        return DecodeGroup(rows, blocks, visible, length)
    read_slots = (blocks[:, :, None] * block_size + torch.arange(block_size)).reshape(len(seqs), length)
    return DecodeGroup(rows, blocks, visible, length, read_slots, contexts.long())


def _whole_prompts(seqs: list[int], bounds: list[int], tables: torch.Tensor, block_size: int) -> WholePrompts:
    starts = torch.tensor([bounds[s] for s in seqs])[:, None]  # (n, 1)
    ends = torch.tensor([bounds[s + 1] for s in seqs])[:, None]
    offsets = torch.arange(int((ends - starts).max()))[None, :]  # (1, L)
    positions = torch.minimum(offsets, ends - starts - 1)  # (n, L): each prompt's own, its last repeated
    rows = starts + positions
    slots = tables[torch.tensor(seqs)[:, None], positions // block_size] * block_size + positions % block_size
    real = (offsets < ends - starts).reshape(-1)
    return WholePrompts(rows, slots, real, rows.reshape(-1)[real])


def write_kv_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 plan: CpuAttentionPlan) -> None:
    """Copy this step's K/V (T, Hkv, D) into their slots of the caches, in place."""
    if plan.write_rows is not None:
        k, v = k[plan.write_rows], v[plan.write_rows]
    write_slots(k, v, k_cache, v_cache, plan.write_slots)


def write_slots(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor) -> None:
    """K/V rows (n, Hkv, D) into their flat slots (n,) of the caches (num_blocks, block_size, Hkv, D),
    in place, in the caches' dtype."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, in_cache_dtype(k, k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, in_cache_dtype(v, v_cache.dtype))


def in_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache keeps it. A float16 cache saturates at its largest finite value (65,504): an
    infinite key would make its sequence's scores NaN, and every later token with them."""
    if dtype == torch.float16 and x.dtype != dtype:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def paged_attention_cpu(
    q: torch.Tensor,  # (T, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    scale: float,
) -> torch.Tensor:  # (T, Hq, D)
    """Each query row attends to its sequence's cached context up to its own position."""
    check_query_and_cache(q, k_cache, v_cache, "(T, Hq, D)", cache_dtype_of_its_own=True)
    if plan.single_group:
        return _decode(q, k_cache, v_cache, plan.decode_groups[0], plan, scale)
    out = q.new_zeros(q.shape)
    for group in plan.decode_groups:
        out.index_copy_(0, group.rows, _decode(q[group.rows], k_cache, v_cache, group, plan, scale))
    for prompts in plan.whole_prompts:
        out.index_copy_(0, prompts.real_rows, _whole(q, k_cache, v_cache, prompts, scale))
    for chunk in plan.prompt_chunks:
        out[chunk.start:chunk.end] = _prefill(q[chunk.start:chunk.end], k_cache, v_cache, chunk, plan, scale)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
            plan: CpuAttentionPlan, scale: float) -> torch.Tensor:  # (n, Hq, D)
    if group.read_slots is not None:  # the kernel reads the blocks where they lie: no gathered copies
        return decode_group_attention_kernel(q, k_cache, v_cache, group.read_slots, group.contexts, scale)
    keys = plan.gather(k_cache, group.blocks, "k", q.dtype)  # (n, Hkv, S, D)
    values = plan.gather(v_cache, group.blocks, "v", q.dtype)
    return _attend_one_each(q, keys, values, group.visible, scale)


def _attend_one_each(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                     scale: float) -> torch.Tensor:  # (n, Hq, D)
    """One query row per sequence over its gathered keys (n, Hkv, S, D), positions past its context masked."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    # The query heads sharing a KV head ride as that head's query rows: no copies of K/V per head.
    queries = q.view(n, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # (n, Hkv, G, D)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=scale)
    return out.reshape(n, num_q_heads, head_dim)


def decode_group_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           read_slots: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """(n, Hq, D) outputs of one new query per sequence, over the positions at its flat slots
    read_slots (n, S) (the null block's past a table) that are visible (n, 1, 1, S), this step's
    K/V written already: a decode group in plain tensor operations (no plan, no reused buffers),
    which is what a compiled graph captures. Equals paged_attention_cpu's decode.

    Products and sums of broadcast tensors rather than matrix products or the fused attention
    kernel: compiled, each reads the cache's blocks where they lie, the mask and the softmax fuse,
    and no gathered copy of K or V is written. A matrix product needs that copy, and at a step's few
    query rows per head it cost more than the arithmetic (SmolLM2 float32 through the compiled
    graphs, 2-core AVX-512 EPYC, one process, rounds taking turns: 64 rows at context 104 131.7 ms a
    step against 179.4 with two products, 16 rows at 300 72.1 against 101.1, one row at 600 17.9
    against 26.6). Positions are read by their flat slots, worked out on the host: indexing by block
    made every load divide its position by the block size and look its block up (at 64 rows 2x the
    time, the attention alone compiled). Each output is divided by its exponentials' sum once, after
    the sum over positions, not each weight inside it: compiled alone, 3-10 % less time a call (2 rows
    at context 600 118 against 121 us, 16 at 300 384 against 413, 64 at 144 722 against 786, 64 at
    400 3.84 against 4.27 ms; medians of 7 rounds taking turns), too little to show in a whole SmolLM2
    float32 step of 64 rows (paired 0.996 over 6 rounds, the same tokens)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    n, length = read_slots.shape
    num_q_heads = q.shape[1]
    # In float32 whatever the cache's dtype: compiled, the conversion happens as each value is loaded.
    keys = k_flat[read_slots].float().view(n, length, num_kv_heads, 1, head_dim)  # (n, S, Hkv, 1, D)
    values = v_flat[read_slots].float().view(n, length, num_kv_heads, 1, head_dim)
    queries = q.float().view(n, 1, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # (n, 1, Hkv, G, D)
    scores = ((queries * keys).sum(-1) * scale).masked_fill(~visible.view(n, length, 1, 1), float("-inf"))
    exps = torch.exp(scores - scores.amax(1, keepdim=True))  # (n, S, Hkv, G); a context holds its own token
    out = (exps[..., None] * values).sum(1) / exps.sum(1)[..., None]  # (n, Hkv, G, D)
    return out.reshape(n, num_q_heads, head_dim).to(q.dtype)


def decode_group_attention_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  read_slots: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """decode_group_attention through the C++ kernel (cpu_paged_decode.cpp), each sequence reading
    its context's length (n,) of positions: well under half the time where many sequences decode.
    SmolLM2's shapes, 64 rows at contexts of 90-140, 30 layers' caches in turn, both compiled as the
    graphs compile them, 9 rounds taking turns: 395 against 1,026 us a layer (29 against 11 GB/s of
    keys and values; paired ratio 2.6)."""
    return paged_decode_attention(q.float().contiguous(), k_cache, v_cache, read_slots, lengths, scale).to(q.dtype)


def _whole(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prompts: WholePrompts,
           scale: float) -> torch.Tensor:  # (R, Hq, D): the real positions' outputs
    """Causal attention of each prompt over its own keys, read back from the cache as decoding will
    read them (in its dtype), all prompts of the group in one call."""
    n, length = prompts.rows.shape

    def padded(cache: torch.Tensor) -> torch.Tensor:  # (n, L, Hkv, D) in q's dtype
        read = cache.view(-1, *cache.shape[2:]).index_select(0, prompts.slots.reshape(-1))
        return read.to(q.dtype).view(n, length, *cache.shape[2:])

    queries = q[prompts.rows]  # (n, L, Hq, D)
    out = _causal(queries, padded(k_cache), padded(v_cache), scale)
    return out.reshape(n * length, *q.shape[1:])[prompts.real]


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PromptChunk,
             plan: CpuAttentionPlan, scale: float) -> torch.Tensor:  # (L, Hq, D)
    keys = plan.gather(k_cache, chunk.blocks[None], "k", q.dtype)[0, :, : chunk.context_len]  # (Hkv, C, D)
    values = plan.gather(v_cache, chunk.blocks[None], "v", q.dtype)[0, :, : chunk.context_len]
    if cpu_prefill_attention.serves(q, keys):  # the prefix and the chunk's own keys in one call
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # (1, C, Hkv, D)
        return cpu_prefill_attention.prefill_attention(q[None], keys, values, scale)[0]
    queries = q.transpose(0, 1)[None]  # (1, Hq, L, D)
    prefix = chunk.prefix
    out, own_lse = _flash(queries, keys[None, :, prefix:], values[None, :, prefix:], True, scale)
    if prefix > 0:
        cached, cached_lse = _flash(queries, keys[None, :, :prefix], values[None, :, :prefix], False, scale)
        # Each part is softmax-normalised over its own keys; weighted by its share of the whole
        # context's exp-sum, the two add up to attention over all of it.
        cached_share = torch.sigmoid(cached_lse - own_lse).unsqueeze(-1)  # (1, Hq, L, 1)
        out = out + (cached - out) * cached_share.to(out.dtype)
    return out[0].transpose(0, 1)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """(n, L, Hq, D) causal attention over (n, L, Hkv, D) keys and values: the C++ kernel where it
    serves, else the fused one."""
    if cpu_prefill_attention.serves(q, k):
        return cpu_prefill_attention.prefill_attention(q, k, v, scale)
    return _flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, scale)[0].transpose(1, 2)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention (the kernel behind scaled_dot_product_attention) with each row's
    log-sum-exp, which the public call does not return. Query heads share KV heads as enable_gqa."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
