"""What the sampling controls cost per step: a batch of 64 decoding with penalties, logit bias and
logprobs against the same batch without, and a batch of 64 under a JSON schema against one
without, side by side in one process, rounds interleaved.

The controls are batched on tensors (services/worker/engine/logits_processors.py, logprobs.py),
so their cost grows with the batch's tokens seen, not with a Python loop over the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
from engine_scenarios import Sizes, random_tokens, with_engine

from services.worker.engine.engine import Engine
from services.worker.engine.model import LlamaModel
from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings

BATCH, PROMPT, NEW_TOKENS, ROUNDS = 64, 64, 48, 3
PLAIN = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95, seed=1)
CONTROLLED = SamplingParams(
    max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95, seed=1, frequency_penalty=0.5, presence_penalty=0.3,
    repetition_penalty=1.1, logit_bias=((13, 2.0), (42, -5.0)), logprobs=5,
)  # fmt: skip


def decode_step_seconds(engine: Engine, sampling: SamplingParams, rng: np.random.Generator, clock) -> float:
    """Mean time of the steps in which all 64 requests decode (prefill excluded)."""
    for i in range(BATCH):
        engine.add_request(Request(f"r{i}", random_tokens(rng, PROMPT), sampling))
    times = []
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)
        full = decoding and len(engine.scheduler.running) == BATCH
        start = clock()
        engine.step()
        if full:
            times.append(clock() - start)
    return statistics.mean(times)


def controls(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    settings = EngineSettings(max_num_seqs=BATCH, max_batch_tokens=BATCH * PROMPT, num_kv_blocks=BATCH * 8)

    def run(engine: Engine) -> dict:
        rounds: dict[str, list[float]] = {"plain": [], "controlled": []}
        for r in range(ROUNDS):  # interleaved, so drift on a shared machine hits both alike
            for name, sampling in (("plain", PLAIN), ("controlled", CONTROLLED)):
                rounds[name].append(decode_step_seconds(engine, sampling, np.random.default_rng(r), args.clock))
        plain, controlled = statistics.median(rounds["plain"]), statistics.median(rounds["controlled"])
        return {
            "batch": BATCH, "rounds": ROUNDS, "step_s_plain": plain, "step_s_controlled": controlled,
            "penalties_logprobs_step_over_plain": controlled / plain, "per_round": rounds,
        }  # fmt: skip

    return with_engine(model, settings, run)


# --- a JSON-schema-constrained batch against a plain one --------------------------------------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"]}  # fmt: skip
MEASURED_STEPS = 16


def structured_step_seconds(llm, constrained: bool, tag: str, clock) -> float:
    """Median time of a decode step of the whole batch, every request under the grammar or none."""
    from services.worker.engine.types import Constraint, EngineRequest, Message

    constraint = Constraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    sampling = SamplingParams(max_tokens=400, temperature=1.0, seed=3)
    ids = [f"{tag}{i}" for i in range(BATCH)]
    for request_id in ids:
        llm.add_request(EngineRequest(request_id, "t", (Message("user", "JSON please"),), sampling, constraint=constraint))
    while llm.compiling.ids() or any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.scheduler.running):
        llm.step()  # grammars compiled and prompts computed: only decode steps are timed
    times = []
    for _ in range(MEASURED_STEPS):
        start = clock()
        llm.step()
        times.append(clock() - start)
    for request_id in ids:
        llm.abort_request(request_id)
    return statistics.median(times)


def structured(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    """The `tiny` shape with its tokenizer (the grammar needs one), so the weights are its own."""
    from services.worker.engine.llm_engine import build_llm_engine
    from shared.models.spec import resolve_model

    settings = EngineSettings(max_num_seqs=BATCH, max_batch_tokens=BATCH * PROMPT, num_kv_blocks=BATCH * 40)
    llm = build_llm_engine(resolve_model("tiny"), settings, str(next(model.parameters()).device))
    rounds: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for r in range(ROUNDS):
        rounds["plain"].append(structured_step_seconds(llm, False, f"p{r}-", args.clock))
        rounds["json_schema"].append(structured_step_seconds(llm, True, f"j{r}-", args.clock))
    plain, constrained = statistics.median(rounds["plain"]), statistics.median(rounds["json_schema"])
    return {
        "batch": BATCH, "rounds": ROUNDS, "step_s_plain": plain, "step_s_json_schema": constrained,
        "json_schema_step_over_plain": constrained / plain, "per_round": rounds,
    }  # fmt: skip
