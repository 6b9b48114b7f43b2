"""KV-cache bookkeeping: block pool, prefix-cache hashing and the KV-cache manager (no model)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagedlm.core.kv_cache import (
    BlockPool,
    KVCacheBlock,
    KVCacheManager,
    PrefixCacheStats,
    hash_block_tokens,
    update_block_hashes,
)
from pagedlm.core.request import Request
from pagedlm.core.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt_token_ids: list[int], prompt_logprobs: int | None = None) -> Request:
    params = SamplingParams(max_tokens=64, prompt_logprobs=prompt_logprobs)
    return Request(request_id, prompt_token_ids, params)


def make_manager(num_blocks: int = 16, enable_caching: bool = True, max_model_len: int = 1024) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, max_model_len)


def start(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> list[KVCacheBlock] | None:
    """Schedule a waiting request the way the scheduler does: look up hits, then allocate."""
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_computed_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, computed_blocks, num_computed_tokens)
    if new_blocks is None:
        return None
    request.num_computed_tokens = num_computed_tokens + num_new_tokens
    return list(new_blocks[0])


def decode(manager: KVCacheManager, request: Request, token_id: int) -> list[KVCacheBlock] | None:
    """Append one sampled token and schedule it (the token the model must now process)."""
    request.append_output_token_ids([token_id])
    new_blocks = manager.allocate_slots(request, 1)
    if new_blocks is None:
        return None
    request.num_computed_tokens += 1
    return list(new_blocks[0])


def free_queue_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


# ---------------------------------------------------------------------------------------------
# Hashing


def test_hash_chain_depends_on_every_earlier_block() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h0, bytes)
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    # Same tokens in the second block, different first block: different chain.
    a = make_request("a", [1, 2, 3, 4, 9, 9, 9, 9])
    b = make_request("b", [1, 2, 3, 5, 9, 9, 9, 9])
    update_block_hashes(a, BLOCK_SIZE)
    update_block_hashes(b, BLOCK_SIZE)
    assert a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[1] == hash_block_tokens(a.block_hashes[0], [9, 9, 9, 9])
    # A first block never equals the same tokens chained after some parent.
    assert hash_block_tokens(None, [7, 7]) != hash_block_tokens(h0, [7, 7])


def test_update_block_hashes_is_incremental_and_full_blocks_only() -> None:
    request = make_request("r", list(range(10)))
    update_block_hashes(request, BLOCK_SIZE)
    assert len(request.block_hashes) == 2  # 10 tokens: two full blocks, the rest is partial
    first_hashes = list(request.block_hashes)
    request.block_hashes[0] = b"sentinel"  # proves existing hashes are not recomputed
    request.append_output_token_ids([10, 11])
    update_block_hashes(request, BLOCK_SIZE)
    assert len(request.block_hashes) == 3
    assert request.block_hashes[0] == b"sentinel"
    assert request.block_hashes[1] == first_hashes[1]
    assert request.block_hashes[2] == hash_block_tokens(first_hashes[1], [8, 9, 10, 11])


# ---------------------------------------------------------------------------------------------
# Allocation


def test_allocation_grows_by_blocks() -> None:
    manager = make_manager(num_blocks=8)
    request = make_request("r", list(range(5)))
    new_blocks = start(manager, request)
    assert new_blocks is not None and len(new_blocks) == 2
    assert manager.get_block_ids("r")[0] == [b.block_id for b in new_blocks]
    assert manager.num_free_blocks == 6
    assert manager.usage == pytest.approx(2 / 8)
    # Tokens 6..8 fit in the second block; token 9 needs a third.
    for token_id in (100, 101, 102):
        assert decode(manager, request, token_id) == []
    assert len(manager.get_blocks("r")[0]) == 2
    third = decode(manager, request, 103)
    assert third is not None and len(third) == 1
    assert len(manager.get_block_ids("r")[0]) == 3
    assert manager.num_free_blocks == 5


def test_chunked_allocation_and_zero_new_tokens() -> None:
    manager = make_manager(num_blocks=8)
    request = make_request("r", list(range(10)))
    assert start(manager, request, num_new_tokens=3) is not None
    assert len(manager.get_blocks("r")[0]) == 1
    new_blocks = manager.allocate_slots(request, 7)
    assert new_blocks is not None and len(new_blocks[0]) == 2
    assert manager.allocate_slots(request, 0) == ([],)


def test_allocation_failure_changes_nothing() -> None:
    manager = make_manager(num_blocks=4)
    a = make_request("a", list(range(8)))
    assert start(manager, a) is not None
    manager.free(a)  # two cached free blocks now sit in the free queue
    hog = make_request("hog", list(range(100, 108)))
    assert start(manager, hog) is not None
    assert manager.num_free_blocks == 2 and manager.num_cached_free_blocks == 2
    before = (free_queue_ids(manager), [(b.block_id, b.ref_cnt, b.block_hash) for b in manager.block_pool.blocks])

    # The hits on a's blocks would revive two free blocks, and the rest needs more than is free.
    b = make_request("b", list(range(8)) + list(range(200, 220)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(b)
    result = manager.allocate_slots(b, b.num_tokens - num_computed_tokens, computed_blocks, num_computed_tokens)
    assert result is None
    after = (free_queue_ids(manager), [(b.block_id, b.ref_cnt, b.block_hash) for b in manager.block_pool.blocks])
    assert after == before
    assert manager.get_blocks("b")[0] == []
    assert "b" not in manager.managers[0].req_to_blocks

    # A running request that cannot grow keeps its table as it was.
    blocks_before = manager.get_block_ids("hog")[0]
    assert manager.allocate_slots(hog, 4 * BLOCK_SIZE) is None
    assert manager.get_block_ids("hog")[0] == blocks_before


def test_revived_hit_blocks_count_against_free_blocks() -> None:
    manager = make_manager(num_blocks=3)
    a = make_request("a", list(range(8)))
    assert start(manager, a) is not None
    manager.free(a)
    # 9 tokens: two hit blocks (both free) + one new block = exactly the 3 free blocks.
    b = make_request("b", list(range(8)) + [50])
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(b)
    assert num_computed_tokens == 8
    assert manager.allocate_slots(b, 1, computed_blocks, num_computed_tokens) is not None
    assert manager.num_free_blocks == 0
    manager.free(b)
    # Now 10 tokens would need 3 blocks + revive 2: one too many.
    c = make_request("c", list(range(8)) + [50, 51, 52, 53, 54])
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(c)
    assert num_computed_tokens == 8
    assert manager.allocate_slots(c, 5, computed_blocks, num_computed_tokens) is None
    assert manager.num_free_blocks == 3


def test_free_returns_blocks() -> None:
    manager = make_manager(num_blocks=8)
    request = make_request("r", list(range(9)))
    assert start(manager, request) is not None
    assert manager.num_free_blocks == 5
    manager.free(request)
    assert manager.num_free_blocks == 8
    assert manager.usage == 0.0
    assert manager.get_block_ids("r")[0] == []
    manager.free(request)  # freeing again is a no-op
    assert manager.num_free_blocks == 8


def test_max_model_len_is_enforced() -> None:
    manager = make_manager(num_blocks=16, max_model_len=10)
    request = make_request("r", list(range(8)))
    assert start(manager, request) is not None
    with pytest.raises(ValueError, match="max_model_len"):
        manager.allocate_slots(request, 3)


def test_prefix_hits_only_on_first_allocation() -> None:
    manager = make_manager()
    a = make_request("a", list(range(8)))
    assert start(manager, a) is not None
    b = make_request("b", list(range(8)) + [1])
    computed_blocks, _ = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 1) is not None
    with pytest.raises(ValueError, match="first allocation"):
        manager.allocate_slots(b, 1, computed_blocks, 8)


# ---------------------------------------------------------------------------------------------
# Prefix caching


def test_prefix_hit_block_aligned() -> None:
    manager = make_manager()
    shared = list(range(8))
    a = make_request("a", shared + [50, 51, 52])
    assert start(manager, a) is not None
    b = make_request("b", shared + [60, 61, 62, 63, 64])
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(b)
    assert num_computed_tokens == 8
    assert computed_blocks[0] == manager.get_blocks("a")[0][:2]
    new_blocks = manager.allocate_slots(b, b.num_tokens - 8, computed_blocks, num_computed_tokens)
    assert new_blocks is not None and len(new_blocks[0]) == 2
    assert manager.get_block_ids("b")[0][:2] == manager.get_block_ids("a")[0][:2]
    assert all(block.ref_cnt == 2 for block in computed_blocks[0])
    assert manager.prefix_cache_stats.num_hit_tokens == 8


def test_prefix_hit_not_block_aligned() -> None:
    manager = make_manager()
    a = make_request("a", list(range(10)))  # blocks [0..3] [4..7] and a partial [8, 9]
    assert start(manager, a) is not None
    b = make_request("b", list(range(10)) + [77])  # shares 10 tokens; only 2 full blocks hit
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(b)
    assert num_computed_tokens == 8
    assert [blk.block_id for blk in computed_blocks[0]] == manager.get_block_ids("a")[0][:2]
    c = make_request("c", list(range(6)) + [99, 99, 99])  # diverges inside the second block
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(c)
    assert num_computed_tokens == 4
    assert [blk.block_id for blk in computed_blocks[0]] == manager.get_block_ids("a")[0][:1]


def test_full_prompt_hit_keeps_last_token_uncomputed() -> None:
    manager = make_manager()
    prompt = list(range(12))  # exactly three full blocks
    a = make_request("a", prompt)
    assert start(manager, a) is not None
    manager.free(a)
    b = make_request("b", prompt)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(b)
    assert num_computed_tokens == 8 < b.num_tokens
    assert len(computed_blocks[0]) == 2
    # The last block is recomputed into a new block; 4 tokens to compute, one new block.
    new_blocks = manager.allocate_slots(b, 4, computed_blocks, num_computed_tokens)
    assert new_blocks is not None and len(new_blocks[0]) == 1
    # A prompt shorter than a block never hits.
    short = make_request("short", [0, 1, 2, 3])
    assert manager.get_computed_blocks(short) == (([],), 0)


def test_generated_tokens_are_cached_too() -> None:
    manager = make_manager()
    a = make_request("a", [1, 2, 3])
    assert start(manager, a) is not None
    for token_id in (4, 5, 6, 7, 8):
        assert decode(manager, a, token_id) is not None
    # a now holds [1..8] computed (8 tokens = two full blocks) -> both are cached.
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _, num_computed_tokens = manager.get_computed_blocks(b)
    assert num_computed_tokens == 8


def test_unscheduled_tokens_are_not_cached() -> None:
    manager = make_manager()
    a = make_request("a", list(range(12)))
    assert start(manager, a, num_new_tokens=5) is not None  # chunked prefill: 5 of 12 tokens
    b = make_request("b", list(range(12)) + [1])
    _, num_computed_tokens = manager.get_computed_blocks(b)
    assert num_computed_tokens == 4  # only the first block is fully scheduled


def test_cached_free_block_is_revived_by_hit() -> None:
    manager = make_manager(num_blocks=8)
    a = make_request("a", list(range(9)))
    assert start(manager, a) is not None
    a_block_ids = manager.get_block_ids("a")[0]
    manager.free(a)
    assert manager.num_free_blocks == 8
    assert manager.num_cached_free_blocks == 2
    b = make_request("b", list(range(8)) + [40, 41])
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in computed_blocks[0]] == a_block_ids[:2]
    assert all(blk.ref_cnt == 0 for blk in computed_blocks[0])
    assert manager.allocate_slots(b, 2, computed_blocks, num_computed_tokens) is not None
    assert all(blk.ref_cnt == 1 for blk in computed_blocks[0])
    assert not set(a_block_ids[:2]) & set(free_queue_ids(manager))
    assert manager.num_free_blocks == 5
    assert manager.num_cached_free_blocks == 0


def test_lru_eviction_order() -> None:
    manager = make_manager(num_blocks=6)
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(100, 108)))
    assert start(manager, a) is not None
    assert start(manager, b) is not None
    a_ids, b_ids = manager.get_block_ids("a")[0], manager.get_block_ids("b")[0]
    manager.free(a)  # freed first: evicted first, its tail block before its head
    manager.free(b)
    # The two never-used blocks are handed out before any cached block is evicted.
    uncached = make_request("u", list(range(200, 208)))
    assert start(manager, uncached) is not None
    assert set(manager.get_block_ids("u")[0]).isdisjoint(a_ids + b_ids)
    assert free_queue_ids(manager) == [a_ids[1], a_ids[0], b_ids[1], b_ids[0]]
    eviction_order = []
    for i in range(4):
        request = make_request(f"x{i}", list(range(300 + 10 * i, 304 + 10 * i)))
        new_blocks = manager.allocate_slots(request, 4)
        assert new_blocks is not None
        eviction_order.append(new_blocks[0][0].block_id)
    assert eviction_order == [a_ids[1], a_ids[0], b_ids[1], b_ids[0]]


def test_evicted_blocks_no_longer_hit() -> None:
    manager = make_manager(num_blocks=2)
    a = make_request("a", list(range(8)))
    assert start(manager, a) is not None
    manager.free(a)
    # Pushing a different sequence through evicts both of a's blocks.
    other = make_request("other", list(range(500, 508)))
    assert start(manager, other) is not None
    manager.free(other)
    again = make_request("again", list(range(8)) + [1])
    assert manager.get_computed_blocks(again) == (([],), 0)
    assert all(blk.block_hash != a.block_hashes[0] for blk in manager.block_pool.blocks)


def test_caching_disabled_gives_no_hits() -> None:
    manager = make_manager(enable_caching=False)
    a = make_request("a", list(range(8)))
    assert start(manager, a) is not None
    b = make_request("b", list(range(8)) + [1])
    assert manager.get_computed_blocks(b) == (([],), 0)
    assert all(blk.block_hash is None for blk in manager.block_pool.blocks)
    manager.free(a)
    assert manager.num_cached_free_blocks == 0


def test_prompt_logprobs_disables_hits() -> None:
    manager = make_manager()
    a = make_request("a", list(range(8)))
    assert start(manager, a) is not None
    b = make_request("b", list(range(8)) + [1], prompt_logprobs=1)
    assert manager.get_computed_blocks(b) == (([],), 0)


def test_prefix_cache_stats() -> None:
    manager = make_manager()
    a = make_request("a", list(range(8)))
    assert start(manager, a) is not None
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5, 6, 7, 8])
    # a lookup alone (the scheduler repeats it while a request waits) is not counted
    blocks, num_hit = manager.get_computed_blocks(b)
    manager.get_computed_blocks(b)
    assert manager.prefix_cache_stats.num_requests == 1
    assert manager.allocate_slots(b, b.num_tokens - num_hit, blocks, num_hit) is not None
    stats = manager.prefix_cache_stats
    assert (stats.num_requests, stats.num_queries_tokens, stats.num_hit_tokens) == (2, 24, 8)
    assert stats.hit_rate == pytest.approx(8 / 24)
    old = manager.reset_prefix_cache_stats()
    assert old.num_hit_tokens == 8
    assert manager.prefix_cache_stats == PrefixCacheStats()
    assert manager.prefix_cache_stats.hit_rate == 0.0


def test_reset_prefix_cache() -> None:
    manager = make_manager()
    a = make_request("a", list(range(8)))
    assert start(manager, a) is not None
    assert not manager.reset_prefix_cache()  # a block is in use
    manager.free(a)
    assert manager.num_cached_free_blocks == 2
    assert manager.reset_prefix_cache()
    assert manager.num_cached_free_blocks == 0
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(make_request("b", list(range(8)) + [1])) == (([],), 0)


def test_duplicate_hash_keeps_one_mapping() -> None:
    manager = make_manager(num_blocks=8)
    prompt = list(range(8))
    a, b = make_request("a", prompt + [1]), make_request("b", prompt + [2])
    # Both look up before either allocates, as when two requests compute the same prefix at once.
    assert manager.get_computed_blocks(a) == (([],), 0)
    assert manager.get_computed_blocks(b) == (([],), 0)
    assert manager.allocate_slots(a, a.num_tokens) is not None
    assert manager.allocate_slots(b, b.num_tokens) is not None
    a.num_computed_tokens, b.num_computed_tokens = a.num_tokens, b.num_tokens
    a_blocks, b_blocks = manager.get_blocks("a")[0], manager.get_blocks("b")[0]
    pool = manager.block_pool
    assert [pool.get_cached_block(h) for h in a.block_hashes] == a_blocks[:2]
    assert all(blk.block_hash is None for blk in b_blocks)
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 8
    assert manager.num_cached_free_blocks == 2
    check_invariants(manager, {})


def test_block_pool_direct() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    assert [blk.ref_cnt for blk in blocks] == [1, 1]
    assert pool.get_usage() == pytest.approx(0.5)
    h0 = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks(blocks, [h0], num_cached_blocks=0, num_full_blocks=1)
    assert pool.get_cached_block(h0) is blocks[0]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.free_blocks([blocks[0], blocks[1]])
    assert pool.num_free_blocks == 3  # blocks[0] is still referenced once
    pool.free_blocks([blocks[0]])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        pool.free_blocks([blocks[0]])
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=0, enable_caching=True)


# ---------------------------------------------------------------------------------------------
# Randomized property test


def check_invariants(manager: KVCacheManager, requests: dict[str, Request]) -> None:
    pool = manager.block_pool
    free_blocks = pool.free_block_queue.get_all_free_blocks()
    free_ids = [blk.block_id for blk in free_blocks]
    assert len(free_ids) == len(set(free_ids)) == manager.num_free_blocks
    assert set(manager.managers[0].req_to_blocks) == set(requests)
    holders = Counter()
    for request_id, req_blocks in manager.managers[0].req_to_blocks.items():
        ids = [blk.block_id for blk in req_blocks]
        assert len(ids) == len(set(ids)), f"block twice in the table of {request_id}"
        holders.update(ids)
        # A request holds exactly enough blocks for the tokens scheduled so far.
        request = requests[request_id]
        assert len(req_blocks) == -(-request.num_computed_tokens // manager.block_size)
    free_set = set(free_ids)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id]
        assert (block.ref_cnt == 0) == (block.block_id in free_set)
        if block.block_hash is not None:
            assert pool.cached_block_hash_to_block[block.block_hash] is block
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    num_cached_free = sum(1 for blk in free_blocks if blk.block_hash is not None)
    assert manager.num_cached_free_blocks == num_cached_free
    assert manager.usage == pytest.approx(1 - len(free_ids) / manager.num_blocks)


@pytest.mark.parametrize("enable_caching", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants(seed: int, enable_caching: bool) -> None:
    rng = random.Random(seed)
    manager = KVCacheManager(num_blocks=24, block_size=BLOCK_SIZE, enable_caching=enable_caching, max_model_len=64)
    # Simulated KV contents: block id -> token id written at each slot. A hit must find exactly the
    # request's own tokens there, which catches a block evicted or overwritten while still cached.
    kv_contents: dict[int, list[int | None]] = {blk.block_id: [None] * BLOCK_SIZE for blk in manager.block_pool.blocks}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    running: dict[str, Request] = {}
    waiting: list[Request] = []
    num_hit_tokens = 0

    def write_kv(request: Request, num_new_tokens: int) -> None:
        req_blocks = manager.get_blocks(request.request_id)[0]
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_new_tokens):
            kv_contents[req_blocks[pos // BLOCK_SIZE].block_id][pos % BLOCK_SIZE] = request.all_token_ids[pos]

    for step in range(400):
        op = rng.random()
        if op < 0.25:
            prompt = list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            if not prompt:
                prompt = [1]
            waiting.append(make_request(f"r{step}", prompt))
        elif op < 0.45 and waiting:
            request = waiting[0]
            computed_blocks, num_computed_tokens = manager.get_computed_blocks(request)
            assert num_computed_tokens < request.num_tokens
            assert num_computed_tokens == len(computed_blocks[0]) * BLOCK_SIZE
            for i, block in enumerate(computed_blocks[0]):
                expected = request.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                assert kv_contents[block.block_id] == expected
            num_remaining = request.num_tokens - num_computed_tokens
            num_new_tokens = rng.randint(1, num_remaining)  # chunked prefill
            free_before = manager.num_free_blocks
            new_blocks = manager.allocate_slots(request, num_new_tokens, computed_blocks, num_computed_tokens)
            if new_blocks is None:
                assert manager.num_free_blocks == free_before
                assert request.request_id not in manager.managers[0].req_to_blocks
            else:
                waiting.pop(0)
                request.num_computed_tokens = num_computed_tokens
                num_hit_tokens += num_computed_tokens
                write_kv(request, num_new_tokens)
                request.num_computed_tokens += num_new_tokens
                running[request.request_id] = request
        elif op < 0.85 and running:
            request = rng.choice(list(running.values()))
            if request.num_computed_tokens < request.num_tokens:  # continue a chunked prefill
                num_new_tokens = rng.randint(1, request.num_tokens - request.num_computed_tokens)
            elif request.num_tokens < manager.max_model_len:  # decode: one sampled token
                request.append_output_token_ids([rng.randrange(50)])
                num_new_tokens = 1
            else:
                continue
            table_before = manager.get_block_ids(request.request_id)[0]
            new_blocks = manager.allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                assert manager.get_block_ids(request.request_id)[0] == table_before
                # Preempt by recompute, as the scheduler does under KV pressure.
                manager.free(request)
                del running[request.request_id]
                request.num_computed_tokens = 0
                waiting.insert(0, request)
            else:
                write_kv(request, num_new_tokens)
                request.num_computed_tokens += num_new_tokens
        elif running:
            request = running.pop(rng.choice(list(running)))
            manager.free(request)
        check_invariants(manager, running)

    if enable_caching:
        assert num_hit_tokens > 0, "the workload was meant to produce prefix hits"
    else:
        assert num_hit_tokens == 0
    for request in list(running.values()):
        manager.free(request)
    check_invariants(manager, {})
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.reset_prefix_cache()
