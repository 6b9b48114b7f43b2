"""Stat loggers: sinks for the engine snapshots and per-step stats that ``AsyncLLM`` collects.

A logger gets ``record(...)`` after every batch of engine outputs (keep it cheap: it runs on the
event loop) and ``log()`` every ``log_interval_s`` seconds from a timer. The Prometheus logger of
pagedlm-server implements the same interface.
"""

from __future__ import annotations

import time

from pagedlm.core.logger import init_logger
from pagedlm.core.metrics.stats import EngineStatsSnapshot, IterationStats
from pagedlm.core.spec_decode.metrics import format_spec_decode_log

logger = init_logger("pagedlm.core.metrics")


class StatLoggerBase:
    def record(self, engine_stats: EngineStatsSnapshot | None, iteration_stats: IterationStats | None) -> None:
        """Called after every batch of engine outputs (``engine_stats`` is the newest snapshot)."""

    def log(self) -> None:
        """Called periodically; loggers that only accumulate (Prometheus) need not implement it."""


class LoggingStatLogger(StatLoggerBase):
    """One INFO line per interval while the engine is busy, plus one when it turns idle.

    Throughputs are averaged over the interval; the prefix-cache hit rate is over the prompt
    tokens looked up during the interval.
    """

    def __init__(self) -> None:
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._stats: EngineStatsSnapshot | None = None
        self._last_logged: EngineStatsSnapshot | None = None
        self._was_busy = False

    def record(self, engine_stats: EngineStatsSnapshot | None, iteration_stats: IterationStats | None) -> None:
        if engine_stats is not None:
            self._stats = engine_stats
        if iteration_stats is not None:
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        stats = self._stats or EngineStatsSnapshot()
        busy = bool(stats.num_running_reqs or stats.num_waiting_reqs or self._prompt_tokens
                    or self._generation_tokens)
        if busy or self._was_busy:
            last = self._last_logged or EngineStatsSnapshot()
            queries = stats.prefix_cache_queries - last.prefix_cache_queries
            hits = stats.prefix_cache_hits - last.prefix_cache_hits
            hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
            logger.info(
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Avg prompt throughput: %.1f tokens/s, "
                "Avg generation throughput: %.1f tokens/s, Prefix cache hit rate: %.1f%%",
                stats.num_running_reqs, stats.num_waiting_reqs, 100.0 * stats.kv_cache_usage,
                self._prompt_tokens / elapsed, self._generation_tokens / elapsed, hit_rate,
            )
            if stats.spec_decode_num_accepted_tokens_per_pos:
                old_pos = last.spec_decode_num_accepted_tokens_per_pos or [0] * len(
                    stats.spec_decode_num_accepted_tokens_per_pos)
                logger.info("%s", format_spec_decode_log(
                    stats.spec_decode_num_drafts - last.spec_decode_num_drafts,
                    stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens,
                    stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens,
                    [a - b for a, b in zip(stats.spec_decode_num_accepted_tokens_per_pos, old_pos, strict=True)]))
            self._last_logged = stats
        self._was_busy = busy
        self._last_time = now
        self._prompt_tokens = self._generation_tokens = 0
