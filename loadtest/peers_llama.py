"""llama.cpp as a peer, from this side: one worker process per GGUF file (peers_llama_worker.py,
under the interpreter that has llama-cpp-python), asked one workload at a time over a pipe."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from peers_workloads import Run

WORKER = Path(__file__).resolve().parent / "peers_llama_worker.py"
CONCURRENCY_NOTE = "llama.cpp: batched (every stream a sequence of one llama_batch, n_seq_max = streams, per-stream KV)"


def llama_python_problem(python: Path) -> str | None:
    """Why this interpreter cannot run the llama.cpp peer, or None when it can."""
    if not python.exists():
        return f"{python} does not exist (make peers builds it)"
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"{python} cannot import llama_cpp: {probe.stderr.strip().splitlines()[-1:]}"
    return None


class LlamaPeer:
    def __init__(self, name: str, python: Path, gguf: Path, threads: int) -> None:
        self.name = name
        self.gguf = gguf
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self._process = subprocess.Popen(
            [str(python), str(WORKER), str(gguf), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        self.info = self._ask({"info": True})

    def _ask(self, request: dict) -> dict:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()  # the worker answers every line or dies (then: EOF)
        if not line:
            raise RuntimeError(f"the llama.cpp worker for {self.gguf.name} exited ({self._process.wait()})")
        return json.loads(line)

    def run(self, prompts: list[list[int]], new_tokens: int) -> Run:
        answer = self._ask({"prompts": prompts, "new_tokens": new_tokens})
        return Run(answer["seconds"], answer["first_token_s"], answer["tokens"])

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
