"""Prometheus metrics (vLLM's set, under the ``pagedlm:`` prefix), served at GET /metrics.

A ``StatLoggerBase`` of the engine: ``AsyncLLM`` calls ``record`` after every batch of outputs.
Gauges come from the engine core's latest snapshot; the core's cumulative counters (prefix-cache
lookups, preemptions) are turned into counter increments here. Each server has its own
registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedlm.core.metrics import EngineStatsSnapshot, IterationStats, StatLoggerBase

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class PrometheusStatLogger(StatLoggerBase):
    def __init__(self, model_name: str, num_gpu_blocks: int = 0) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("pagedlm:num_requests_running", "Requests in the running batch (engine requests)")
        self.waiting = gauge("pagedlm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("pagedlm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0..1")
        self.cache_blocks = gauge("pagedlm:num_gpu_blocks", "KV-cache blocks allocated at start-up")
        self.prefix_queries = counter("pagedlm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("pagedlm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("pagedlm:num_preemptions", "Preemptions (recomputes) by the scheduler")
        self.prompt_tokens = counter("pagedlm:prompt_tokens", "Prompt tokens processed (prefills completed)")
        self.generation_tokens = counter("pagedlm:generation_tokens", "Tokens generated")
        self.request_success = counter("pagedlm:request_success", "Finished requests, by finish reason",
                                       ("finished_reason",))
        self.ttft = histogram("pagedlm:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = histogram("pagedlm:inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS)
        self.e2e = histogram("pagedlm:e2e_request_latency_seconds", "Arrival to last token", _E2E_BUCKETS)

        self.model_name = model_name
        lbl = {"model_name": model_name}
        self._l = lbl
        self.cache_blocks.labels(**lbl).set(num_gpu_blocks)
        # Create every labelled child now, so each series is exported (as 0) before its first event.
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                       self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            metric.labels(**lbl)
        for reason in FINISH_REASONS:
            self.request_success.labels(finished_reason=reason, **lbl)
        self._last = EngineStatsSnapshot()

    def record(self, engine_stats: EngineStatsSnapshot | None, iteration_stats: IterationStats | None) -> None:
        lbl = self._l
        if engine_stats is not None:
            self.running.labels(**lbl).set(engine_stats.num_running_reqs)
            self.waiting.labels(**lbl).set(engine_stats.num_waiting_reqs)
            self.kv_usage.labels(**lbl).set(engine_stats.kv_cache_usage)
            last = self._last
            for counter, new, old in (
                (self.prefix_queries, engine_stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.prefix_hits, engine_stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.preemptions, engine_stats.num_preemptions, last.num_preemptions),
            ):
                # A total that went down was reset in the core: everything since counts.
                delta = new - old if new >= old else new
                if delta > 0:
                    counter.labels(**lbl).inc(delta)
            self._last = engine_stats
        if iteration_stats is not None:
            if iteration_stats.num_prompt_tokens:
                self.prompt_tokens.labels(**lbl).inc(iteration_stats.num_prompt_tokens)
            if iteration_stats.num_generation_tokens:
                self.generation_tokens.labels(**lbl).inc(iteration_stats.num_generation_tokens)
            for value in iteration_stats.time_to_first_tokens:
                self.ttft.labels(**lbl).observe(value)
            for value in iteration_stats.inter_token_latencies:
                self.itl.labels(**lbl).observe(value)
            for finished in iteration_stats.finished_requests:
                self.request_success.labels(finished_reason=finished.finish_reason, **lbl).inc()
                self.e2e.labels(**lbl).observe(finished.e2e_latency)
