"""The scheduler's encoder cache without a model: budgets cut prefill chunks before an image that
does not fit, outputs are computed once per hash and shared, and evicted only when unreferenced."""

from __future__ import annotations

from types import SimpleNamespace

from pagedlm.core.kv_cache.block_hash import update_block_hashes
from pagedlm.core.multimodal.encoder_cache import EncoderCacheManager
from pagedlm.core.multimodal.inputs import MultiModalFeature


def _request(rid, *items, num_prompt=100):
    features = [MultiModalFeature("image", key, offset, length) for key, offset, length in items]
    return SimpleNamespace(request_id=rid, mm_features=features, num_prompt_tokens=num_prompt)


def test_budget_cuts_the_chunk_before_an_image_that_does_not_fit():
    cache = EncoderCacheManager(cache_size=20, max_num_encoder_input_tokens=20)
    cache.begin_step()
    a = _request("a", ("x", 2, 16), ("y", 30, 16))
    n, todo = cache.plan(a, 0, 50)
    assert (n, todo) == (30, [0])  # y does not fit the step's budget after x: stop before it
    cache.commit(a, 0, n, todo)
    b = _request("b", ("x", 5, 16))
    assert cache.plan(b, 0, 40) == (40, [])  # the same image is cached: shared, not recomputed
    cache.commit(b, 0, 40, [])
    assert cache.end_step() == []
    # next step: both passed x and let go of it; a is at y, which needs x's space: x is evicted
    cache.begin_step()
    assert cache.plan(b, 40, 1) == (1, [])
    assert cache.refs["x"] == {"a"}
    assert cache.plan(a, 30, 20) == (20, [1])  # a passed x too: unreferenced, its space reclaimable
    assert "x" not in cache.refs and "x" in cache.freeable
    cache.commit(a, 30, 20, [1])
    assert cache.end_step() == ["x"]  # the workers are told to drop it
    c = _request("c", ("z", 0, 8))
    cache.begin_step()
    assert cache.plan(c, 0, 10) == (0, [])  # y (16, held by a) leaves no room for z (8)
    cache.free_request(a)
    n, todo = cache.plan(c, 0, 10)
    assert (n, todo) == (10, [0])
    cache.commit(c, 0, n, todo)
    assert cache.end_step() == ["y"]
    cache.free_request(c)
    assert not cache.refs and not cache.held and cache.num_free + sum(cache.freeable.values()) == 20


def test_without_chunked_prefill_a_prompt_waits_for_all_its_images():
    cache = EncoderCacheManager(cache_size=16, max_num_encoder_input_tokens=16)
    cache.begin_step()
    a = _request("a", ("x", 0, 16), ("y", 20, 16))
    assert cache.plan(a, 0, 40, enable_chunked_prefill=False) == (0, [0])


def test_block_hashes_cover_the_images_of_their_blocks():
    def hashes(key):
        req = SimpleNamespace(all_token_ids=[1, 2, 9, 9, 9, 9, 3, 4], block_hashes=[], block_hash_seed=None,
                              mm_features=[MultiModalFeature("image", key, 2, 4)])
        update_block_hashes(req, 2)
        return req.block_hashes

    one, other = hashes("x"), hashes("y")
    assert one[0] == other[0]  # the text before the image is shared
    assert all(a != b for a, b in zip(one[1:], other[1:]))  # the image and everything after it is not


def test_items_attended_both_ways_are_never_split_across_steps():
    cache = EncoderCacheManager(cache_size=16, max_num_encoder_input_tokens=16, whole_items=True)
    cache.begin_step()
    a = _request("a", ("x", 4, 8))
    assert cache.plan(a, 0, 10) == (4, [])  # would end inside x: stop before it
    assert cache.plan(a, 0, 12) == (12, [0])
    assert cache.plan(a, 6, 4) == (0, [])  # a prefix-cache hit inside x: wait for room for its rest
    assert cache.plan(a, 6, 6) == (6, [0])
