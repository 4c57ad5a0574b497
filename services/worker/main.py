"""Starts one worker: loads its model into an engine, then serves requests from Kafka."""

from __future__ import annotations

from services.worker.config import WorkerConfig
from services.worker.generation import GenerationEngine
from services.worker.service import WorkerService
from shared.runtime import run_until_signalled, setup_logging


def build_engine(config: WorkerConfig) -> GenerationEngine:
    if config.model == "echo":
        from services.worker.echo import EchoEngine

        return EchoEngine(delay_ms=config.echo_delay_ms)
    from services.worker.engine.llm_engine import build_llm_engine

    return build_llm_engine(config)


def main(config: WorkerConfig) -> None:
    setup_logging(config.log_level, config.name)
    engine = build_engine(config)
    run_until_signalled(WorkerService(config, engine).run())
