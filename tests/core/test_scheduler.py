"""Scheduler behaviour without a model: a fake runner samples a deterministic function of the
sequence, so any lost, duplicated or reordered token would change the outputs."""

from __future__ import annotations

import random

import pytest

from pagedlm.core.kv_cache import KVCacheManager
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.core.sched import ModelRunnerOutput, Scheduler, SchedulerOutput


def fake_next_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids) * 7) % 97 + 3


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256, caching=True,
                   chunked=True):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_caching=caching,
                        max_model_len=max_model_len)
    return Scheduler(kv_cache_manager=kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, enable_chunked_prefill=chunked)


def run_step(sched: Scheduler, log: list[SchedulerOutput] | None = None):
    out = sched.schedule()
    if log is not None:
        log.append(out)
    req_ids, sampled = [], []
    for req_id in out.num_scheduled_tokens:
        req = sched.requests[req_id]
        req_ids.append(req_id)
        # num_computed_tokens already counts this step's tokens
        sampled.append([fake_next_token(req.all_token_ids)] if req.num_computed_tokens >= req.num_tokens else [])
    return out, sched.update_from_output(out, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(fake_next_token(seq))
    return seq[len(prompt):]


def add(sched, req_id, prompt, max_tokens, **kw):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    req = Request(req_id, prompt, params)
    sched.add_request(req)
    return req


def drain(sched, max_steps=10_000):
    results: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, outs = run_step(sched)
        for o in outs:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in finish, "request finished twice"
                finish[o.request_id] = o.finish_reason
    assert not sched.has_unfinished_requests()
    return results, finish


def test_chunked_prefill_respects_budget_and_mixes_decodes():
    sched = make_scheduler(budget=8, block_size=4)
    add(sched, "short", [1, 2, 3], max_tokens=5)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"short": 3}
    add(sched, "long", list(range(10, 40)), max_tokens=3)
    out, _ = run_step(sched)
    # one decode token for "short" and the first 7-token chunk of "long"
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    assert out.total_num_scheduled_tokens <= 8
    results, finish = drain(sched)
    assert finish == {"short": "length", "long": "length"}


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2, budget=1000)
    for i in range(5):
        add(sched, f"r{i}", [i + 1] * 5, max_tokens=4)
    out, _ = run_step(sched)
    assert len(out.num_scheduled_tokens) == 2
    results, _ = drain(sched)
    for i in range(5):
        # first step's tokens came before drain for r0/r1
        assert len(results[f"r{i}"]) in (3, 4)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_loses_and_duplicates_nothing(caching):
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1, 50) for _ in range(rng.randrange(3, 20))] for i in range(12)}
    max_tokens = {r: rng.randrange(5, 30) for r in prompts}
    # 20 blocks of 4 tokens cannot hold 12 requests of up to 50 tokens: preemption must happen.
    sched = make_scheduler(num_blocks=20, block_size=4, max_num_seqs=12, budget=32, caching=caching)
    for r, p in prompts.items():
        add(sched, r, p, max_tokens[r])
    results, finish = drain(sched)
    assert sched.num_preemptions_total > 0
    assert set(results) == set(prompts)
    for r, p in prompts.items():
        assert results[r] == expected_tokens(p, max_tokens[r]), r
        assert finish[r] == "length"
    assert sched.kv_cache_manager.num_free_blocks == 20


def test_prefix_cache_hit_skips_computation():
    sched = make_scheduler(block_size=4, budget=100)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    add(sched, "a", prompt, max_tokens=2)
    drain(sched)
    add(sched, "b", prompt + [99], max_tokens=2)
    out, _ = run_step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"b": 2}
    results, _ = drain(sched)


def test_abort_frees_blocks_and_tells_workers():
    sched = make_scheduler()
    add(sched, "a", [1, 2, 3, 4, 5], max_tokens=50)
    add(sched, "b", [6, 7, 8], max_tokens=50)
    run_step(sched)
    sched.finish_requests(["a", "missing"], RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(sched)
    assert "a" in out.finished_req_ids
    assert list(out.num_scheduled_tokens) == ["b"]
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    assert not sched.has_unfinished_requests()


def test_stop_token_ids_and_min_tokens():
    prompt = [5, 6, 7]
    toks = expected_tokens(prompt, 10)
    stop_at = toks[3]
    sched = make_scheduler()
    req = Request("s", prompt, SamplingParams(max_tokens=10, stop_token_ids=[stop_at]))
    sched.add_request(req)
    results, finish = drain(sched)
    first = toks.index(stop_at)
    assert results["s"] == toks[: first + 1]
    assert finish["s"] == "stop" and req.stop_reason == stop_at

    sched = make_scheduler()
    req = Request("m", prompt, SamplingParams(max_tokens=10, stop_token_ids=[stop_at], min_tokens=first + 2))
    sched.add_request(req)
    results, _ = drain(sched)
    assert len(results["m"]) > first + 1


def test_without_chunked_prefill_long_prompt_waits_for_whole_budget():
    sched = make_scheduler(budget=16, chunked=False, max_model_len=16)
    add(sched, "a", [1] * 6, max_tokens=2)
    add(sched, "b", [2] * 12, max_tokens=2)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 6}  # b's 12 tokens do not fit in the remaining 10
    drain(sched)
