"""``LLM.get_metrics()``: the engine's metrics as plain values, with vLLM's reader types.

vLLM users read them as ``from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector``
(here also ``pagedlm.core.v1.metrics.reader``). Names are the server's ``/metrics`` series
(``pagedlm:`` and vLLM's name after it); counters and histograms are totals since engine start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlm.core.metrics.loggers import StatLoggerBase
from pagedlm.core.metrics.stats import EngineStatsSnapshot, IterationStats

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "MetricsCollector", "Vector"]

PREFIX = "pagedlm:"
FINISH_REASONS = ("stop", "length", "abort", "error")
#: seconds; the buckets of vLLM's latency histograms, shortened
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


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


@dataclass
class _Distribution:
    count: int = 0
    sum: float = 0.0
    below: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(LATENCY_BUCKETS):
            if value <= bound:
                self.below[i] += 1
        self.below[-1] += 1

    def as_metric(self, name: str, labels: dict[str, str]) -> Histogram:
        bounds = [str(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        return Histogram(name, labels, self.count, self.sum, dict(zip(bounds, self.below, strict=True)))


class MetricsCollector(StatLoggerBase):
    """Accumulates what the engine records (a stat logger) into :meth:`metrics`."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.engine = EngineStatsSnapshot()
        self.prompt_tokens = self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft, self.itl, self.e2e = _Distribution(), _Distribution(), _Distribution()

    def record(self, engine_stats: EngineStatsSnapshot | None, iteration_stats: IterationStats | None) -> None:
        if engine_stats is not None:
            self.engine = engine_stats
        if iteration_stats is None:
            return
        self.prompt_tokens += iteration_stats.num_prompt_tokens
        self.generation_tokens += iteration_stats.num_generation_tokens
        for value in iteration_stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration_stats.inter_token_latencies:
            self.itl.observe(value)
        for finished in iteration_stats.finished_requests:
            self.finished[finished.finish_reason] = self.finished.get(finished.finish_reason, 0) + 1
            self.e2e.observe(finished.e2e_latency)

    def metrics(self) -> list[Metric]:
        e, lbl = self.engine, self.labels
        out: list[Metric] = [
            Gauge(PREFIX + "num_requests_running", dict(lbl), float(e.num_running_reqs)),
            Gauge(PREFIX + "num_requests_waiting", dict(lbl), float(e.num_waiting_reqs)),
            Gauge(PREFIX + "kv_cache_usage_perc", dict(lbl), e.kv_cache_usage),
            Counter(PREFIX + "num_preemptions", dict(lbl), e.num_preemptions),
            Counter(PREFIX + "prefix_cache_queries", dict(lbl), e.prefix_cache_queries),
            Counter(PREFIX + "prefix_cache_hits", dict(lbl), e.prefix_cache_hits),
            Counter(PREFIX + "prompt_tokens", dict(lbl), self.prompt_tokens),
            Counter(PREFIX + "generation_tokens", dict(lbl), self.generation_tokens),
        ]
        out += [Counter(PREFIX + "request_success", {**lbl, "finished_reason": reason}, count)
                for reason, count in self.finished.items()]
        out += [
            self.ttft.as_metric(PREFIX + "time_to_first_token_seconds", dict(lbl)),
            self.itl.as_metric(PREFIX + "inter_token_latency_seconds", dict(lbl)),
            self.e2e.as_metric(PREFIX + "e2e_request_latency_seconds", dict(lbl)),
        ]
        return out
