"""The block tables of one KV-cache group: full attention, or a sliding window that frees blocks.

A request's table in a group is a list indexed by block position (block ``i`` holds tokens
``[i * block_size, (i + 1) * block_size)``). A sliding-window group replaces a block that no
future query can see by ``NULL_BLOCK`` and gives it back to the pool, so the table keeps its
positions while its memory shrinks to about the window.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedlm.core.kv_cache.block_hash import update_block_hashes
from pagedlm.core.kv_cache.block_pool import NULL_BLOCK, BlockPool, KVCacheBlock
from pagedlm.core.kv_cache.spec import AttentionSpec, SlidingWindowSpec
from pagedlm.core.request import Request


class SingleTypeKVCacheManager:
    """Block tables of one group; full attention (every block stays until the request ends)."""

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        #: request id -> its block table in this group
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        #: request id -> leading blocks of its table already recorded in the prefix cache (or
        #: hits), so each allocation hashes only the blocks that became full since
        self.num_cached_blocks: dict[str, int] = {}

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at position ``num_computed_tokens`` or later can attend to."""
        return 0

    # -- prefix-cache hits ------------------------------------------------------------------
    def find_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of ``block_hashes[:max_num_blocks]``.

        NOTE: every group, sliding ones included, requires the whole prefix to be cached. A
        sliding group would only need the blocks of the last window before the hit; the stricter
        rule is simpler and still correct (a hit is then valid for every group).
        """
        hits = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation -------------------------------------------------------------------------
    def _used_hits(self, hits: Sequence[KVCacheBlock], num_computed_tokens: int) -> Sequence[KVCacheBlock]:
        """The hits that enter the table as real blocks (out of the window: none of them)."""
        skip = self.num_skipped_blocks(num_computed_tokens)
        return hits[skip:] if skip else hits

    def num_blocks_to_allocate(self, request_id: str, num_total_tokens: int, hits: Sequence[KVCacheBlock],
                               num_computed_tokens: int) -> int:
        """Free blocks :meth:`allocate` would take: new blocks plus free hit blocks it revives."""
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new = -(-num_total_tokens // self.block_size) - num_held - len(hits)
        num_revived = sum(1 for block in self._used_hits(hits, num_computed_tokens) if block.ref_cnt == 0)
        return max(0, num_new) + num_revived

    def allocate(self, request_id: str, num_total_tokens: int, hits: Sequence[KVCacheBlock],
                 num_computed_tokens: int) -> list[KVCacheBlock]:
        """Extend the table to ``num_total_tokens`` tokens; ``hits`` start a new table. Returns the
        new blocks. The caller checked :meth:`num_blocks_to_allocate` against the free pool."""
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = 0
        if hits:
            skip = self.num_skipped_blocks(num_computed_tokens)
            used = self._used_hits(hits, num_computed_tokens)
            # NOTE: touch the hits before taking new blocks; otherwise get_new_blocks could pop
            # (and evict) a free hit block that this very request is about to reuse.
            self.block_pool.touch(used)
            req_blocks.extend([NULL_BLOCK] * skip)
            req_blocks.extend(used)
            self.num_cached_blocks[request_id] = len(hits)
        num_new = -(-num_total_tokens // self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no query from ``num_computed_tokens`` on can see (none here)."""

    def cache_blocks(self, request: Request, num_known_tokens: int) -> None:
        """Record in the prefix cache the request's blocks that are full of known tokens."""
        # NOTE: blocks are recorded when scheduled, before their K/V are written. That is safe:
        # a later hit is scheduled in a later step (or later in the same forward pass, which
        # writes every layer's K/V before reading it), and a block's tokens never change.
        num_full_blocks = num_known_tokens // self.block_size
        num_cached = self.num_cached_blocks[request.request_id]
        if num_full_blocks <= num_cached:
            return
        update_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(self.req_to_blocks[request.request_id], request.block_hashes, num_cached,
                                          num_full_blocks, self.group_id)
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if req_blocks:
            # Reverse order: a sequence's tail blocks are evicted before its head, because the
            # head is the part other requests are most likely to share.
            self.block_pool.free_blocks(b for b in reversed(req_blocks) if b is not NULL_BLOCK)


FullAttentionManager = SingleTypeKVCacheManager


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding-window group: blocks that left the window of every future query are freed.

    A query at position ``p`` sees positions ``p - W + 1 .. p``; the next query of a request is
    at ``num_computed_tokens`` (also the first query of a prefill chunk), so every position before
    ``num_computed_tokens - W + 1`` is dead, and so is every whole block of them.

    NOTE: a step still in flight (async scheduling, pipeline stages) may read a block freed while
    the next step is scheduled: its last query is one position earlier. That is safe because a
    freed block is only rewritten by a later step, and every rank runs its steps in order.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int, sliding_window: int) -> None:
        super().__init__(block_pool, block_size, group_id)
        self.sliding_window = sliding_window
        #: request id -> leading table entries already replaced by NULL_BLOCK
        self.num_freed_blocks: dict[str, int] = {}

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def allocate(self, request_id: str, num_total_tokens: int, hits: Sequence[KVCacheBlock],
                 num_computed_tokens: int) -> list[KVCacheBlock]:
        if hits:
            self.num_freed_blocks[request_id] = self.num_skipped_blocks(num_computed_tokens)
        return super().allocate(request_id, num_total_tokens, hits, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        req_blocks = self.req_to_blocks.get(request_id)
        if not req_blocks:
            return
        start = self.num_freed_blocks.get(request_id, 0)
        end = min(self.num_skipped_blocks(num_computed_tokens), len(req_blocks))
        if end <= start:
            return
        dead = req_blocks[start:end]
        req_blocks[start:end] = [NULL_BLOCK] * (end - start)
        self.num_freed_blocks[request_id] = end
        # Later blocks first, as in free(): within what is freed, the head stays cached longest.
        self.block_pool.free_blocks(b for b in reversed(dead) if b is not NULL_BLOCK)

    def free(self, request_id: str) -> None:
        self.num_freed_blocks.pop(request_id, None)
        super().free(request_id)


def make_single_type_manager(spec: AttentionSpec, block_pool: BlockPool, block_size: int,
                             group_id: int) -> SingleTypeKVCacheManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(block_pool, block_size, group_id, spec.sliding_window)
    return FullAttentionManager(block_pool, block_size, group_id)
