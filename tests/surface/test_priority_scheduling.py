"""Priority scheduling (vLLM's ``--scheduling-policy priority``): the waiting order, the preemption
order under KV pressure, and the request-level API (offline ``priority=[...]``, refusals)."""

from __future__ import annotations

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.kv_cache import KVCacheManager
from pagedlm.core.request import Request
from pagedlm.core.sched import ModelRunnerOutput, Scheduler
from pagedlm.core.sched.request_queue import PriorityRequestQueue


def make_scheduler(policy, num_blocks=64, block_size=4, max_num_seqs=8, budget=64):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_caching=False, max_model_len=256)
    return Scheduler(kv_cache_manager=kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=256, policy=policy)


def add(sched, req_id, prompt_len, max_tokens, priority, arrival):
    req = Request(req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  arrival_time=arrival, priority=priority)
    sched.add_request(req)
    return req


def step(sched):
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in ids]
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
    return out


def test_queue_orders_by_priority_then_arrival():
    q = PriorityRequestQueue()
    reqs = [Request(f"r{i}", [1], SamplingParams(max_tokens=1), arrival_time=t, priority=p)
            for i, (p, t) in enumerate([(5, 1.0), (0, 3.0), (0, 2.0), (-1, 4.0), (5, 0.5)])]
    for r in reqs:
        q.append(r)
    assert [r.request_id for r in q] == ["r3", "r2", "r1", "r4", "r0"]
    q.remove(reqs[2])
    assert reqs[2] not in q and len(q) == 4
    assert [q.popleft().request_id for _ in range(4)] == ["r3", "r1", "r4", "r0"]


def test_high_priority_request_behind_a_full_queue_starts_first():
    sched = make_scheduler("priority", max_num_seqs=2)
    for i in range(6):
        add(sched, f"low{i}", 4, 3, priority=10, arrival=float(i))
    step(sched)  # two low-priority requests run; four wait
    add(sched, "high", 4, 3, priority=0, arrival=100.0)
    started = []
    while sched.has_unfinished_requests():
        out = step(sched)
        started += [r.req_id for r in out.scheduled_new_reqs]
    assert started[0] == "high", started
    assert started[1:] == [f"low{i}" for i in range(2, 6)]


def test_fcfs_keeps_arrival_order():
    sched = make_scheduler("fcfs", max_num_seqs=2)
    for i in range(4):
        add(sched, f"low{i}", 4, 3, priority=0, arrival=float(i))
    step(sched)
    add(sched, "late", 4, 3, priority=0, arrival=100.0)
    started = []
    while sched.has_unfinished_requests():
        started += [r.req_id for r in step(sched).scheduled_new_reqs]
    assert started == ["low2", "low3", "late"]


@pytest.mark.parametrize("policy, victim", [("priority", "low_old"), ("fcfs", "high_new")])
def test_kv_pressure_preempts_the_lowest_priority_first(policy, victim):
    # 6 blocks of 4 tokens: three requests of 8-token prompts fill them; decoding needs more.
    sched = make_scheduler(policy, num_blocks=6, block_size=4)
    add(sched, "low_old", 8, 8, priority=5, arrival=0.0)
    add(sched, "mid", 8, 8, priority=1, arrival=1.0)
    add(sched, "high_new", 8, 8, priority=0, arrival=2.0)
    preempted = []
    while sched.has_unfinished_requests():
        preempted += sorted(step(sched).preempted_req_ids)
    assert preempted and preempted[0] == victim, preempted


@pytest.fixture(scope="module")
def priority_llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", device="cpu", scheduling_policy="priority", max_num_seqs=1)


def test_offline_priority_runs_high_priority_first_and_keeps_tokens(priority_llm, monkeypatch):
    scheduler = priority_llm.llm_engine.core.scheduler
    started: list[str] = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        started.extend(r.req_id for r in out.scheduled_new_reqs)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    prompts = [{"prompt_token_ids": [11 + i, 12, 13]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = priority_llm.generate(prompts, params, priority=[3, 2, 1, 0], use_tqdm=False)
    # one sequence at a time (max_num_seqs=1): the last prompt (priority 0) runs first
    assert started == [o.request_id for o in reversed(outs)]
    ref = priority_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    with pytest.raises(ValueError, match="priority has 1 entries"):
        priority_llm.generate(prompts, params, priority=[0], use_tqdm=False)
    with pytest.raises(ValueError, match="priority='x' must be an integer"):
        priority_llm.generate(prompts[:1], params, priority=["x"], use_tqdm=False)


def test_priority_under_fcfs_is_refused_by_name(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="priority=1 was given but priority scheduling is not enabled"):
        llm.generate(["hi"], SamplingParams(max_tokens=1), priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="scheduling_policy='lifo' is not one of fcfs, priority"):
        LLM(model=tiny_llama, dtype="float32", device="cpu", scheduling_policy="lifo")
