"""Starts one router."""

from __future__ import annotations

from services.router.config import RouterConfig
from services.router.service import RouterService
from shared.runtime import run_until_signalled, setup_logging


def main(config: RouterConfig) -> None:
    setup_logging(config.log_level, config.name)
    run_until_signalled(RouterService(config).run())
