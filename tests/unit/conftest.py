"""Helpers that more than one unit-test module uses."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def graph_store_of_their_own(tmp_path_factory):
    """Compiled CPU graphs the tests build go to a store of their own: the user's keeps only a few,
    and would lose a model's graphs to the tests' tiny ones."""
    from services.worker.engine import cpu_graph_store

    folder = tmp_path_factory.mktemp("cpu-graphs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_graph_store, "default_store", lambda: folder)
        yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """The test machine's cores are shared: one intra-op thread avoids OpenMP contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def faulty_runner():
    """A ModelRunner that raises whenever a step includes the request named `bad`, as a corrupt input would."""
    from services.worker.engine.model_runner import ModelRunner
    from services.worker.engine.scheduler import SchedulerOutput

    class FaultyRunner(ModelRunner):
        def launch(self, out: SchedulerOutput):
            if any(chunk.request_id == "bad" for chunk in out.chunks):
                raise RuntimeError("injected fault")
            return super().launch(out)

    return FaultyRunner


@pytest.fixture(scope="session")
def tiny():
    """The `tiny` shape with an untied head and strong projections (std 0.2).

    With the stock random weights (tied, std 0.02) greedy decoding just repeats the last
    token whatever came before, so a wrong KV read would go unnoticed; here every output
    depends on the whole context (test_engine checks it), so the comparisons can fail.
    """
    import dataclasses

    import torch

    from services.worker.engine.model import LlamaModel
    from shared.models.shapes import SHAPES

    model = LlamaModel(dataclasses.replace(SHAPES["tiny"], tie_word_embeddings=False))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.2 if "proj" in name else 1.0, generator=generator)
    return model.eval()
