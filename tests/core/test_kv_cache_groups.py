"""KV-cache groups: grouping of layers, the coordinator over full and sliding-window groups."""

from __future__ import annotations

import random

import pytest

from pagedlm.core.kv_cache import (
    NULL_BLOCK,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheManager,
    SlidingWindowSpec,
    make_kv_cache_groups,
    max_blocks_per_request,
)
from pagedlm.core.request import Request
from pagedlm.core.sampling_params import SamplingParams

BLOCK_SIZE = 4
WINDOW = 6
FULL, SLIDING = FullAttentionSpec(), SlidingWindowSpec(WINDOW)
#: a full group and two sliding groups of one layer each (Gemma-shaped)
GROUPS = [KVCacheGroupSpec(("l2",), FULL), KVCacheGroupSpec(("l0",), SLIDING), KVCacheGroupSpec(("l1",), SLIDING)]


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=256))


def make_manager(num_blocks: int = 64, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, max_model_len=512, kv_cache_groups=GROUPS)


def schedule(manager: KVCacheManager, request: Request, num_new_tokens: int):
    """What the scheduler does for one step of the request (a first step looks up hits)."""
    hits, num_hit = ((), 0)
    if request.request_id not in manager.managers[0].req_to_blocks:
        hits, num_hit = manager.get_computed_blocks(request)
        request.num_computed_tokens = num_hit
        num_new_tokens = min(num_new_tokens, request.num_tokens - num_hit)
    new_blocks = manager.allocate_slots(request, num_new_tokens, hits or None, 0)
    if new_blocks is not None:
        request.num_computed_tokens += num_new_tokens
    return new_blocks


def run_to_completion(manager: KVCacheManager, request: Request, chunk: int, num_decodes: int, token: int = 7):
    while request.num_computed_tokens < request.num_tokens:
        assert schedule(manager, request, chunk) is not None
    for _ in range(num_decodes):
        request.append_output_token_ids([token])
        assert schedule(manager, request, 1) is not None


def live_blocks(manager: KVCacheManager, request_id: str, group_id: int) -> list[int]:
    """Indices of the table entries of a group that still hold a pool block."""
    return [i for i, b in enumerate(manager.get_blocks(request_id)[group_id]) if b is not NULL_BLOCK]


def test_make_kv_cache_groups_gemma3_270m_shape() -> None:
    # 18 layers, every sixth full (Gemma 3 270M's layer_types)
    specs = {f"layers.{i}": FULL if (i + 1) % 6 == 0 else SlidingWindowSpec(512) for i in range(18)}
    groups = make_kv_cache_groups(specs)
    assert [len(g.layer_names) for g in groups] == [3] * 6
    assert groups[0].spec == FULL and groups[0].layer_names == ("layers.5", "layers.11", "layers.17")
    assert all(g.spec == SlidingWindowSpec(512) for g in groups[1:])
    assert sorted(n for g in groups for n in g.layer_names) == sorted(specs)


def test_one_span_is_one_group_of_every_layer() -> None:
    specs = {f"layers.{i}": FULL for i in range(5)}
    assert make_kv_cache_groups(specs) == [KVCacheGroupSpec(tuple(specs), FULL)]
    sliding = {f"layers.{i}": SLIDING for i in range(3)}
    assert make_kv_cache_groups(sliding) == [KVCacheGroupSpec(tuple(sliding), SLIDING)]


def test_uneven_spans_pad_the_last_group() -> None:
    specs = {"a": FULL, "b": FULL, "c": SLIDING, "d": SLIDING, "e": SLIDING}
    groups = make_kv_cache_groups(specs)
    assert [(g.layer_names, g.spec) for g in groups] == [(("a", "b"), FULL), (("c", "d"), SLIDING), (("e",), SLIDING)]


def test_max_blocks_per_request_bounds_sliding_groups_by_the_window() -> None:
    # full: every block; sliding: a chunk plus the W - 1 keys before it, one boundary more
    assert FULL.max_blocks_per_request(4096, 16, 8192) == 256
    assert SlidingWindowSpec(512).max_blocks_per_request(4096, 16, 8192) == 256  # a 4096-token chunk
    assert SlidingWindowSpec(512).max_blocks_per_request(4096, 16, 256) == 49
    assert max_blocks_per_request(GROUPS, 64, BLOCK_SIZE, 4) == 16 + 2 * 4


def test_allocation_gives_every_group_a_table() -> None:
    manager = make_manager()
    request = make_request("r", list(range(10)))
    new_blocks = schedule(manager, request, 10)
    assert new_blocks is not None and [len(b) for b in new_blocks] == [3, 3, 3]
    ids = manager.get_block_ids("r")
    assert len({i for group in ids for i in group}) == 9, "groups never share a block"
    assert manager.num_free_blocks == 64 - 9


