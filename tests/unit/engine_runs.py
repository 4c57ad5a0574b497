"""Running an engine to the end in tests: requests in, steps until none is left, their tokens out."""

from __future__ import annotations

from services.worker.engine.engine import Engine
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams


def finish(engine: Engine, requests: list[Request]) -> list[list[int]]:
    """Adds the requests, steps until the engine has nothing left, returns each one's output tokens."""
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return [request.output_token_ids for request in requests]


def tokens_for(engine: Engine, prompts: list[list[int]], params: SamplingParams, prefix: str = "r") -> list[list[int]]:
    """finish() over one request per prompt, all with the same params, ids prefix0, prefix1, ..."""
    return finish(engine, [Request(f"{prefix}{i}", prompt, params) for i, prompt in enumerate(prompts)])
