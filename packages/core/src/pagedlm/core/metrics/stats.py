"""Serving statistics: what the engine core reports and what the front end measures per step.

Two sources feed the stat loggers (``pagedlm.core.metrics.loggers``):
  * ``EngineStatsSnapshot`` — the scheduler's state, read in the engine-core process after every
    step (and after an abort while idle), so that gauges such as KV usage drop to zero at once;
  * ``IterationStats`` — measured by the front end from the outputs it receives: tokens per step,
    time to first token, inter-token latency and finished requests with their phase times.
    ``RequestStatsTracker`` keeps the per-request timestamps these need; the core adds its queue
    and first-schedule times to a request's first output (``EngineCoreOutput.timing``) and each
    batch of outputs carries the time it was sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    #: LoRA (vLLM's lora_requests_info): adapter name -> running / waiting requests; max_loras (0: off)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    max_lora: int = 0
    external_prefix_cache_queries: int = 0  # prompt tokens looked up through the KV connector
    external_prefix_cache_hits: int = 0  # of those, tokens it loaded
    #: speculative decoding (spec_decode/metrics.py), totals; all 0 (and no positions) when off
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def from_engine_core(cls, core: EngineCore) -> EngineStatsSnapshot:
        sched = core.scheduler
        kv = sched.kv_cache_manager
        gate = sched.lora_gate
        lora = {} if gate is None else {"running_lora_adapters": gate.adapter_counts(sched.running),
                                        "waiting_lora_adapters": gate.adapter_counts(sched.waiting),
                                        "max_lora": gate.max_loras}
        spec = sched.spec.stats if sched.spec is not None else None
        return cls(
            **lora,
            num_running_reqs=len(sched.running),
            num_waiting_reqs=len(sched.waiting),
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_stats.num_queries_tokens,
            prefix_cache_hits=kv.prefix_cache_stats.num_hit_tokens,
            num_preemptions=sched.num_preemptions_total,
            **_external_prefix_cache(sched),
            **({} if spec is None else {
                "spec_decode_num_drafts": spec.num_drafts, "spec_decode_num_draft_tokens": spec.num_draft_tokens,
                "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(spec.num_accepted_tokens_per_pos)}),
        )


def _external_prefix_cache(sched: Any) -> dict[str, int]:
    kvt = sched.kv_transfer
    if kvt is None:
        return {}
    return {"external_prefix_cache_queries": kvt.stats.num_queries_tokens,
            "external_prefix_cache_hits": kvt.stats.num_hit_tokens}


@dataclass
class FinishedRequestStats:
    """One finished engine request (a choice of a request with ``n > 1``), as vLLM counts them."""

    finish_reason: str  # stop, length, abort or error
    e2e_latency: float  # seconds from arrival in the front end to the last output
    num_prompt_tokens: int
    num_generation_tokens: int
    #: whether the core's timing arrived (not for a request aborted before its first token): the
    #: phase times below are then meaningful
    has_phase_times: bool = False
    queued_time: float = 0.0  # queued in the core -> first scheduled
    prefill_time: float = 0.0  # first scheduled -> first token
    decode_time: float = 0.0  # first token -> last token
    inference_time: float = 0.0  # first scheduled -> last token
    mean_time_per_output_token: float = 0.0  # decode time / (tokens - 1)
    num_preemptions: int = 0
    max_tokens_param: int | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclass
class IterationStats:
    """What one batch of engine outputs meant for the requests in it."""

    num_prompt_tokens: int = 0  # prompts whose first output token arrived in this batch
    num_cached_prompt_tokens: int = 0  # of those, tokens found in the prefix cache
    num_generation_tokens: int = 0
    #: per engine step of the batch that produced tokens: prompt tokens computed (cache hits
    #: excluded) for requests whose first token came, plus tokens generated
    iteration_tokens: list[int] = field(default_factory=list)
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    #: per user request whose last choice finished: its n, and the most tokens one choice made
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)


@dataclass
class _Parent:
    n: int
    max_tokens: int | None
    child_ids: list[str]
    num_open: int
    max_generated: int = 0


@dataclass
class _Child:
    parent_id: str
    parent: _Parent
    arrival: float  # front end, monotonic
    num_prompt_tokens: int
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # core wall-clock times (time.time() in the engine-core process)
    queued: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float = 0.0


class RequestStatsTracker:
    """Per-request timestamps in the front end; turns engine outputs into ``IterationStats``.

    Tracks every engine request (each choice of a request with ``n > 1``) as vLLM does: time to
    first token, inter-token latencies, token counts and the phase times (queue, prefill, decode,
    inference) are per engine request; ``n`` and the most tokens of one choice per user request.
    Phase times and inter-token latencies use the core's clock (its queue and schedule times
    and the time of each batch of outputs); time to first token and end-to-end latency the front
    end's, from the arrival of the request.
    """

    def __init__(self) -> None:
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}

    def add(self, request_id: str, child_ids: list[str], num_prompt_tokens: int, arrival: float | None = None,
            *, n: int = 1, max_tokens: int | None = None) -> None:
        arrival = arrival if arrival is not None else time.monotonic()
        parent = _Parent(n=n, max_tokens=max_tokens, child_ids=list(child_ids), num_open=len(child_ids))
        self._parents[request_id] = parent
        for child_id in child_ids:
            self._children[child_id] = _Child(request_id, parent, arrival, num_prompt_tokens)

    def on_outputs(self, outputs: list[EngineCoreOutput], now: float, stats: IterationStats,
                   core_time: float | None = None) -> None:
        """One engine step's outputs; ``core_time``: when the core sent them (its wall clock)."""
        core_time = core_time if core_time is not None else time.time()
        step_tokens = 0
        children = self._children
        for out in outputs:
            child = children.get(out.request_id)
            if child is None:
                continue
            if out.timing is not None and child.scheduled is None:
                child.queued, child.scheduled = out.timing
            child.num_preemptions = out.num_preemptions
            num = len(out.new_token_ids)
            if num:
                stats.num_generation_tokens += num
                child.num_generation_tokens += num
                step_tokens += num
                if child.first_token is None:
                    child.first_token = core_time
                    cached = min(out.num_cached_tokens, child.num_prompt_tokens)
                    child.num_cached_tokens = cached
                    stats.num_prompt_tokens += child.num_prompt_tokens
                    stats.num_cached_prompt_tokens += cached
                    step_tokens += child.num_prompt_tokens - cached
                    stats.time_to_first_tokens.append(now - child.arrival)
                else:
                    stats.inter_token_latencies.append(core_time - child.last_token)
                child.last_token = core_time
            if out.finish_reason is not None:
                self._finish(out.request_id, out.finish_reason, now, stats)
        if step_tokens:
            stats.iteration_tokens.append(step_tokens)

    def finish_children(self, child_ids: list[str], finish_reason: str, now: float, stats: IterationStats) -> None:
        """Engine requests the front end ended (e.g. a stop string matched)."""
        for child_id in child_ids:
            self._finish(child_id, finish_reason, now, stats)

    def finish(self, request_id: str, finish_reason: str, now: float, stats: IterationStats) -> None:
        """A user request ended: its engine requests still open end with ``finish_reason``."""
        parent = self._parents.get(request_id)
        if parent is None:
            return
        for child_id in parent.child_ids:
            self._finish(child_id, finish_reason, now, stats)

    def _finish(self, child_id: str, finish_reason: str, now: float, stats: IterationStats) -> None:
        child = self._children.pop(child_id, None)
        if child is None:
            return
        done = FinishedRequestStats(
            finish_reason=finish_reason, e2e_latency=now - child.arrival, num_prompt_tokens=child.num_prompt_tokens,
            num_generation_tokens=child.num_generation_tokens, num_preemptions=child.num_preemptions,
            max_tokens_param=child.parent.max_tokens, num_cached_tokens=child.num_cached_tokens,
        )
        if child.scheduled is not None and child.queued is not None and child.first_token is not None:
            done.has_phase_times = True
            done.queued_time = max(child.scheduled - child.queued, 0.0)
            done.prefill_time = max(child.first_token - child.scheduled, 0.0)
            done.decode_time = max(child.last_token - child.first_token, 0.0)
            done.inference_time = max(child.last_token - child.scheduled, 0.0)
            if child.num_generation_tokens > 1:
                done.mean_time_per_output_token = done.decode_time / (child.num_generation_tokens - 1)
        stats.finished_requests.append(done)
        parent = child.parent
        parent.num_open -= 1
        parent.max_generated = max(parent.max_generated, child.num_generation_tokens)
        if parent.num_open <= 0:
            self._parents.pop(child.parent_id, None)
            stats.n_params.append(parent.n)
            stats.max_num_generation_tokens.append(parent.max_generated)

    def __len__(self) -> int:
        return len(self._parents)
