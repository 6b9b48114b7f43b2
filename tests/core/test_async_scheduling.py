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


# -- the engine core's loop with a fake device ------------------------------------------------------

def _fake_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids) * 7) % 97 + 3


class _FakeDevice:
    """Plays the worker: keeps each request's tokens as the device sees them (sampled tokens are
    known at once, before the host has them) and samples a deterministic function of them."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.num_sampled: dict[str, int] = {}

    def execute(self, out):
        from pagedlm.core.sched import ModelRunnerOutput

        for req_id in out.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                self.tokens[req_id] = list(cached.token_ids[i])
            self.computed[req_id] = cached.num_computed_tokens[i]
        req_ids, sampled = [], []
        for req_id, num in out.num_scheduled_tokens.items():
            self.computed[req_id] += num
            seq = self.tokens[req_id]
            # NOTE: every token this step computes must be one the device knows
            assert self.computed[req_id] <= len(seq) + 1
            req_ids.append(req_id)
            if self.computed[req_id] >= len(seq):
                seq.append(_fake_token(seq))
                sampled.append([seq[-1]])
                self.num_sampled[req_id] = self.num_sampled.get(req_id, 0) + 1
            else:
                sampled.append([])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        device = self

        class Pending:
            def result(self):
                device.in_flight -= 1
                return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

        return Pending()


def _fake_core(async_scheduling: bool, num_blocks: int, device: _FakeDevice):
    from pagedlm.core.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from pagedlm.core.engine.core import EngineCore
    from pagedlm.core.executor.abstract import Executor, done_future

    class FakeExecutor(Executor):
        def _init_executor(self):
            pass

        def get_kv_cache_specs(self):
            return {}

        def set_kv_cache_groups(self, groups):
            pass

        def determine_num_available_blocks(self):
            return num_blocks

        def kv_cache_bytes_per_block(self):
            return 1

        def initialize_cache(self, num_blocks):
            pass

        def execute_model(self, scheduler_output, non_block=False):
            pending = device.execute(scheduler_output)
            if non_block and async_scheduling:
                return pending
            output = pending.result()
            return done_future(output) if non_block else output

    config = VllmConfig(
        model_config=ModelConfig(max_model_len=96),
        cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
        scheduler_config=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96,
                                         async_scheduling=async_scheduling),
        device_config=DeviceConfig(device="cpu"),
    )
    config.finalize()
    return EngineCore(config, executor_class=FakeExecutor)


def _expected(prompt: list[int], params) -> tuple[list[int], str]:
    seq, out = list(prompt), []
    while True:
        seq.append(_fake_token(seq))
        out.append(seq[-1])
        if len(out) >= params.min_tokens and seq[-1] in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(seq) >= 96:
            return out, "length"


@pytest.mark.parametrize("num_blocks", [200, 24], ids=["roomy", "preempting"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_core_async_loop_loses_and_duplicates_nothing(seed, num_blocks):
    """Random requests (lengths, stop ids, min_tokens, penalties), random aborts, and with a small
    cache preemption: the async loop produces exactly the tokens of the fake model, never more
    than one batch ahead, and leaves no block, placeholder or batch behind."""
    import random

    from pagedlm.core.request import EngineCoreRequest

    rng = random.Random(seed)
    device = _FakeDevice()
    core = _fake_core(True, num_blocks, device)
    expected, finished, aborted = {}, {}, set()
    tokens: dict[str, list[int]] = {}
    next_id = 0
    for _ in range(2000):
        if next_id < 30 and rng.random() < 0.3:
            prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(max_tokens=rng.randrange(3, 40), ignore_eos=True,
                                    stop_token_ids=[rng.randrange(3, 100)] if rng.random() < 0.5 else None,
                                    min_tokens=rng.choice([0, 0, 3]),
                                    repetition_penalty=rng.choice([1.0, 1.0, 1.2]))
            params.all_stop_token_ids = set(params.stop_token_ids)
            req_id = f"r{next_id}"
            next_id += 1
            expected[req_id] = _expected(prompt, params)
            core.add_request(EngineCoreRequest(req_id, prompt, params))
        if rng.random() < 0.03 and core.scheduler.running:
            victim = rng.choice(core.scheduler.running).request_id
            core.abort_requests([victim])
            aborted.add(victim)
        for out in core.step():
            assert out.request_id not in finished, "a request finished twice"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if next_id >= 30 and not core.has_unfinished_requests():
            break
    assert not core.has_unfinished_requests() and not core.batch_queue
    assert device.max_in_flight == 2
    for req_id, (want, reason) in expected.items():
        if req_id in aborted:
            assert tokens.get(req_id, []) == want[: len(tokens.get(req_id, []))]
            continue
        assert (tokens[req_id], finished[req_id]) == (want, reason), req_id
        # Length is known ahead: no token past it is computed. A stop token is seen one step
        # late, so one extra token may be. (Preemption resamples nothing: in-flight tokens stay.)
        assert device.num_sampled[req_id] == len(want) + (reason == "stop" and device.num_sampled[req_id] > len(want))
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    if num_blocks == 24:
        assert core.scheduler.num_preemptions_total > 0
