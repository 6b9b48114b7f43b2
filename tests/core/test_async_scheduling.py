"""Async scheduling: step N+1 is scheduled while step N runs, on output placeholders.

The tokens must be those of the synchronous engine in every case where a token is in flight
when something happens to its request: it finishes, is aborted, or is preempted.
"""

from __future__ import annotations

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.worker.model_runner import ModelRunner


def _prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [5 + i, 9, 17 + 2 * i] + [30 + i] * (3 * i)} for i in range(n)]


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _runner(llm: LLM) -> ModelRunner:
    return llm.llm_engine.core.executor.worker.model_runner


def test_default_is_off_on_the_cpu_and_on_needs_one_process(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu")
    assert llm.vllm_config.scheduler_config.async_scheduling is False
    assert llm.llm_engine.core.batch_queue is None
    with pytest.raises(ValueError, match=r"async_scheduling=True needs the in-process .*tensor_parallel_size=2"):
        LLM(model=tiny_llama, dtype="float32", device="cpu", async_scheduling=True, tensor_parallel_size=2)


def test_steps_run_ahead_of_their_tokens(tiny_llama, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(6)]
    expected = _tokens(LLM(model=tiny_llama, dtype="float32", device="cpu").generate(
        _prompts(6), params, use_tqdm=False))

    fed: list[int] = []
    original = ModelRunner.feed_sampled_tokens

    def counting(self, input_ids, step):
        fed.append(len(step.fed_token_indices))
        return original(self, input_ids, step)

    monkeypatch.setattr(ModelRunner, "feed_sampled_tokens", counting)
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", async_scheduling=True)
    assert _tokens(llm.generate(_prompts(6), params, use_tqdm=False)) == expected
    # Every decode step after the first feeds the tokens of the step before it on the device.
    assert sum(fed) > sum(p.max_tokens for p in params) // 2
    assert [len(t) for t in expected] == [p.max_tokens for p in params]  # never one token too many
    core = llm.llm_engine.core
    assert not core.batch_queue and not core.scheduler.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.scheduler.kv_cache_manager.num_blocks


def test_seeded_sampling_survives_preemption_with_a_token_in_flight(tiny_llama):
    prompts = _prompts(7)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=30, ignore_eos=True) for i in range(7)]
    roomy = LLM(model=tiny_llama, dtype="float32", device="cpu")
    expected = _tokens(roomy.generate(prompts, params, use_tqdm=False))
    tight = LLM(model=tiny_llama, dtype="float32", device="cpu", async_scheduling=True,
                num_gpu_blocks_override=12, max_model_len=128)
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert tight.llm_engine.core.scheduler.num_preemptions_total > 0


def test_abort_and_stop_with_a_token_in_flight(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(4)
    expected = _tokens(LLM(model=tiny_llama, dtype="float32", device="cpu").generate(prompts, params,
                                                                                        use_tqdm=False))
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", async_scheduling=True)
    engine = llm.llm_engine
    # Request "stop" ends on a stop token (found one step after the next step was scheduled).
    stop_params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[expected[3][4]], ignore_eos=True)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(str(i), prompt, params)
    engine.add_request("stop", prompts[3], stop_params)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 4:
            engine.abort_request(["1"])
    assert "1" not in finished
    assert list(finished["0"].outputs[0].token_ids) == expected[0]
    assert list(finished["2"].outputs[0].token_ids) == expected[2]
    stop_index = expected[3].index(expected[3][4])
    assert list(finished["stop"].outputs[0].token_ids) == expected[3][: stop_index + 1]
    assert finished["stop"].outputs[0].finish_reason == "stop"
    core = engine.core
    assert not core.batch_queue and not core.scheduler.requests
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.scheduler.kv_cache_manager.num_blocks
    # The model runner dropped them too (finished ids reach it with the next step it runs).
    llm.generate(prompts[:1], params, use_tqdm=False)
    assert not {"1", "2", "stop"} & set(_runner(llm).input_batch.requests)


def test_requests_reading_their_history_wait_for_their_token(tiny_llama, monkeypatch):
    from pagedlm.core.sched.scheduler import Scheduler

    ahead: list[str] = []
    original = Scheduler.schedule

    def checking(self):
        out = original(self)
        for req_id in out.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.needs_output_history and request.num_output_placeholders > 1:
                ahead.append(req_id)
        return out

    monkeypatch.setattr(Scheduler, "schedule", checking)
    params = [SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=6),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    sync = LLM(model=tiny_llama, dtype="float32", device="cpu")
    expected = _tokens(sync.generate(_prompts(3), params, use_tqdm=False))
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", async_scheduling=True)
    assert _tokens(llm.generate(_prompts(3), params, use_tqdm=False)) == expected
    assert not ahead
