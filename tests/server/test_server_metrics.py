"""/metrics: vLLM's metric set under the ``pagedlm:`` prefix (``vllm:`` with --metrics-prefix vllm),
with the counts vLLM's own metrics test expects after a known workload."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"

#: the series vLLM's tests/entrypoints/instrumentator/test_metrics.py expects (names after the
#: prefix), plus the rest of vLLM's default set
VLLM_SERIES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "iteration_tokens_total", "cache_config_info", "request_success_total",
    *[f"{h}_{s}" for h in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                           "request_params_max_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
                           "e2e_request_latency_seconds", "request_queue_time_seconds",
                           "request_inference_time_seconds", "request_prefill_time_seconds",
                           "request_decode_time_seconds", "request_num_preemptions",
                           "request_max_num_generation_tokens", "request_time_per_output_token_seconds",
                           "request_prefill_kv_computed_tokens") for s in ("sum", "bucket", "count")],
    "num_requests_waiting_by_reason", "engine_sleep_state", "external_prefix_cache_queries_total",
    "external_prefix_cache_hits_total", "mm_cache_queries_total", "mm_cache_hits_total",
    "prompt_tokens_by_source_total", "prompt_tokens_cached_total", "prompt_tokens_cached_by_source_total",
    "admission_rejections_total",
]


def samples(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(snapshot, name: str, **labels: str) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def test_vllm_metric_set_is_exported(server, flagged_server, client):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=3)
    for srv, prefix, other in ((server, "pagedlm:", "vllm:"), (flagged_server, "vllm:", "pagedlm:")):
        text = httpx.get(srv.url + "/metrics", headers=srv.headers, timeout=10).text
        missing = [name for name in VLLM_SERIES if prefix + name not in text]
        assert not missing, f"{prefix}: {missing}"
        assert f"\n{other}" not in text
        assert 'engine="0"' in text and 'model_name="tiny-llama"' in text
    snap = samples(server)
    info = [labels for (name, labels) in snap if name == "pagedlm:cache_config_info"]
    assert info and dict(info[0])["block_size"] == "16" and int(dict(info[0])["num_gpu_blocks"]) > 0
    assert value(snap, "pagedlm:engine_sleep_state", sleep_state="awake") == 1


def test_metric_counts_after_a_known_workload(server, client):
    # vLLM's test_metrics_counts: sequential requests of a token-id prompt shorter than a KV block
    # (nothing for the prefix cache to hit)
    prompt, num_requests, max_tokens = [1, 15043, 590, 1024, 338, 4755][:5], 10, 10
    prompt = [t % 500 + 1 for t in prompt]
    before = samples(server)
    for _ in range(num_requests):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True})
    after = samples(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, "pagedlm:" + name, **labels) - value(before, "pagedlm:" + name, **labels)

    p = len(prompt)
    expected = {
        "time_to_first_token_seconds_count": num_requests,
        "inter_token_latency_seconds_count": num_requests * (max_tokens - 1),
        "e2e_request_latency_seconds_count": num_requests,
        "request_queue_time_seconds_count": num_requests,
        "request_inference_time_seconds_count": num_requests,
        "request_prefill_time_seconds_count": num_requests,
        "request_decode_time_seconds_count": num_requests,
        "request_prompt_tokens_sum": num_requests * p, "request_prompt_tokens_count": num_requests,
        "request_generation_tokens_sum": num_requests * max_tokens,
        "request_generation_tokens_count": num_requests,
        "request_params_n_count": num_requests, "request_params_n_sum": num_requests,
        "request_params_max_tokens_sum": num_requests * max_tokens,
        "request_params_max_tokens_count": num_requests,
        "iteration_tokens_total_sum": num_requests * (p + max_tokens),
        "iteration_tokens_total_count": num_requests * max_tokens,
        "prompt_tokens_total": num_requests * p, "generation_tokens_total": num_requests * max_tokens,
        "request_num_preemptions_count": num_requests, "request_num_preemptions_sum": 0,
        "request_prefill_kv_computed_tokens_sum": num_requests * p,
    }
    got = {name: delta(name) for name in expected}
    assert got == expected
    assert delta("request_success_total", finished_reason="length") == num_requests
    assert delta("prompt_tokens_by_source_total", source="local_compute") == num_requests * p
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"request_{phase}_time_seconds_sum") >= 0
    assert delta("request_inference_time_seconds_sum") >= delta("request_decode_time_seconds_sum")
    assert delta("e2e_request_latency_seconds_sum") >= delta("request_inference_time_seconds_sum") * 0.9


def test_n_and_prefix_cache_hits_are_counted_as_vllm_counts_them(server, client):
    prompt = [7] * 40  # two full blocks of 16: cached for the second request
    before = samples(server)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=3, seed=1, extra_body={"ignore_eos": True})
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    after = samples(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, "pagedlm:" + name, **labels) - value(before, "pagedlm:" + name, **labels)

    # every choice is an engine request with its own stats; n and max_tokens once per user request
    assert delta("request_success_total", finished_reason="length") == 4
    assert delta("request_params_n_count") == 2 and delta("request_params_n_sum") == 4
    assert delta("request_max_num_generation_tokens_sum") == 8
    assert delta("prompt_tokens_total") == 4 * 40
    cached = delta("prompt_tokens_cached_total")
    assert cached >= 32 and delta("prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert delta("request_prefill_kv_computed_tokens_sum") == 4 * 40 - cached
