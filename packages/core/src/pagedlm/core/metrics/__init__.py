"""Serving statistics (engine snapshots, per-step stats) and the loggers that consume them."""

from pagedlm.core.metrics.loggers import LoggingStatLogger, StatLoggerBase
from pagedlm.core.metrics.stats import (
    EngineStatsSnapshot,
    FinishedRequestStats,
    IterationStats,
    RequestStatsTracker,
)

__all__ = [
    "EngineStatsSnapshot",
    "FinishedRequestStats",
    "IterationStats",
    "LoggingStatLogger",
    "RequestStatsTracker",
    "StatLoggerBase",
]
