"""Prometheus metrics: vLLM's metric set, served at GET /metrics.

Names are vLLM's after a prefix: ``pagedlm:`` by default, ``vllm:`` with ``--metrics-prefix vllm``
(so that vLLM's Grafana dashboards and alerts work unchanged). Every series carries vLLM's labels
``model_name`` and ``engine`` (always ``"0"``: the front end reports for all replicas).

A ``StatLoggerBase`` of the engine: ``AsyncLLM`` calls ``record`` after every batch of outputs.
Gauges come from the engine core's latest snapshot; the core's cumulative counters (prefix-cache
lookups, preemptions) are turned into counter increments here; per-request histograms come from
the front end's ``IterationStats``. Each server has its own registry, so several apps in one
process (tests) do not collide. Series for features pagedlm does not have (an external KV
connector, a multimodal cache, sleep mode, admission queues) are exported as vLLM exports them
when idle: 0, or the "awake" state.
"""

from __future__ import annotations

import bisect
from collections import Counter as Tally
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedlm.core.metrics import EngineStatsSnapshot, IterationStats, StatLoggerBase
from pagedlm.core.metrics.buckets import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TTFT_BUCKETS,
    token_buckets,
)

#: what --metrics-prefix accepts
PREFIXES = {"pagedlm": "pagedlm:", "vllm": "vllm:"}
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


