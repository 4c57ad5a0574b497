"""llama.cpp as a peer, run under the interpreter that has llama-cpp-python (its own process: two
OpenMP runtimes in one process misbehave). Standard library and llama_cpp only.

    python peers_llama_worker.py MODEL.gguf --threads 2

Reads one JSON request a line on stdin, {"prompts": [[ids]], "new_tokens": n}, and answers each
with one JSON line, {"seconds", "first_token_s", "tokens"}; {"info": true} answers the build's
facts. Streams run together: every stream is a sequence of one llama_batch (n_seq_max streams in
a context), prompts first, then one token per stream per decode, greedy in C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp
from llama_cpp._logger import set_verbose

N_BATCH = 2048  # prompt tokens one llama_decode takes
CTX_ALIGN = 256  # llama.cpp rounds a sequence's context up to this


class Contexts:
    """One context per (streams, tokens per stream): each sized for its workload, kept for the next round."""

    def __init__(self, model, threads: int) -> None:
        self.model, self.threads = model, threads
        self._by_shape: dict[tuple[int, int], object] = {}

    def get(self, streams: int, per_stream: int):
        per_stream = -(-per_stream // CTX_ALIGN) * CTX_ALIGN
        key = (streams, per_stream)
        if key not in self._by_shape:
            params = llama_cpp.llama_context_default_params()
            params.n_ctx = streams * per_stream
            params.n_batch = N_BATCH
            params.n_seq_max = streams
            params.kv_unified = False  # each stream attends over its own cells only
            params.n_threads = params.n_threads_batch = self.threads
            ctx = llama_cpp.llama_init_from_model(self.model, params)
            if ctx is None:
                raise RuntimeError(f"llama.cpp refused a context of {streams} x {per_stream} tokens")
            self._by_shape[key] = ctx
        ctx = self._by_shape[key]
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        return ctx


def fill(batch, entries: list[tuple[int, int, int, bool]]) -> None:
    """entries: (token, position, sequence, wants logits)."""
    batch.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
        batch.seq_id[i][0] = seq


def decode(ctx, batch) -> None:
    status = llama_cpp.llama_decode(ctx, batch)
    if status != 0:
        raise RuntimeError(f"llama_decode returned {status}")


def generate(ctx, batch, sampler, prompts: list[list[int]], new_tokens: int) -> dict:
    start = time.perf_counter()
    tokens: list[list[int]] = [[] for _ in prompts]
    # Prompts, N_BATCH tokens a decode; a prompt's last token asks for logits, sampled from its row.
    entries = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
    for at in range(0, len(entries), N_BATCH):
        chunk = entries[at : at + N_BATCH]
        fill(batch, chunk)
        decode(ctx, batch)
        for row, (_, _, seq, logits) in enumerate(chunk):
            if logits:
                tokens[seq].append(llama_cpp.llama_sampler_sample(sampler, ctx, row))
    first_token_s = time.perf_counter() - start
    for step in range(1, new_tokens):
        fill(batch, [(out[-1], len(p) + step - 1, seq, True) for seq, (p, out) in enumerate(zip(prompts, tokens))])
        decode(ctx, batch)
        for seq, out in enumerate(tokens):
            out.append(llama_cpp.llama_sampler_sample(sampler, ctx, seq))
    return {"seconds": time.perf_counter() - start, "first_token_s": first_token_s, "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_verbose(False)
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), model_params)
    if model is None:
        raise RuntimeError(f"llama.cpp could not load {args.model}")
    contexts = Contexts(model, args.threads)
    sampler = llama_cpp.llama_sampler_init_greedy()
    batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)
    max_streams = llama_cpp.llama_max_parallel_sequences()
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("info"):
            answer = {"llama_cpp": llama_cpp.__version__, "max_streams": max_streams,
                      "system": llama_cpp.llama_print_system_info().decode().strip()}
        else:
            prompts, new_tokens = request["prompts"], request["new_tokens"]
            if len(prompts) > max_streams:
                raise ValueError(f"{len(prompts)} streams: this llama.cpp runs at most {max_streams} together")
            ctx = contexts.get(len(prompts), max(len(p) for p in prompts) + new_tokens)
            answer = generate(ctx, batch, sampler, prompts, new_tokens)
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
