"""The worker's settings (flags, DRIVETRAIN_* environment, profile; see shared/settings.py).

The engine's own settings are a section of them (`engine`), not a copy.
"""

from __future__ import annotations

import os
import secrets
import socket

from services.worker.engine.settings import EngineSettings
from services.worker.kv_link_settings import KVLinkSettings, WorkerRole
from shared.models.spec import ServedModel
from shared.service_settings import MetricsSettings, ServiceSettings
from shared.settings import Section

# Unique per process, also in containers where every process is PID 1: a restarted worker
# must never take its predecessor's claims for its own.
_DEFAULT_NAME = f"worker-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class EchoSettings(Section):
    delay_ms: float = 0.0
    """echo model: sleep per step, to imitate a model's pace"""
    crash_on: str = ""
    """echo model, fault tests only: the process dies on starting a request whose message is exactly this"""
    max_running: int = 0
    """echo model: requests run at once, the rest wait their turn as in a full batch; 0: no limit"""


class WorkerSettings(ServiceSettings, ServedModel):
    """drivetrain worker: consumes chat requests, generates, publishes tokens."""

    worker_id: str = ""
    """unique name of this worker; empty: worker-HOST-PID-RANDOM. Never reuse a dead worker's name"""
    role: WorkerRole = "unified"
    """unified: prefill and decode here; prefill: take requests from Kafka, compute each prompt and its first token, then hand it to a decode worker over the KV link; decode: take handed-off requests from the KV link only"""
    device: str = "auto"
    """cpu | cuda | auto (CUDA when available); the weights' dtype is engine.dtype"""
    token_shards: int = 4
    """token messages per step per edge, keyed apart so routers share a busy edge"""
    max_poll_records: int = 256
    """most requests taken from Kafka in one poll"""
    replay_retention_s: float = 60.0
    """how long a stream's events are kept to replay to a resuming client"""
    drain_timeout_s: float = 20.0
    """on SIGTERM, how long running streams may take to finish; those still running then end with worker_draining"""
    kv_events_interval_s: float = 0.05
    """how often the prefix-cache blocks stored and evicted since the last time go to the kv-events topic, for edges to place requests by; 0 publishes none"""
    echo: EchoSettings = EchoSettings()
    engine: EngineSettings = EngineSettings()
    kv_link: KVLinkSettings = KVLinkSettings()
    metrics: MetricsSettings = MetricsSettings()

    @property
    def name(self) -> str:
        return self.worker_id or _DEFAULT_NAME
