"""The scheduler with a KV connector, without a model: a scripted connector offers external
blocks; the test plays the workers' reports (loads done, invalid blocks, sends done)."""

from __future__ import annotations

from typing import Any

from pagedlm.core.config import VllmConfig
from pagedlm.core.distributed.kv_transfer.base import (
    KVCacheInfo,
    KVConnectorBase_V1,
    KVConnectorOutput,
    KVConnectorRole,
)
from pagedlm.core.distributed.kv_transfer.config import KVTransferConfig
from pagedlm.core.kv_cache import KVCacheManager
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.core.sched import ModelRunnerOutput, Scheduler

BLOCK = 4


class ScriptedConnector(KVConnectorBase_V1):
    """Offers ``offer[req_id]`` external tokens; records what the scheduler told it."""

    def __init__(self, load_async: bool, delay_free: bool = False) -> None:
        config = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="Scripted"))
        super().__init__(config, KVConnectorRole.SCHEDULER, KVCacheInfo(64, BLOCK, 1))
        self.load_async, self.delay_free = load_async, delay_free
        self.offer: dict[str, int] = {}
        self.allocs: dict[str, tuple[list[int], int]] = {}
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.offer.get(request.request_id, 0), self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.allocs[request.request_id] = ([b.block_id for b in blocks[0]], num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return {"step": True}

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return self.delay_free, ({"remote_request_id": request.request_id} if self.delay_free else None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None: ...
    def wait_for_save(self) -> None: ...


def make(connector: ScriptedConnector, policy: str = "recompute", num_blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, enable_caching=True, max_model_len=128)
    return Scheduler(kv_cache_manager=kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                     kv_connector=connector, kv_load_failure_policy=policy)


def step(sched: Scheduler, report: KVConnectorOutput | None = None):
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in ids]
    return out, sched.update_from_output(out, ModelRunnerOutput(ids, sampled, kv_connector_output=report))


def add(sched: Scheduler, req_id: str, n: int = 17, max_tokens: int = 2, first: int = 1) -> Request:
    req = Request(req_id, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched.add_request(req)
    return req


def test_async_load_waits_then_runs_from_the_loaded_tokens():
    conn = ScriptedConnector(load_async=True)
    sched = make(conn)
    conn.offer["a"] = 12
    req = add(sched, "a")
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {} and out.kv_connector_metadata == {"step": True}
    assert conn.allocs["a"][1] == 12 and sched.has_unfinished_requests()
    step(sched)  # the load is still in flight: nothing runs
    assert req.num_computed_tokens == 0 and sched.get_num_unfinished_requests() == 1
    out, _ = step(sched, KVConnectorOutput(finished_recving={"a"}))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 17 - 12}
    assert sched.kv_transfer.stats.num_hit_tokens == 12 and req.num_cached_tokens == 12
    # the loaded blocks entered the prefix cache once they loaded
    other = Request("b", list(range(1, 18)), SamplingParams(max_tokens=1))
    assert sched.kv_cache_manager.get_computed_blocks(other)[1] == 16


def test_invalid_blocks_are_recomputed_from_the_first_bad_one():
    conn = ScriptedConnector(load_async=True)
    sched = make(conn)
    conn.offer["a"] = 12
    add(sched, "a")
    step(sched)
    bad = conn.allocs["a"][0][1]  # the second of the three loaded blocks
    step(sched, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={bad}))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 17 - 4}
    assert sched.kv_transfer.stats.num_recomputed_tokens == 8


def test_failure_policy_fail_and_failed_loads_finish_the_request_with_the_reason():
    conn = ScriptedConnector(load_async=True)
    sched = make(conn, policy="fail")
    conn.offer["a"] = conn.offer["b"] = 8
    add(sched, "a")
    add(sched, "b", n=13)
    step(sched)
    a_blocks = conn.allocs["a"][0]
    _, outs = step(sched, KVConnectorOutput(finished_recving={"a", "b"}, invalid_block_ids={a_blocks[0]},
                                            failed_recving={"b": "no answer from the peer"}))
    errors = {o.request_id: o.error for o in outs}
    assert errors["b"] == "no answer from the peer" and "did not load" in errors["a"]
    assert all(o.finish_reason == "error" for o in outs)
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.num_free_blocks == 64


def test_abort_while_loading_keeps_the_blocks_until_the_load_is_over():
    conn = ScriptedConnector(load_async=True)
    sched = make(conn)
    conn.offer["a"] = 12
    add(sched, "a")
    step(sched)
    held = sched.kv_cache_manager.num_free_blocks
    assert held < 64
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    step(sched)
    assert sched.kv_cache_manager.num_free_blocks == held  # the workers may still write into them
    step(sched, KVConnectorOutput(finished_recving={"a"}))
    assert sched.kv_cache_manager.num_free_blocks == 64 and not sched.has_unfinished_requests()


def test_sync_load_counts_as_computed_and_a_failed_one_fails_and_leaves_the_prefix_cache():
    conn = ScriptedConnector(load_async=False)
    sched = make(conn)
    conn.offer["a"] = 8
    req = add(sched, "a")
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 17 - 8} and req.num_cached_tokens == 8
    conn.offer["b"] = 8
    add(sched, "b", n=9, first=100)
    out = sched.schedule()
    bad = conn.allocs["b"][0][0]
    outs = sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), [[7], [7]],
                                                           kv_connector_output=KVConnectorOutput(
                                                               invalid_block_ids={bad})))
    failed = [o for o in outs if o.request_id == "b"]
    assert failed[0].finish_reason == "error" and failed[0].new_token_ids == []
    assert sched.kv_cache_manager.block_pool.blocks[bad].block_hash is None


def test_delayed_free_keeps_blocks_until_sent_and_passes_kv_transfer_params():
    conn = ScriptedConnector(load_async=True, delay_free=True)
    sched = make(conn)
    add(sched, "a", max_tokens=1)
    _, outs = step(sched)
    assert outs[0].finished and outs[0].kv_transfer_params == {"remote_request_id": "a"}
    assert sched.kv_cache_manager.num_free_blocks < 64 and sched.has_unfinished_requests()
    step(sched, KVConnectorOutput(finished_sending={"a"}))
    assert sched.kv_cache_manager.num_free_blocks == 64 and not sched.has_unfinished_requests()
