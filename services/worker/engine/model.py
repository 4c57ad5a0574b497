"""A Llama-architecture transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU) over flat
packed tokens of many sequences, reading and writing a paged KV cache; plus its cache allocation."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.rms_norm import add_rms_norm
from kernels.rope import apply_rope
from kernels.silu_mul import silu_mul
from services.worker.engine.attention import (
    AttentionMetadata,
    DecodeGroupMetadata,
    causal_attention,
    paged_attention,
)
from shared.models.shapes import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each (num_blocks, block_size, Hkv, D)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, C) -> (T, C)
        return add_rms_norm(x, None, self.weight, self.eps)[1]

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of it), one kernel on a GPU: the residual stream and this layer's input."""
        return add_rms_norm(x, delta, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # (D/2,) float32
    """RoPE frequencies, with Llama-3's rescaling of the long wavelengths when configured."""
    d = config.head_dim
    # On the host in float64 whatever the default device: a few dozen numbers, computed once.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] == "default":
        return inv_freq.float()
    # Llama 3: wavelengths longer than the original context are stretched by `factor`, short
    # ones are kept, and the band between is interpolated smoothly.
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context / high_freq_factor) & (wavelen <= old_context / low_freq_factor)
    return torch.where(is_medium, interpolated, scaled).float()


class RotaryEmbedding(nn.Module):
    """A precomputed cos/sin table, looked up by absolute position (rotate-half layout, as HF Llama)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Not persistent: rebuilt from the config, never read from a checkpoint.
        self.register_buffer("cos_sin", self._table(None), persistent=False)

    def _table(self, device: torch.device | None) -> torch.Tensor:  # (max_pos, D) float32: [cos | sin]
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32, device=device)
        inv_freq = rope_inv_freq(self.config).to(positions.device)  # (D/2,)
        angles = torch.outer(positions, inv_freq)  # (max_pos, D/2)
        return torch.cat([angles.cos(), angles.sin()], dim=-1)

    def reset_table(self) -> None:
        """Recompute the table in float32 where it lies (after materialising from the meta device)."""
        self.cos_sin = self._table(self.cos_sin.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # (T, 1, D/2) each
        return cos, sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # Q, K and V in one matmul: one kernel launch instead of three at decode time.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (T, C)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin of each token's position
        meta: AttentionMetadata | DecodeGroupMetadata | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:  # (T, C)
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is None:
            out = causal_attention(q, k, v, self.scale)
        else:
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))  # (T, Hq, D) -> (T, C)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)  # gate and up fused
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, C) -> (T, C)
        return self.down_proj(silu_mul(self.gate_up_proj(x)))  # (T, 2I) -> (T, I) -> (T, C)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # (T, C) the residual stream, less the last layer's output
        delta: torch.Tensor | None,  # (T, C) the last layer's output, None before the first layer
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata | DecodeGroupMetadata | None,
        kv_cache: KVCache | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x, delta) for the next layer
        """x + attn(norm(x)), then + mlp(norm(x)); each residual add is left to the norm after it,
        which does both in one kernel on a GPU."""
        x, h = self.input_layernorm.add_and_norm(x, delta)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, rope, meta, kv_cache))
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    """Parameter names follow Hugging Face's (less the `model.` prefix), except that q/k/v and
    gate/up are fused; the loader in weights.py knows that one difference."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) tokens of all sequences, packed
        positions: torch.Tensor,  # (T,) each token's absolute position in its own sequence
        meta: AttentionMetadata | DecodeGroupMetadata,
        kv_caches: list[KVCache],  # one per layer
    ) -> torch.Tensor:  # (T, C) final-normed hidden states
        rope = self.rotary(positions)
        x, delta = self.embed_tokens(input_ids), None  # (T, C)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, delta = layer(x, delta, rope, meta, kv_cache)
        return self.norm.add_and_norm(x, delta)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, C) -> (N, V) float32
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def dense_forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, V) float32
        """One sequence from position 0, no cache: what the paged path must reproduce."""
        rope = self.rotary(torch.arange(input_ids.shape[0], device=input_ids.device))
        x, delta = self.embed_tokens(input_ids), None  # (T, C)
        for layer in self.layers:
            x, delta = layer(x, delta, rope, None, None)
        return self.compute_logits(self.norm.add_and_norm(x, delta)[1])


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: str | torch.device,
    dtype: torch.dtype,
) -> list[KVCache]:
    """Zeroed K and V pools per layer, each (num_blocks, block_size, Hkv, D)."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
        for _ in range(config.num_layers)
    ]


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V: divide free memory by this to size the pool."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_size
