"""The worker's frozen config (flags, DRIVETRAIN_* environment, profile)."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass

from shared.config import CommonConfig, doc


# Unique per process, also in containers where every process is PID 1: a restarted worker
# must never take its predecessor's claims for its own.
_DEFAULT_NAME = f"worker-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    """drivetrain worker: consumes chat requests, generates, publishes tokens."""

    worker_id: str = doc("unique name of this worker (default: host-pid)", "")
    model: str = doc("echo | smollm2 | tiny | llama-1b | llama-8b | path to a Hugging Face folder", "echo")
    echo_delay_ms: float = doc("echo model: sleep per step, to imitate a model's pace", 0.0)
    echo_crash_on: str = doc("echo model, fault tests only: the process dies on starting a request whose message is exactly this", "")
    device: str = doc("cpu | cuda | auto", "auto")
    token_shards: int = doc("token messages per step per edge, keyed apart so routers share a busy edge", 4)
    max_poll_records: int = doc("most requests taken from Kafka in one poll", 256)
    replay_retention_s: float = doc("how long a stream's events are kept to replay to a resuming client", 60.0)
    max_model_len: int = doc("most tokens (prompt + output) per request; 0 = the model's context, at most 8192", 0)
    max_num_seqs: int = doc("most requests in one engine step", 256)
    max_batch_tokens: int = doc("most tokens computed in one engine step; 0 = 512 on a CPU, 8192 on a GPU", 0)
    num_kv_blocks: int = doc("KV cache blocks of 16 tokens; 0 = size the pool from free memory", 0)
    kv_memory_fraction: float = doc("GPU: share of device memory for weights, activations and KV cache", 0.9)
    enable_prefix_caching: bool = doc("reuse the KV of prompt prefixes seen before", True)
    enable_chunked_prefill: bool = doc("split long prompts across steps so decodes keep flowing", True)
    cuda_graphs: bool = doc("GPU: replay decode steps as captured CUDA graphs", True)

    @property
    def name(self) -> str:
        return self.worker_id or _DEFAULT_NAME