def test_sliding_groups_free_blocks_as_a_request_decodes() -> None:
    manager = make_manager()
    request = make_request("r", list(range(8)))
    schedule(manager, request, 8)
    for _ in range(24):
        request.append_output_token_ids([1])
        schedule(manager, request, 1)
        num_computed = request.num_computed_tokens
        # this step's query sat at num_computed - 1: positions before it - W + 1 are dead
        first_live = max(0, num_computed - 1 - WINDOW + 1) // BLOCK_SIZE
        num_blocks = -(-num_computed // BLOCK_SIZE)
        for group_id in (1, 2):
            assert live_blocks(manager, "r", group_id) == list(range(first_live, num_blocks))
        assert live_blocks(manager, "r", 0) == list(range(num_blocks))
    # 32 tokens: 8 full blocks; each sliding group keeps 2 (positions 27..31 need 26..31)
    assert manager.num_held_blocks("r") == 8 + 2 + 2
    assert manager.num_free_blocks == 64 - 12


def test_chunked_prefill_keeps_the_window_before_each_chunk() -> None:
    manager = make_manager()
    request = make_request("r", list(range(30)))
    schedule(manager, request, 12)  # tokens 0..11
    schedule(manager, request, 8)  # next chunk starts at 12: its first query needs 7..12
    assert live_blocks(manager, "r", 1) == [1, 2, 3, 4]  # block 0 (0..3) is dead, block 1 (4..7) is not
    schedule(manager, request, 10)  # starts at 20: needs 15..; blocks 0..2 are dead
    assert live_blocks(manager, "r", 1) == [3, 4, 5, 6, 7]
    assert live_blocks(manager, "r", 0) == list(range(8))


def test_prefix_hit_must_hold_in_every_group() -> None:
    manager = make_manager()
    a = make_request("a", list(range(17)))
    run_to_completion(manager, a, chunk=17, num_decodes=0)
    manager.free(a)
    b = make_request("b", list(range(17)) + [99])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 16 and [len(h) for h in hits] == [4, 4, 4]
    # Evict one sliding group's block 1: no group may claim more than the others support.
    victim = hits[2][1]
    manager.block_pool.free_block_queue.remove(victim)
    manager.block_pool.free_block_queue.appendleft(victim)
    manager.block_pool.get_new_blocks(1)
    manager.block_pool.free_blocks([victim])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4 and [len(h) for h in hits] == [1, 1, 1]


def test_prefix_hit_outside_the_window_is_not_referenced() -> None:
    manager = make_manager()
    a = make_request("a", list(range(20)))
    run_to_completion(manager, a, chunk=20, num_decodes=0)
    b = make_request("b", list(range(20)) + [5, 6])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 20
    a_sliding = manager.get_blocks("a")[1]
    assert schedule(manager, b, 22) is not None
    # b's next query is at 20, which needs 15..: blocks 0..2 of the sliding groups are dead for
    # it, so b takes a reference on its full-group hits and on the live sliding ones only.
    assert live_blocks(manager, "b", 1) == [3, 4, 5]
    assert all(manager.get_blocks("b")[1][i] is NULL_BLOCK for i in range(3))
    assert [a_sliding[i].ref_cnt for i in range(5)] == [1, 1, 1, 2, 2]
    assert all(block.ref_cnt == 2 for block in manager.get_blocks("a")[0])


def test_preemption_frees_every_group_and_nothing_leaks() -> None:
    manager = make_manager(num_blocks=24)
    a, b = make_request("a", list(range(16))), make_request("b", list(range(100, 116)))
    schedule(manager, a, 16)
    schedule(manager, b, 16)
    assert manager.num_free_blocks == 0
    # b is preempted (recomputed later): every group gives its blocks back
    manager.free(b)
    b.num_computed_tokens = 0
    assert all("b" not in m.req_to_blocks for m in manager.managers)
    run_to_completion(manager, a, chunk=16, num_decodes=20)
    manager.free(a)
    assert manager.num_free_blocks == 24
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


@pytest.mark.parametrize("seed", range(4))
def test_random_requests_leave_no_block_behind(seed: int) -> None:
    rng = random.Random(seed)
    manager = make_manager(num_blocks=48, enable_caching=seed % 2 == 0)
    base = [rng.randrange(50) for _ in range(24)]
    running: list[Request] = []
    for step in range(300):
        if rng.random() < 0.3 and len(running) < 4:
            request = make_request(f"r{step}", base[: rng.randrange(1, 24)] + [rng.randrange(50)])
            if schedule(manager, request, rng.randint(1, 12)) is not None:
                running.append(request)
            continue
        if not running:
            continue
        request = rng.choice(running)
        if request.num_computed_tokens >= request.num_tokens:
            request.append_output_token_ids([rng.randrange(50)])
        chunk = rng.randint(1, request.num_tokens - request.num_computed_tokens)
        if request.num_tokens >= 60 or schedule(manager, request, chunk) is None:
            manager.free(request)  # finished, or preempted
            running.remove(request)
            continue
        num_computed = request.num_computed_tokens
        first_live = max(0, num_computed - chunk - WINDOW + 1) // BLOCK_SIZE
        for group_id in (1, 2):
            assert live_blocks(manager, request.request_id, group_id)[0] == first_live
    for request in running:
        manager.free(request)
    assert manager.num_free_blocks == 48
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
