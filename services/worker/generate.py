"""`drivetrain generate`: run prompts through the engine in this process (no Kafka, no services)
and print each completion; all prompts are batched together, as the worker would batch them."""

from __future__ import annotations

import argparse
import json
import sys
import time

import jinja2

from services.worker.engine.request import Request
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import RequestRejected
from shared.models.spec import SMOLLM2, ServedModel
from shared.settings import Settings


class GenerateSettings(Settings, ServedModel):
    """drivetrain generate: prompts through the engine in this process."""

    model: str = SMOLLM2
    """smollm2 | tiny | llama-1b | llama-8b | path of a Hugging Face folder"""
    device: str = "auto"
    """cpu | cuda | auto"""
    engine: EngineSettings = EngineSettings()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompts and their sampling; the model and engine flags come from GenerateSettings."""
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=None, help="seed of every prompt's draws")
    parser.add_argument("--stop", action="append", default=[], help="a stop string; repeat for several")
    parser.add_argument("--raw", action="store_true", help="send the prompt text as is, without the chat template")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt: prompt, token_ids, text")


def run(settings: GenerateSettings, args: argparse.Namespace) -> int:
    from services.worker.engine.llm_engine import build_llm_engine

    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
        )
        spec = settings.spec()
    except ValueError as exc:
        print(f"generate: {exc}", file=sys.stderr)
        return 2
    llm = build_llm_engine(spec, settings.engine, settings.device)
    requests: dict[str, Request] = {}
    texts: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    for index, prompt in enumerate(args.prompt):
        request_id = str(index)
        try:
            turn = [{"role": "user", "content": prompt}]
            ids = llm.tokenizer.encode(prompt) if args.raw else llm.tokenizer.apply_chat_template(turn)
            requests[request_id] = llm.add_prompt(request_id, ids, sampling)
            texts[request_id] = []
        except RequestRejected as exc:
            errors[request_id] = f"{exc.failure.code}: {exc.failure.message}"
        except (ValueError, jinja2.TemplateError) as exc:  # no chat template, or one that refuses
            errors[request_id] = f"invalid_request: {exc}"

    start = time.perf_counter()
    while llm.has_unfinished_requests():
        for output in llm.step():
            texts[output.request_id].append(output.text)
            if output.failure is not None:
                errors[output.request_id] = f"{output.failure.code}: {output.failure.message}"
    elapsed = time.perf_counter() - start

    for index, prompt in enumerate(args.prompt):
        _print_result(args, str(index), prompt, requests, texts, errors)
    num_tokens = sum(r.num_output_tokens for r in requests.values())
    print(f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / max(elapsed, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 1 if errors else 0


def _print_result(
    args: argparse.Namespace,
    request_id: str,
    prompt: str,
    requests: dict[str, Request],
    texts: dict[str, list[str]],
    errors: dict[str, str],
) -> None:
    text = "".join(texts.get(request_id, []))
    request = requests.get(request_id)
    if args.json:
        record = {"prompt": prompt, "token_ids": request.output_token_ids if request else [], "text": text}
        if request_id in errors:
            record["error"] = errors[request_id]
        print(json.dumps(record, ensure_ascii=False), flush=True)
        return
    print(f"=== {prompt if len(prompt) <= 80 else prompt[:77] + '...'}")
    print(f"error: {errors[request_id]}" if request_id in errors else text, flush=True)