class PrometheusStatLogger(StatLoggerBase):
    def __init__(self, model_name: str, num_gpu_blocks: int = 0, *, prefix: str = "pagedlm:",
                 max_model_len: int = 8192, cache_config: Mapping[str, object] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.prefix = prefix
        self.labels = lbl = {"model_name": model_name, "engine": "0"}
        names = list(lbl)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, names, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, names, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, names, buckets=buckets, registry=r)

        def by(metric: Counter | Gauge, key: str, values: tuple[str, ...]) -> dict[str, Counter | Gauge]:
            return {v: metric.labels(**lbl, **{key: v}) for v in values}

        # scheduler state and the KV cache
        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting_by_reason = by(Gauge(prefix + "num_requests_waiting_by_reason",
                                          "Number of waiting requests by reason: 'capacity' = waiting for "
                                          "scheduling capacity; 'deferred' = deferred by transient constraints.",
                                          names + ["reason"], registry=r), "reason", ("capacity", "deferred"))
        sleep = Gauge(prefix + "engine_sleep_state", "Engine sleep state (awake = 1: the engine runs; pagedlm "
                      "has no sleep mode).", names + ["sleep_state"], registry=r)
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.labels(**lbl, sleep_state=state).set(value)
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.cache_blocks = gauge("num_gpu_blocks", "KV-cache blocks allocated at start-up (pagedlm's).")
        self._cache_config = {str(k): str(v) for k, v in (cache_config or {}).items()}
        self._block_size = int(self._cache_config.get("block_size", "16"))
        self._max_model_len = max_model_len
        #: vLLM's lora_requests_info, made on the first snapshot of an engine with LoRA
        self._lora_info: Gauge | None = None
        self._cache_info = Gauge(prefix + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                 [*self._cache_config, "num_gpu_blocks", "kv_cache_size_tokens",
                                  "kv_cache_max_concurrency", "engine"], registry=r)
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.external_queries = counter("external_prefix_cache_queries", "External prefix cache queries from the "
                                        "KV connector, in terms of number of queried tokens.")
        self.external_hits = counter("external_prefix_cache_hits", "External prefix cache hits from the KV "
                                     "connector, in terms of number of cached tokens.")
        idle = [counter(name, "Multi-modal cache items: always 0, pagedlm serves text models.")
                 for name in ("mm_cache_queries", "mm_cache_hits")]
        # counters of tokens and requests
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = by(Counter(prefix + "prompt_tokens_by_source", "Number of prompt tokens by source.",
                                           names + ["source"], registry=r), "source", PROMPT_SOURCES)
        self.prompt_cached = counter("prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self.cached_by_source = by(Counter(prefix + "prompt_tokens_cached_by_source", "Prefix-cache hit tokens by "
                                           "the cache tier that supplied them.", names + ["source"], registry=r),
                                   "source", CACHE_HIT_SOURCES)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = by(Counter(prefix + "request_success", "Count of successfully processed requests.",
                                          names + ["finished_reason"], registry=r), "finished_reason", FINISH_REASONS)
        admission = Counter(prefix + "admission_rejections", "Number of admission attempts rejected by a queue "
                            "limit, by reason (pagedlm has no such queue: 0).", ["model_name", "reason"], registry=r)
        for reason in ADMISSION_REASONS:
            admission.labels(model_name=model_name, reason=reason)
        # histograms
        tokens = token_buckets(max_model_len)
        self.h_prompt = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.h_generation = histogram("request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.h_iteration = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKENS_BUCKETS)
        self.h_max_generation = histogram("request_max_num_generation_tokens",
                                          "Histogram of maximum number of requested generation tokens.", tokens)
        self.h_n = histogram("request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS)
        self.h_max_tokens = histogram("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                      tokens)
        self.h_ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                TTFT_BUCKETS)
        self.h_itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                               ITL_BUCKETS)
        self.h_tpot = histogram("request_time_per_output_token_seconds",
                                "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.h_e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               REQUEST_LATENCY_BUCKETS)
        self.h_queue = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
                                 "request.", REQUEST_LATENCY_BUCKETS)
        self.h_inference = histogram("request_inference_time_seconds", "Histogram of time spent in RUNNING phase "
                                     "for request.", REQUEST_LATENCY_BUCKETS)
        self.h_prefill = histogram("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                                   "request.", REQUEST_LATENCY_BUCKETS)
        self.h_decode = histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                                  "request.", REQUEST_LATENCY_BUCKETS)
        self.h_preemptions = histogram("request_num_preemptions", "Histogram of the number of times a request was "
                                       "preempted.", REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.h_prefill_kv = histogram("request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed "
                                      "during prefill (excluding cached tokens).", tokens)

        # Every labelled child now, so that each series is exported (as 0) before its first event.
        self._c = {m: m.labels(**lbl) for m in (
            self.running, self.waiting, self.kv_usage, self.cache_blocks, self.prefix_queries, self.prefix_hits,
            self.preemptions, self.prompt_tokens, self.prompt_cached, self.generation_tokens, self.h_prompt,
            self.h_generation, self.h_iteration, self.h_max_generation, self.h_n, self.h_max_tokens, self.h_ttft,
            self.h_itl, self.h_tpot, self.h_e2e, self.h_queue, self.h_inference, self.h_prefill, self.h_decode,
            self.h_preemptions, self.h_prefill_kv, self.external_queries, self.external_hits)}
        for metric in idle:
            metric.labels(**lbl)
        self.model_name = model_name
        self.set_num_gpu_blocks(num_gpu_blocks)
        self._last = EngineStatsSnapshot()
        self._spec: SpecDecodeCounters | None = None  # created by the first snapshot that has them

    def set_num_gpu_blocks(self, num_gpu_blocks: int) -> None:
        """The KV blocks the engine allocated: pagedlm's gauge, and a label of cache_config_info (an
        info series: a gauge fixed at 1 whose labels are the cache configuration, as vLLM's)."""
        self._c[self.cache_blocks].set(num_gpu_blocks)
        self._cache_info.clear()
        # tokens the cache holds, and how many requests of max_model_len fit in it at once
        per_request = -(-self._max_model_len // self._block_size)
        self._cache_info.labels(**self._cache_config, num_gpu_blocks=str(num_gpu_blocks),
                                kv_cache_size_tokens=str(num_gpu_blocks * self._block_size),
                                kv_cache_max_concurrency=f"{num_gpu_blocks / per_request:.2f}", engine="0").set(1)

    def record(self, engine_stats: EngineStatsSnapshot | None, iteration_stats: IterationStats | None) -> None:
        c = self._c
        if engine_stats is not None:
            c[self.running].set(engine_stats.num_running_reqs)
            c[self.waiting].set(engine_stats.num_waiting_reqs)
            # every waiting request waits for capacity: nothing in pagedlm defers one
            self.waiting_by_reason["capacity"].set(engine_stats.num_waiting_reqs)
            c[self.kv_usage].set(engine_stats.kv_cache_usage)
            last = self._last
            for counter, new, old in (
                (self.prefix_queries, engine_stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.prefix_hits, engine_stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.preemptions, engine_stats.num_preemptions, last.num_preemptions),
                (self.external_queries, engine_stats.external_prefix_cache_queries,
                 last.external_prefix_cache_queries),
                (self.external_hits, engine_stats.external_prefix_cache_hits, last.external_prefix_cache_hits),
            ):
                # A total that went down was reset in the core: everything since counts.
                delta = new - old if new >= old else new
                if delta > 0:
                    c[counter].inc(delta)
            if engine_stats.spec_decode_num_accepted_tokens_per_pos:
                if self._spec is None:
                    self._spec = SpecDecodeCounters(self.registry, self.prefix, self.labels,
                                                    len(engine_stats.spec_decode_num_accepted_tokens_per_pos))
                self._spec.record(engine_stats, last)
            self._last = engine_stats
            if engine_stats.max_lora:
                self._record_lora(engine_stats)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def _record_lora(self, stats: EngineStatsSnapshot) -> None:
        """vLLM's ``lora_requests_info``: one series, labelled with the adapters in use and waiting
        (comma-separated names) and max_lora, whose value is the time it was set.
        NOTE: the previous label set is cleared, so the series count stays one."""
        gauge = self._lora_info
        if gauge is None:
            gauge = self._lora_info = Gauge(
                self.prefix + "lora_requests_info", "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry)
        gauge.clear()
        gauge.labels(max_lora=str(stats.max_lora), waiting_lora_adapters=",".join(sorted(stats.waiting_lora_adapters)),
                     running_lora_adapters=",".join(sorted(stats.running_lora_adapters))).set_to_current_time()

    def _record_iteration(self, it: IterationStats) -> None:
        c = self._c
        if it.num_prompt_tokens:
            c[self.prompt_tokens].inc(it.num_prompt_tokens)
            self.prompt_by_source["local_compute"].inc(it.num_prompt_tokens - it.num_cached_prompt_tokens)
        if it.num_cached_prompt_tokens:
            self.prompt_by_source["local_cache_hit"].inc(it.num_cached_prompt_tokens)
            c[self.prompt_cached].inc(it.num_cached_prompt_tokens)
            self.cached_by_source["device"].inc(it.num_cached_prompt_tokens)
        if it.num_generation_tokens:
            c[self.generation_tokens].inc(it.num_generation_tokens)
        for histogram, values in ((self.h_iteration, it.iteration_tokens), (self.h_ttft, it.time_to_first_tokens),
                                  (self.h_itl, it.inter_token_latencies), (self.h_n, it.n_params),
                                  (self.h_max_generation, it.max_num_generation_tokens)):
            observe_all(c[histogram], values)
        for done in it.finished_requests:
            self.request_success[done.finish_reason if done.finish_reason in self.request_success else "error"].inc()
            c[self.h_e2e].observe(done.e2e_latency)
            if done.has_phase_times:
                c[self.h_queue].observe(done.queued_time)
                c[self.h_prefill].observe(done.prefill_time)
                c[self.h_decode].observe(done.decode_time)
                c[self.h_inference].observe(done.inference_time)
            c[self.h_preemptions].observe(done.num_preemptions)
            c[self.h_prefill_kv].observe(done.num_prompt_tokens - done.num_cached_tokens)
            c[self.h_prompt].observe(done.num_prompt_tokens)
            c[self.h_generation].observe(done.num_generation_tokens)
            c[self.h_tpot].observe(done.mean_time_per_output_token)
            if done.max_tokens_param:
                c[self.h_max_tokens].observe(done.max_tokens_param)


def observe_all(child: Histogram, values: Sequence[float]) -> None:
    """``child.observe(v)`` for every value, in one pass per distinct value: a batch's inter-token
    latencies are mostly one value (the gap between two steps), ~24k of them per second, and
    prometheus_client's ``observe`` walks the buckets in Python under a lock for each.
    NOTE: uses the histogram child's ``_upper_bounds``/``_buckets``/``_sum`` (prometheus_client's
    layout since 0.4: one non-cumulative value per bucket, the first bound >= the value counts it);
    tests/server/test_serve_host_path.py checks the exposition against one ``observe`` per value."""
    if not values:
        return
    if len(values) == 1:
        child.observe(values[0])
        return
    bounds, buckets = child._upper_bounds, child._buckets
    total = 0.0
    for value, count in Tally(values).items():
        buckets[bisect.bisect_left(bounds, value)].inc(count)
        total += value * count
    child._sum.inc(total)


class SpecDecodeCounters:
    """vLLM's speculative-decoding counters (exported once the engine speculates): drafts, draft
    tokens, accepted tokens, and accepted tokens per draft position (label ``position``)."""

    def __init__(self, registry: CollectorRegistry, prefix: str, labels: dict[str, str], num_positions: int) -> None:
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, names + list(extra), registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.").labels(**labels)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.").labels(**labels)
        self.accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.").labels(**labels)
        per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                          ("position",))
        self.per_pos = [per_pos.labels(**labels, position=str(pos)) for pos in range(num_positions)]

    def record(self, new: EngineStatsSnapshot, old: EngineStatsSnapshot) -> None:
        for child, now, before in ((self.drafts, new.spec_decode_num_drafts, old.spec_decode_num_drafts),
                                   (self.draft_tokens, new.spec_decode_num_draft_tokens,
                                    old.spec_decode_num_draft_tokens),
                                   (self.accepted, new.spec_decode_num_accepted_tokens,
                                    old.spec_decode_num_accepted_tokens)):
            if now > before:
                child.inc(now - before)
        old_pos = old.spec_decode_num_accepted_tokens_per_pos or [0] * len(self.per_pos)
        for child, now, before in zip(self.per_pos, new.spec_decode_num_accepted_tokens_per_pos, old_pos):
            if now > before:
                child.inc(now - before)
