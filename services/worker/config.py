"""The worker's frozen config (flags, DRIVETRAIN_* environment, profile)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from shared.config import CommonConfig, doc


@dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    """drivetrain worker: consumes chat requests, generates, publishes tokens."""

    worker_id: str = doc("unique name of this worker (default: host-pid)", "")
    model: str = doc("echo | smollm2 | tiny | llama-1b | llama-8b | path to a Hugging Face folder", "echo")
    echo_delay_ms: float = doc("echo model: sleep per step, to imitate a model's pace", 0.0)
    device: str = doc("cpu | cuda | auto", "auto")
    max_poll_records: int = doc("most requests taken from Kafka in one poll", 256)

    @property
    def name(self) -> str:
        return self.worker_id or f"worker-{socket.gethostname()}-{os.getpid()}"
