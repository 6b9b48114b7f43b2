"""Paged KV-cache bookkeeping: block pool, prefix-cache hashing and per-request block tables."""

from pagedlm.core.kv_cache.block_hash import hash_block_tokens, update_block_hashes
from pagedlm.core.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedlm.core.kv_cache.kv_cache_manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block_tokens",
    "update_block_hashes",
]
