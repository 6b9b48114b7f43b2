"""Paged KV-cache bookkeeping: block pool, prefix-cache hashing, KV-cache groups and per-request
block tables."""

from pagedlm.core.kv_cache.block_hash import hash_block_tokens, update_block_hashes
from pagedlm.core.kv_cache.block_pool import NULL_BLOCK, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedlm.core.kv_cache.kv_cache_manager import GroupBlocks, KVCacheManager, PrefixCacheStats
from pagedlm.core.kv_cache.single_type_manager import FullAttentionManager, SlidingWindowManager
from pagedlm.core.kv_cache.spec import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    attention_spec,
    make_kv_cache_groups,
    max_blocks_per_request,
)

__all__ = [
    "NULL_BLOCK",
    "AttentionSpec",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "GroupBlocks",
    "KVCacheBlock",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "PrefixCacheStats",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "attention_spec",
    "hash_block_tokens",
    "make_kv_cache_groups",
    "max_blocks_per_request",
    "update_block_hashes",
]
