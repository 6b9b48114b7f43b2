"""``LLM.get_metrics()``: the engine's metrics as plain values, with vLLM's reader types.

vLLM users read them as ``from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector``
(here also ``pagedlm.core.v1.metrics.reader``). Names are the server's ``/metrics`` series
(``pagedlm:`` and vLLM's name after it); counters and histograms are totals since engine start.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.core.metrics.buckets import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TTFT_BUCKETS,
    token_buckets,
)
from pagedlm.core.metrics.loggers import StatLoggerBase
from pagedlm.core.metrics.stats import EngineStatsSnapshot, IterationStats

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "MetricsCollector", "Vector"]

PREFIX = "pagedlm:"
FINISH_REASONS = ("stop", "length", "abort", "error")
#: seconds; the buckets of vLLM's time-to-first-token histogram (kept for existing importers)
LATENCY_BUCKETS = TTFT_BUCKETS


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    #: upper bound (``"+Inf"`` last) -> observations at or below it (cumulative, as Prometheus)
    buckets: dict[str, int]


class _Distribution:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.count = 0
        self.sum = 0.0
        self.below = [0] * (len(bounds) + 1)

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.below[i] += 1
        self.below[-1] += 1

    def as_metric(self, name: str, labels: dict[str, str]) -> Histogram:
        bounds = [str(float(b)) for b in self.bounds] + ["+Inf"]
        return Histogram(name, labels, self.count, self.sum, dict(zip(bounds, self.below, strict=True)))


class MetricsCollector(StatLoggerBase):
    """Accumulates what the engine records (a stat logger) into :meth:`metrics`: the series of the
    server's /metrics that a single engine has (gauges, token and request counters, and the
    per-request histograms with vLLM's buckets)."""

    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        self.labels = {"model_name": model_name}
        self.engine = EngineStatsSnapshot()
        self.prompt_tokens = self.generation_tokens = self.cached_prompt_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        tokens = token_buckets(max_model_len)
        self.histograms = {name: _Distribution(bounds) for name, bounds in (
            ("time_to_first_token_seconds", TTFT_BUCKETS), ("inter_token_latency_seconds", ITL_BUCKETS),
            ("e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
            ("request_queue_time_seconds", REQUEST_LATENCY_BUCKETS),
            ("request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS),
            ("request_decode_time_seconds", REQUEST_LATENCY_BUCKETS),
            ("request_inference_time_seconds", REQUEST_LATENCY_BUCKETS),
            ("request_time_per_output_token_seconds", ITL_BUCKETS),
            ("request_prompt_tokens", tokens), ("request_generation_tokens", tokens),
            ("request_params_max_tokens", tokens), ("request_max_num_generation_tokens", tokens),
            ("request_params_n", REQUEST_PARAMS_N_BUCKETS), ("iteration_tokens_total", ITERATION_TOKENS_BUCKETS),
            ("request_num_preemptions", REQUEST_NUM_PREEMPTIONS_BUCKETS))}

    # kept for code that reads them by attribute
    @property
    def ttft(self) -> _Distribution:
        return self.histograms["time_to_first_token_seconds"]

    @property
    def itl(self) -> _Distribution:
        return self.histograms["inter_token_latency_seconds"]

    @property
    def e2e(self) -> _Distribution:
        return self.histograms["e2e_request_latency_seconds"]

    def record(self, engine_stats: EngineStatsSnapshot | None, iteration_stats: IterationStats | None) -> None:
        if engine_stats is not None:
            self.engine = engine_stats
        if iteration_stats is None:
            return
        it, h = iteration_stats, self.histograms
        self.prompt_tokens += it.num_prompt_tokens
        self.cached_prompt_tokens += it.num_cached_prompt_tokens
        self.generation_tokens += it.num_generation_tokens
        for name, values in (("time_to_first_token_seconds", it.time_to_first_tokens),
                             ("inter_token_latency_seconds", it.inter_token_latencies),
                             ("iteration_tokens_total", it.iteration_tokens), ("request_params_n", it.n_params),
                             ("request_max_num_generation_tokens", it.max_num_generation_tokens)):
            for value in values:
                h[name].observe(value)
        for done in it.finished_requests:
            self.finished[done.finish_reason] = self.finished.get(done.finish_reason, 0) + 1
            h["e2e_request_latency_seconds"].observe(done.e2e_latency)
            if done.has_phase_times:
                h["request_queue_time_seconds"].observe(done.queued_time)
                h["request_prefill_time_seconds"].observe(done.prefill_time)
                h["request_decode_time_seconds"].observe(done.decode_time)
                h["request_inference_time_seconds"].observe(done.inference_time)
            h["request_time_per_output_token_seconds"].observe(done.mean_time_per_output_token)
            h["request_prompt_tokens"].observe(done.num_prompt_tokens)
            h["request_generation_tokens"].observe(done.num_generation_tokens)
            h["request_num_preemptions"].observe(done.num_preemptions)
            if done.max_tokens_param:
                h["request_params_max_tokens"].observe(done.max_tokens_param)

    def metrics(self) -> list[Metric]:
        e, lbl = self.engine, self.labels
        out: list[Metric] = [
            Gauge(PREFIX + "num_requests_running", dict(lbl), float(e.num_running_reqs)),
            Gauge(PREFIX + "num_requests_waiting", dict(lbl), float(e.num_waiting_reqs)),
            Gauge(PREFIX + "kv_cache_usage_perc", dict(lbl), e.kv_cache_usage),
            Counter(PREFIX + "num_preemptions", dict(lbl), e.num_preemptions),
            Counter(PREFIX + "prefix_cache_queries", dict(lbl), e.prefix_cache_queries),
            Counter(PREFIX + "prefix_cache_hits", dict(lbl), e.prefix_cache_hits),
            Counter(PREFIX + "external_prefix_cache_queries", dict(lbl), e.external_prefix_cache_queries),
            Counter(PREFIX + "external_prefix_cache_hits", dict(lbl), e.external_prefix_cache_hits),
            Counter(PREFIX + "prompt_tokens", dict(lbl), self.prompt_tokens),
            Counter(PREFIX + "prompt_tokens_cached", dict(lbl), self.cached_prompt_tokens),
            Counter(PREFIX + "generation_tokens", dict(lbl), self.generation_tokens),
        ]
        if e.spec_decode_num_accepted_tokens_per_pos:  # speculative decoding is on
            out += [
                Counter(PREFIX + "spec_decode_num_drafts", dict(lbl), e.spec_decode_num_drafts),
                Counter(PREFIX + "spec_decode_num_draft_tokens", dict(lbl), e.spec_decode_num_draft_tokens),
                Counter(PREFIX + "spec_decode_num_accepted_tokens", dict(lbl), e.spec_decode_num_accepted_tokens),
                Vector(PREFIX + "spec_decode_num_accepted_tokens_per_pos", dict(lbl),
                       list(e.spec_decode_num_accepted_tokens_per_pos)),
            ]
        out += [Counter(PREFIX + "request_success", {**lbl, "finished_reason": reason}, count)
                for reason, count in self.finished.items()]
        out += [dist.as_metric(PREFIX + name, dict(lbl)) for name, dist in self.histograms.items()]
        return out
