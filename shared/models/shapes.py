"""The shape of a Llama-architecture model: read from a Hugging Face config.json, or one of
the named shapes (`tiny`, `llama-1b`, `llama-8b`) that benchmarks and tests build with random weights.

Plain data: serving cost depends on the shape, which the edge, the worker and the benchmarks
all need without loading any weights."""

from dataclasses import dataclass
from typing import Any

_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU inner width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when fewer than num_heads)
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # Llama-3 style: rope_type, factor, low/high_freq_factor, ...
    rms_norm_eps: float
    max_position_embeddings: int  # the RoPE table is this long; no sequence may exceed it
    tie_word_embeddings: bool  # the LM head reuses the embedding matrix
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in _ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling!r}; supported types: {_ROPE_TYPES}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face Llama config.json (the older `rope_theta` + `rope_scaling` keys or
        transformers 5's `rope_parameters`)."""
        if hf.get("model_type", "llama") not in ("llama", "mistral"):
            raise ValueError(f"not a Llama-architecture config: model_type {hf.get('model_type')!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only SwiGLU (hidden_act 'silu') is supported, got {hf['hidden_act']!r}")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("attention and MLP biases are not supported")
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face config.json for this shape (what `from_hf` reads back)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }

    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layers * per_layer + self.hidden_size + head


def _llama3_scaling(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# The random-weight shapes share SmolLM2's tokenizer, so their special ids are SmolLM2's:
# <|im_start|> = 1, <|im_end|> = 2. Serving cost depends on the shape, not on these ids.
_SMOLLM2_BOS, _SMOLLM2_EOS = 1, (2,)

SHAPES: dict[str, ModelConfig] = {
    # Small enough for CPU tests; vocabulary equal to SmolLM2's so its tokenizer fits exactly.
    "tiny": ModelConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rope_scaling=None,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=_SMOLLM2_BOS,
        eos_token_ids=_SMOLLM2_EOS,
    ),
    # Llama-3.2-1B
    "llama-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(32.0),
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=_SMOLLM2_BOS,
        eos_token_ids=_SMOLLM2_EOS,
    ),
    # Llama-3.1-8B
    "llama-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(8.0),
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=_SMOLLM2_BOS,
        eos_token_ids=_SMOLLM2_EOS,
    ),
}


def shape_config(name: str) -> ModelConfig:
    """The named random-weight shape; ValueError listing the names if unknown."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known shapes: {sorted(SHAPES)}") from None
