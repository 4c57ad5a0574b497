"""The echo model's pace: a fixed step period while streams run, so the pipeline benchmark charges the
token path for the path only, not for time the model's own loop spends between steps."""

from __future__ import annotations

import time

import pytest

from services.worker.echo import EchoEngine, next_step_end
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.types import EngineRequest, Message

DELAY = 0.02


def test_running_steps_end_one_delay_apart_whatever_time_passed_between_them():
    # The step before ended at 1.000; this one starts 3 ms later: it still ends at 1.020.
    assert next_step_end(1.000, 1.003, DELAY, stepping=True) == pytest.approx(1.020)


def test_an_idle_engine_and_a_stalled_one_take_a_whole_step_from_now():
    assert next_step_end(1.000, 1.005, DELAY, stepping=False) == pytest.approx(1.025)  # nothing ran: fresh
    assert next_step_end(1.000, 1.050, DELAY, stepping=True) == pytest.approx(1.070)  # fell behind a step


def test_a_stream_keeps_the_pace_of_its_first_token():
    engine = EchoEngine(delay_ms=DELAY * 1000)
    engine.add_request(EngineRequest("r", "t", [Message("user", " ".join(["w"] * 8))], SamplingParams(max_tokens=8)))
    ends = []
    while engine.has_unfinished_requests():
        engine.step()
        ends.append(time.perf_counter())
        time.sleep(0.004)  # work between steps, as the worker's outputs cost: absorbed, not added
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    assert len(ends) == 8
    # Added on top, the 4 ms would have made the last token 28 ms late; absorbed, it is on time.
    assert ends[-1] - ends[0] == pytest.approx(7 * DELAY, abs=0.012)
    assert min(gaps) > DELAY / 2
