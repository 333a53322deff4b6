"""Observability wiring for one process: the switches and exporter from settings (every epd process),
plus, in the control plane, the pool gauges and the dashboard over the deployment's Redis state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from controlplane.observability import metrics
from controlplane.observability.tracing import setup_tracing

if TYPE_CHECKING:
    from fastapi import APIRouter

    from controlplane.admin import PoolView
    from controlplane.settings import ObservabilitySettings
    from controlplane.state.journal import RequestJournal

log = logging.getLogger(__name__)


def configure_process(settings: ObservabilitySettings, service_name: str) -> bool:
    """Set this process's switches; with tracing on, export spans where OTEL_* says. Returns whether
    spans are exported."""
    metrics.OBSERVABILITY.metrics = settings.metrics
    metrics.OBSERVABILITY.tracing = settings.tracing
    if not settings.tracing:
        return False
    exported = setup_tracing(service_name)
    if exported:
        log.info("tracing: %s exports spans (OTEL_* variables)", service_name)
    return exported


def instrument_control_plane(pools: Callable[[], list[PoolView]], waiting: Callable[[], int],
                             journal: RequestJournal | None,
                             held_for: Callable[[], float] | None = None) -> list[APIRouter]:
    """Pool gauges over ``pools``, the scheduler's queue gauges over ``waiting`` and ``held_for``; returns the
    routers to mount (the dashboard). ``configure_process`` has set the switches and exporter already."""
    from controlplane.api.dashboard import dashboard_router

    metrics.bind_cluster(metrics.PoolsSource(pools), waiting, held_for)
    return [dashboard_router(pools, journal)]


def uninstrument() -> None:
    """Forget the deployment's sources (its Redis is about to close)."""
    metrics.bind_cluster(None)
