"""Helpers that more than one unit-test module uses."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def faulty_runner():
    """A ModelRunner that raises whenever a step includes the request named `bad`, as a corrupt input would."""
    from services.worker.engine.model_runner import ModelRunner
    from services.worker.engine.scheduler import SchedulerOutput

    class FaultyRunner(ModelRunner):
        def run(self, out: SchedulerOutput) -> dict[str, int]:
            if any(chunk.request_id == "bad" for chunk in out.chunks):
                raise RuntimeError("injected fault")
            return super().run(out)

    return FaultyRunner
