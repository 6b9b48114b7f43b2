"""Serving statistics: what the engine core reports and what the front end measures per step.

Two sources feed the stat loggers (``pagedlm.core.metrics.loggers``):
  * ``EngineStatsSnapshot`` — the scheduler's state, read in the engine-core process after every
    step (and after an abort while idle), so that gauges such as KV usage drop to zero at once;
  * ``IterationStats`` — measured by the front end from the outputs it receives: tokens per step,
    time to first token, inter-token latency and finished requests. ``RequestStatsTracker`` keeps
    the per-request timestamps these need.
Times are ``time.monotonic()`` seconds in the front-end process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.core.engine.core import EngineCore
    from pagedlm.core.sched import EngineCoreOutput


@dataclass
class EngineStatsSnapshot:
    """Scheduler and KV-cache state at one instant. Counters are totals since engine start."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by at least one request, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0

    @classmethod
    def from_engine_core(cls, core: EngineCore) -> EngineStatsSnapshot:
        sched = core.scheduler
        kv = sched.kv_cache_manager
        return cls(
            num_running_reqs=len(sched.running),
            num_waiting_reqs=len(sched.waiting),
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_stats.num_queries_tokens,
            prefix_cache_hits=kv.prefix_cache_stats.num_hit_tokens,
            num_preemptions=sched.num_preemptions_total,
        )


@dataclass
class FinishedRequestStats:
    finish_reason: str  # stop, length, abort or error
    e2e_latency: float  # seconds from arrival in the front end to the last output
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one batch of engine outputs meant for the requests in it."""

    num_prompt_tokens: int = 0  # prompts whose first output token arrived in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _RequestTimes:
    arrival: float
    num_prompt_tokens: int
    child_ids: list[str]
    first_token: float | None = None
    num_generation_tokens: int = 0
    last_token: dict[str, float] = field(default_factory=dict)  # per engine (child) request


class RequestStatsTracker:
    """Per-request timestamps in the front end; turns engine outputs into ``IterationStats``."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}
        self._parent_of: dict[str, str] = {}

    def add(self, request_id: str, child_ids: list[str], num_prompt_tokens: int,
            arrival: float | None = None) -> None:
        self._requests[request_id] = _RequestTimes(arrival if arrival is not None else time.monotonic(),
                                                   num_prompt_tokens, list(child_ids))
        for child_id in child_ids:
            self._parent_of[child_id] = request_id

    def on_outputs(self, outputs: list[EngineCoreOutput], now: float, stats: IterationStats) -> None:
        for out in outputs:
            parent = self._parent_of.get(out.request_id)
            times = self._requests.get(parent) if parent is not None else None
            if times is None or not out.new_token_ids:
                continue
            num = len(out.new_token_ids)
            stats.num_generation_tokens += num
            times.num_generation_tokens += num
            if times.first_token is None:
                times.first_token = now
                stats.num_prompt_tokens += times.num_prompt_tokens
                stats.time_to_first_tokens.append(now - times.arrival)
            previous = times.last_token.get(out.request_id)
            if previous is not None:
                stats.inter_token_latencies.append(now - previous)
            times.last_token[out.request_id] = now

    def finish(self, request_id: str, finish_reason: str, now: float, stats: IterationStats) -> None:
        times = self._requests.pop(request_id, None)
        if times is None:
            return
        for child_id in times.child_ids:
            self._parent_of.pop(child_id, None)
        stats.finished_requests.append(FinishedRequestStats(
            finish_reason=finish_reason, e2e_latency=now - times.arrival,
            num_prompt_tokens=times.num_prompt_tokens, num_generation_tokens=times.num_generation_tokens,
        ))

    def __len__(self) -> int:
        return len(self._requests)
