"""Model names -> what they stand for (shape, tokenizer, weights, context length), without loading a weight.

`ServedModel` is the settings section every process that serves or counts for a model reads:
edges count prompts against the same context the workers' engines hold requests to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from shared.models.echo import CONTEXT_PIECES, ECHO
from shared.models.errors import ModelError
from shared.models.shapes import SHAPES, ModelConfig
from shared.models.smollm2 import smollm2_folder

SMOLLM2 = "smollm2"
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model name. `config` is None for the echo model, which has no weights;
    `weights_folder` is None for a named shape, built with seeded random weights."""

    name: str
    config: ModelConfig | None
    tokenizer_folder: Path | None
    weights_folder: Path | None
    max_model_len: int  # most tokens (prompt + output) of one request

    @property
    def is_echo(self) -> bool:
        return self.config is None


def context_length(config: ModelConfig, max_model_len: int = 0) -> int:
    """The most tokens one request may hold: `max_model_len`, or the model's context capped at 8192."""
    length = max_model_len or min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if not 0 < length <= config.max_position_embeddings:
        raise ModelError(f"max_model_len {length} is outside the model's context of {config.max_position_embeddings}")
    return length


def resolve_model(name: str, max_model_len: int = 0) -> ModelSpec:
    """`echo`, `smollm2`, a shape name (`tiny`, `llama-1b`, `llama-8b`: SmolLM2's tokenizer),
    or the path of a Hugging Face folder; ModelError naming the choices otherwise."""
    if name == ECHO:
        return ModelSpec(ECHO, None, None, None, max_model_len or CONTEXT_PIECES)
    if name in SHAPES:
        config = SHAPES[name]
        return ModelSpec(name, config, smollm2_folder(), None, context_length(config, max_model_len))
    folder = smollm2_folder() if name == SMOLLM2 else Path(name)
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"model {name!r} is neither {ECHO!r}, {SMOLLM2!r}, a shape {sorted(SHAPES)}, nor a folder with config.json"
        )
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return ModelSpec(name, config, folder, folder, context_length(config, max_model_len))


class ServedModel(BaseModel):
    """Settings of the model a fleet serves; edges and workers must agree on them."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    model: str = ECHO
    """echo | smollm2 | tiny | llama-1b | llama-8b | path of a Hugging Face folder; the edge counts prompts with its tokenizer"""
    max_model_len: int = 0
    """most tokens (prompt + output) of one request; 0 = the model's context, at most 8192"""

    def spec(self) -> ModelSpec:
        return resolve_model(self.model, self.max_model_len)
