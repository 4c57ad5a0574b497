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
import torch
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
# An array that must hold 1,000 strings before it may close: random weights cannot finish it (each
# item takes two tokens at least), so all 64 rows stay under the grammar while they are timed.
TAGS = {"type": "array", "minItems": 1000, "items": {"type": "string", "maxLength": 12}}
SCHEMA = {"type": "object", "properties": {"tags": TAGS}, "required": ["tags"]}
STRUCTURED_ROUNDS, MEASURED_STEPS = 7, 10
# The same sampling on both sides; ignore_eos keeps a plain row from leaving at a random EOS.
STRUCTURED_SAMPLING = SamplingParams(max_tokens=400, temperature=1.0, ignore_eos=True)


def structured_step_seconds(llm, constrained: bool, tag: str, clock) -> list[float]:
    """Times of decode steps in which every one of the 64 rows drew a token, every row under the
    grammar or none; a step with fewer rows sampled is not timed."""
    from services.worker.engine.types import Constraint, EngineRequest, Message

    constraint = Constraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    ids = [f"{tag}{i}" for i in range(BATCH)]
    for request_id in ids:
        message = (Message("user", "JSON please"),)
        llm.add_request(EngineRequest(request_id, "t", message, STRUCTURED_SAMPLING, constraint=constraint))
    scheduler = llm.engine.scheduler
    while len(llm.compiling) or scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        llm.step()  # grammars compiled and prompts computed: only decode steps are timed
    requests = [llm.engine.get_request(request_id) for request_id in ids]
    if len(llm.engine.grammars) != (BATCH if constrained else 0) or scheduler.num_running != BATCH:
        raise RuntimeError(f"expected {BATCH} running requests, {'all' if constrained else 'none'} under a grammar")
    times: list[float] = []
    for _ in range(3 * MEASURED_STEPS):
        before = [r.num_output_tokens for r in requests]
        start = clock()
        llm.step()
        elapsed = clock() - start
        if sum(r.num_output_tokens == n + 1 and not r.is_finished for r, n in zip(requests, before)) == BATCH:
            times.append(elapsed)
        if len(times) == MEASURED_STEPS or any(r.is_finished for r in requests):
            break
    for request_id in ids:
        llm.abort_request(request_id)
    if len(times) < MEASURED_STEPS:
        raise RuntimeError(f"only {len(times)} steps sampled all {BATCH} rows: the batch did not stay full")
    return times


def structured(model: LlamaModel, sizes: Sizes, args: argparse.Namespace) -> dict:
    """`--structured-model` with its tokenizer (the grammar needs one), so the weights are its own: the
    `tiny` shape's random ones, or SmolLM2's, whose draws its grammar mostly allows. Rounds interleaved,
    each side first in turn; the ratio is the median of the rounds' ratios."""
    from services.worker.engine.llm_engine import build_llm_engine
    from shared.models.spec import resolve_model

    torch.manual_seed(0)  # the unseeded draws come from the global generator
    settings = EngineSettings(max_num_seqs=BATCH, max_batch_tokens=BATCH * PROMPT, num_kv_blocks=BATCH * 40)
    llm = build_llm_engine(resolve_model(args.structured_model), settings, str(next(model.parameters()).device))
    rounds: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for r in range(STRUCTURED_ROUNDS):
        sides = [("plain", False), ("json_schema", True)]
        for name, constrained in sides if r % 2 == 0 else sides[::-1]:
            times = structured_step_seconds(llm, constrained, f"{name[0]}{r}-", args.clock)
            rounds[name].append(statistics.median(times))
    ratios = [j / p for p, j in zip(rounds["plain"], rounds["json_schema"])]
    plain, constrained = statistics.median(rounds["plain"]), statistics.median(rounds["json_schema"])
    return {
        "model": args.structured_model, "batch": BATCH, "rounds": STRUCTURED_ROUNDS, "timed_steps_per_round": MEASURED_STEPS,
        "schema": SCHEMA, "rows_sampled_in_each_timed_step": BATCH,
        "step_s_plain": plain, "step_s_json_schema": constrained,
        "json_schema_step_over_plain": statistics.median(ratios), "ratio_of_medians": constrained / plain,
        "round_ratios": ratios, "per_round": rounds,
    }  # fmt: skip
