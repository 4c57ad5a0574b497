"""Build a LlamaModel and its Tokenizer for a model spec: weights from a Hugging Face folder
(safetensors; SmolLM2's is converted once from its GGUF), or seeded random weights for a shape."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.engine.model import LlamaModel
from shared.models.shapes import ModelConfig
from shared.models.spec import ModelSpec
from shared.models.tokenizer import Tokenizer

RANDOM_INIT_STD = 0.02


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    spec: ModelSpec,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> tuple[LlamaModel, Tokenizer]:
    """The spec's model in eval mode (random weights from `seed` for a shape), and its tokenizer."""
    if spec.is_echo:
        raise ValueError("the echo model has no weights to load")
    device = torch.device(device)
    if spec.weights_folder is None:
        model = random_model(spec.config, device, dtype, seed)
    else:
        model = materialise(spec.config, device, dtype or default_dtype(device))
        load_safetensors_(model, spec.weights_folder)
    return model.eval(), Tokenizer.from_folder(spec.tokenizer_folder)


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype | None = None, seed: int = 0) -> LlamaModel:
    """Seeded random weights of a shape, in eval mode: benchmarks need only token ids."""
    model = materialise(config, device, dtype or default_dtype(device))
    _init_random_(model, seed)
    return model.eval()


def materialise(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaModel:
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
