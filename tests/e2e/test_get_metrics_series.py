"""``LLM.get_metrics()`` has the per-request series of the server's /metrics (vLLM's names), counted
as vLLM counts them: every choice of ``n > 1`` is an engine request, ``n`` once per request."""

from __future__ import annotations


def test_get_metrics_has_the_per_request_histograms(tiny_llama):
    from pagedlm.core import LLM, SamplingParams

    llm = LLM(model=tiny_llama, device="cpu", disable_log_stats=False, kv_cache_memory_bytes=16 << 20)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, n=2, seed=1, ignore_eos=True),
                 use_tqdm=False)
    m = {x.name.removeprefix("pagedlm:"): x for x in llm.get_metrics() if "finished_reason" not in x.labels}
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_num_preemptions"):
        assert m[name].count == 4, name  # one per choice
    assert m["request_prompt_tokens"].sum == 2 * (3 + 4) and m["request_generation_tokens"].sum == 16
    assert m["request_params_n"].count == 2 and m["request_params_n"].sum == 4
    assert m["request_max_num_generation_tokens"].sum == 8
    assert m["request_params_max_tokens"].sum == 4 * 4
    assert m["inter_token_latency_seconds"].count == 4 * 3
    assert m["iteration_tokens_total"].sum == 2 * (3 + 4) + 16 and m["iteration_tokens_total"].count >= 4
    assert m["prompt_tokens"].value == 2 * (3 + 4) and m["generation_tokens"].value == 16
    assert m["request_queue_time_seconds"].buckets["+Inf"] == 4 and m["request_decode_time_seconds"].sum >= 0
