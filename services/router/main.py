"""Starts one router."""

from __future__ import annotations

from services.router.service import RouterService
from services.router.settings import RouterSettings
from shared.health import Health, Lifecycle
from shared.runtime import run_until_signalled, setup_logging

STOP_BACKSTOP_S = 10.0  # the batch in hand, a last commit, leaving the group and gossip


def main(settings: RouterSettings) -> None:
    setup_logging(settings.log_level, settings.name)
    health = Health("router", settings.name)
    run_until_signalled(
        RouterService(settings, health).run,
        on_signal=lambda: health.set(Lifecycle.DRAINING),
        backstop_s=STOP_BACKSTOP_S,
        loop_factory=settings.event_loop.factory(),
    )
