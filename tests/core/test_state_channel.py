"""The scheduler output is the workers' one source of request state (DESIGN.md §7, "One channel").

A model runner's ``InputBatch`` that only ever sees the scheduler outputs (as a pipeline stage
that does not sample) must hold exactly the scheduler's tokens and block tables, through
chunked prefill, preemption and resumption, and drop preempted requests from its tables.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from pagedlm.core.kv_cache import KVCacheManager
from pagedlm.core.request import Request
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.core.sched import ModelRunnerOutput, Scheduler
from pagedlm.core.worker.input_batch import InputBatch


def _fake_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids) * 7) % 97 + 3


def _scheduler(num_blocks: int = 64, *, async_scheduling: bool = False, pipeline_depth: int = 1) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_caching=True, max_model_len=128)
    return Scheduler(kv_cache_manager=kv, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=128,
                     async_scheduling=async_scheduling, pipeline_depth=pipeline_depth)


def _add(sched: Scheduler, req_id: str, prompt: list[int], max_tokens: int, **kw) -> None:
    sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)))


def test_cached_requests_carry_the_tokens_the_workers_were_not_sent():
    sched = _scheduler()
    _add(sched, "a", [5, 6, 7], max_tokens=4)
    first = sched.schedule()
    assert [n.req_id for n in first.scheduled_new_reqs] == ["a"]
    sched.update_from_output(first, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[42]]))
    second = sched.schedule()
    assert second.scheduled_cached_reqs.new_token_ids == [[42]]
    sched.update_from_output(second, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[43]]))
    assert sched.schedule().scheduled_cached_reqs.new_token_ids == [[43]]  # each token is sent once


def test_async_scheduling_sends_a_token_once_it_is_back():
    sched = _scheduler(async_scheduling=True)
    _add(sched, "a", [5, 6, 7], max_tokens=8)
    first = sched.schedule()
    second = sched.schedule()  # on the placeholder of the first step's token: nothing to send yet
    assert second.scheduled_cached_reqs.new_token_ids == [[]]
    sched.update_from_output(first, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[42]]))
    third = sched.schedule()
    assert third.scheduled_cached_reqs.new_token_ids == [[42]]


def test_pipeline_depth_splits_the_running_requests_over_the_batches_in_flight():
    sched = _scheduler(pipeline_depth=2)
    for i in range(4):
        _add(sched, str(i), [5 + i, 6, 7], max_tokens=4)
    prefill = sched.schedule()
    assert len(prefill.num_scheduled_tokens) == 4
    sched.update_from_output(prefill, ModelRunnerOutput(req_ids=list(prefill.num_scheduled_tokens),
                                                        sampled_token_ids=[[9]] * 4))
    # Two batches of two decodes, in flight at once (one per stage).
    assert list(sched.schedule().num_scheduled_tokens) == ["0", "1"]
    assert list(sched.schedule().num_scheduled_tokens) == ["2", "3"]


def test_a_batch_fed_only_by_scheduler_outputs_holds_the_schedulers_state():
    """Random requests in a cache small enough to preempt: every step, the inputs the batch
    builds are the scheduler's tokens at the scheduled positions, its block tables are the KV
    manager's, and preempted requests leave its tables but keep their state."""
    rng = random.Random(0)
    sched = _scheduler(num_blocks=20)
    batch = InputBatch(max_num_reqs=6, max_model_len=128, block_size=4, vocab_size=128, device=torch.device("cpu"))
    for i in range(12):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(2, 24))]
        _add(sched, f"r{i}", prompt, max_tokens=rng.randrange(2, 30), temperature=1.0, seed=i)
    generators: dict[str, torch.Generator] = {}
    num_preempted = num_resumed = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        batch.update(out)
        for req_id in out.preempted_req_ids:
            num_preempted += 1
            assert req_id not in batch.requests and req_id in batch.preempted
        num_resumed += sum(out.scheduled_cached_reqs.resumed_from_preemption)
        for req_id, state in batch.requests.items():
            # A resumed request goes on with the generator it had (seeded sampling continues).
            assert generators.setdefault(req_id, state.generator) is state.generator
        if out.is_empty:
            continue
        step = batch.prepare(out)
        sampled = []
        for b, req_id in enumerate(step.req_ids):
            request = sched.requests[req_id]
            lo, hi = step.query_start_loc[b], step.query_start_loc[b + 1]
            positions = step.positions[lo:hi]
            assert step.input_ids[lo:hi].tolist() == [request.all_token_ids[p] for p in positions]
            row = batch.requests[req_id].row
            for table, block_ids in zip(batch.block_tables, sched.kv_cache_manager.get_block_ids(req_id),
                                        strict=True):
                assert np.array_equal(table[row, : len(block_ids)], block_ids)
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([_fake_token(request.all_token_ids)] if done else [])
        sched.update_from_output(out, ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=sampled))
    assert num_preempted > 0 and num_resumed == num_preempted
    # Finished ids reach the batch with the next scheduler output.
    batch.update(sched.schedule())
    assert not batch.requests and not batch.preempted
