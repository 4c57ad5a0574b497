"""The float32 bound counts a row's multiplies as the engine's model holds its weights."""

from __future__ import annotations

from pathlib import Path

import torch

from services.worker.engine.model import LlamaModel
from shared.models.spec import resolve_model


def test_a_rows_multiplies_are_the_models_projection_weights(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "loadtest"))
    from bench_cpu_bound import weights_per_row

    config = resolve_model("tiny").config
    with torch.device("meta"):
        model = LlamaModel(config)
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    body, head = weights_per_row(config)
    assert body == sum(m.weight.numel() for m in linears)
    assert head == model.embed_tokens.weight.numel()  # the output layer, tied or not, has its shape
