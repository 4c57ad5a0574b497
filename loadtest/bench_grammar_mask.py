"""Grammar masks applied on a CPU (services/worker/engine/grammar_mask.py): the C++ kernel
(kernels/cpu_token_bitmask.cpp) against the tensor operations it replaces, on SmolLM2's vocabulary at
1, 16 and 64 rows, each row's mask one that llguidance filled at a real state of the structured
scenario's schema; then that scenario's step (64 rows under the schema, engine_controls.py) on the
`tiny` shape and on SmolLM2's own weights, with either. Rounds taking turns, medians, the ratio paired
per round.

    python loadtest/bench_grammar_mask.py --json loadtest/results/grammar_mask_cpu.json
"""

from __future__ import annotations

import json
import statistics
import time
import unittest.mock
from pathlib import Path

import kernel_bench
import numpy as np
import torch
from bench_report import paired_bars, write_and_report
from engine_controls import BATCH, PROMPT, SCHEMA, structured_step_seconds

from kernels import cpu_token_bitmask
from services.worker.engine.grammar_compiler import GrammarCompiler
from services.worker.engine.grammar_mask import apply_token_bitmask
from services.worker.engine.llm_engine import build_llm_engine
from services.worker.engine.settings import EngineSettings
from services.worker.engine.types import Constraint
from shared.models.spec import resolve_model
from shared.models.tokenizer import Tokenizer

VOCAB = 49152  # SmolLM2's, and the `tiny` shape's tokenizer's
ROWS = [1, 16, 64]
# A document of the schema, written a token at a time: its states are the masks' (inside a tag, between).
DOCUMENT = '{"tags": ["red", "green", "a longer one", "x", "blue sky", "9", "tea", "grey", "ok", "zz", "new"'


def masks_along_a_document(tokenizer: Tokenizer) -> np.ndarray:  # (states, W) int32
    compiler = GrammarCompiler(tokenizer, VOCAB, (2,))  # SmolLM2's end of turn
    matcher = compiler.submit(Constraint("json_schema", json.dumps(SCHEMA))).result(60)
    words = (VOCAB + 31) // 32
    masks = []
    for token in tokenizer.encode(DOCUMENT, add_special_tokens=False):
        mask = np.full(words, -1, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        masks.append(mask)
        if not matcher.consume_token(token):
            raise RuntimeError(f"the schema refused the document at token {token}: {matcher.get_error()}")
    compiler.close()
    return np.stack(masks)


def mask_cases(masks: np.ndarray, rounds: int, repeats: int) -> list[dict]:
    """Each row count's logits (fresh each call, as a step's are) under masks of the document's states."""
    cases = []
    for rows in ROWS:
        logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows))
        bitmask = torch.from_numpy(masks[np.arange(rows) % len(masks)])
        index = torch.arange(rows)
        case = kernel_bench.paired_kernels(lambda x=logits, m=bitmask, i=index: apply_token_bitmask(x.clone(), i, m),
                                           cpu_token_bitmask, rounds, repeats)
        allowed = sum((int(w) & 0xFFFFFFFF).bit_count() for w in bitmask.flatten().tolist()) / rows
        cases.append({"rows": rows, "tokens_allowed_per_row": allowed, **case})
    return cases


def step_case(model: str, rounds: int) -> dict:
    """The structured scenario's steps under the schema (the median of a round's timed steps), with the
    kernel and with the tensor operations, taking turns."""
    torch.manual_seed(0)
    settings = EngineSettings(max_num_seqs=BATCH, max_batch_tokens=BATCH * PROMPT, num_kv_blocks=BATCH * 40)
    llm = build_llm_engine(resolve_model(model), settings, "cpu")
    timed: dict[str, list[float]] = {"kernels": [], "references": []}
    for r in range(rounds):
        for name in (("kernels", "references") if r % 2 == 0 else ("references", "kernels")):
            serves = cpu_token_bitmask.serves if name == "kernels" else (lambda logits: False)
            with unittest.mock.patch.object(cpu_token_bitmask, "serves", new=serves):
                times = structured_step_seconds(llm, True, f"{name}{r}-", time.perf_counter)
            timed[name].append(statistics.median(times))
    ratios = [k / t for k, t in zip(timed["kernels"], timed["references"], strict=True)]
    return {"model": model, "batch": BATCH, "kernels_step_ms": 1000 * statistics.median(timed["kernels"]),
            "references_step_ms": 1000 * statistics.median(timed["references"]),
            "kernels_over_references": statistics.median(ratios), "ratios": ratios, "per_round_s": timed}


def main() -> int:
    args = kernel_bench.arguments(__doc__, "grammar_mask_cpu.json")
    tokenizer = Tokenizer.from_folder(resolve_model("tiny").tokenizer_folder)
    masks = masks_along_a_document(tokenizer)
    cases = mask_cases(masks, args.rounds, args.repeats)
    for case in cases:
        print(f"{case['rows']} rows: tensor operations {case['references_ms']:.3f} ms, kernel {case['kernels_ms']:.3f} ms "
              f"({case['kernels_over_references']:.3f})")
    steps = [step_case(model, max(3, args.rounds // 2)) for model in ("tiny", "smollm2")]
    for case in steps:
        print(f"{case['model']}: a step of 64 rows under the schema {case['references_step_ms']:.1f} -> "
              f"{case['kernels_step_ms']:.1f} ms ({case['kernels_over_references']:.3f})")
    worst = max(case["kernels_over_references"] for case in cases)
    results = {
        "meta": kernel_bench.meta(args),
        "document_states": len(masks),
        "masks": cases,
        "structured_scenario": steps,
        "targets": {"kernel_over_tensor_operations_worst": {"value": worst, "target": "<= 1.0", "met": worst <= 1.0}},
    }

    def plot(results: dict, path: Path) -> Path | None:
        cases = results["masks"]
        return paired_bars(path, [f"{c['rows']} row(s)" for c in cases],
                           {"tensor operations": [c["references_ms"] for c in cases],
                            "kernel": [c["kernels_ms"] for c in cases]},
                           "ms per call", f"Grammar masks on SmolLM2's vocabulary ({results['meta']['threads']} threads)")

    write_and_report(results, args.json, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
