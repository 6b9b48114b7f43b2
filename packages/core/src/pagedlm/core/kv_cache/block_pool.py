"""The pool of fixed-size KV-cache blocks: ref counts, a free queue and the prefix-cache map.

Pure bookkeeping: a block is an id into the worker's KV tensors, never a tensor itself.

A block is in exactly one of two states:
- in use: ``ref_cnt > 0`` and held by that many requests; never in the free queue;
- free: ``ref_cnt == 0`` and in the free queue. A free block may still carry a ``block_hash``;
  its K/V stay valid until the block is handed out again, so a prefix-cache hit can revive it.

The free queue is the eviction order: ``get_new_blocks`` takes from the head, so the head is the
least recently freed block.

The pool serves every KV-cache group (kv_cache/spec.py): a block is held by one group at a time,
and the prefix cache keys a block by its chained hash *and* its group (:func:`cache_key`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


class KVCacheBlock:
    """Metadata of one KV-cache block."""

    __slots__ = ("block_hash", "block_id", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Chained hash of the block's tokens once it is full and recorded in the prefix cache.
        # NOTE: a block has a hash iff the pool's hash map points at it under that hash.
        self.block_hash: bytes | None = None
        # Links of the free queue; both None while the block is not queued.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        hash_str = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hash_str})"


#: Stands in a block table for a block freed because it left a sliding window: never in the pool,
#: never referenced or cached. Its id 0 is a real block of the pool, so the worker's table holds a
#: valid index there; attention never reads it (the window masks those positions).
NULL_BLOCK = KVCacheBlock(0)


def cache_key(block_hash: bytes, group_id: int) -> bytes:
    """The prefix-cache key of a block of ``group_id``: equal tokens hold different K/V in
    different groups (other layers). Group 0 keys by the plain hash."""
    return block_hash if group_id == 0 else block_hash + group_id.to_bytes(2, "little")


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) pop, append and removal from the middle.

    A prefix-cache hit on a free block must take it out of the queue wherever it sits, which a
    deque cannot do cheaply; intrusive links on the blocks can.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels remove every empty-list special case from the link updates.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise IndexError("no free KV-cache block left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Queue ``block`` last: it will be the last to be evicted."""
        self._insert_after(self._tail.prev_free_block, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Queue ``block`` first: it will be the next one handed out."""
        self._insert_after(self._head, block)

    def _insert_after(self, prev_block: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert prev_block is not None and prev_block.next_free_block is not None
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        next_block = prev_block.next_free_block
        block.prev_free_block = prev_block
        block.next_free_block = next_block
        prev_block.next_free_block = block
        next_block.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to be evicted) first. O(n); for tests and debugging."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    """Owns every KV-cache block; hands them out, takes them back and keeps the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Prefix cache: block hash -> the one block holding that content.
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # Kept incrementally so metrics can read it every step without a scan.
        self._num_cached_free_blocks = 0
        #: called with each cached block just before it is evicted (its K/V still intact until
        #: this step's forward); a KV connector's offload tier listens here
        self.evict_listener: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached hash (reusable by a hit until evicted)."""
        return self._num_cached_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (held by at least one request)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(cache_key(block_hash, group_id))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ``ref_cnt`` 1.

        A taken block that was in the prefix cache is evicted from it: its K/V are about to be
        overwritten.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} new blocks: only {self.num_free_blocks} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None and block.ref_cnt == 0
        if self.evict_listener is not None:
            self.evict_listener(block)
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self._num_cached_free_blocks -= 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix-cache hits), reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                # NOTE: ref_cnt == 0 <=> the block is in the free queue.
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Record in the prefix cache ``blocks[num_cached_blocks:num_full_blocks]``.

        ``blocks`` is a request's block table in group ``group_id`` and ``block_hashes`` its
        chained hashes, which must cover at least ``num_full_blocks`` blocks. The first
        ``num_cached_blocks`` were recorded before (or came from hits) and are skipped, and so
        are ``NULL_BLOCK`` entries (blocks already freed out of a sliding window).
        """
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        if len(block_hashes) < num_full_blocks:
            raise ValueError(f"{len(block_hashes)} block hashes cannot cover {num_full_blocks} full blocks")
        hash_to_block = self.cached_block_hash_to_block
        for block_idx in range(num_cached_blocks, num_full_blocks):
            block = blocks[block_idx]
            if block.block_hash is not None or block is NULL_BLOCK:
                # Already recorded (e.g. it was a hit on a later allocation path); nothing new.
                continue
            block_hash = cache_key(block_hashes[block_idx], group_id)
            if block_hash in hash_to_block:
                # Another block already holds this content (two requests computed the same
                # prefix at once). Keep the existing mapping; this block stays uncached and is
                # simply recycled when freed, so the map never points at two blocks.
                continue
            hash_to_block[block_hash] = block
            block.block_hash = block_hash

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take blocks in use out of the prefix cache (their K/V turned out to be wrong)."""
        for block in blocks:
            if block.block_hash is not None and self.cached_block_hash_to_block.get(block.block_hash) is block:
                assert block.ref_cnt > 0, "only blocks in use can be uncached"
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero become free in the given order.

        Cached blocks join the tail of the free queue (evicted last). Uncached blocks hold nothing
        worth keeping, so they join the head and are reused before any cached block is evicted.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} is freed more often than it was allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)
                    self._num_cached_free_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed while no block is in use; returns success."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self._num_cached_free_blocks = 0
        return True
