"""Per-request block tables on top of the block pool; the scheduler's view of the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.core.kv_cache.block_hash import update_block_hashes
from pagedlm.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedlm.core.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, counted in tokens."""

    num_requests: int = 0
    num_queries_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queries_tokens if self.num_queries_tokens else 0.0


class KVCacheManager:
    """Maps requests to KV-cache blocks and finds prefix-cache hits for new requests.

    The scheduler calls ``get_computed_blocks`` once for a request it is about to start, then
    ``allocate_slots`` every step it schedules tokens for the request, and ``free`` when the
    request finishes or is preempted.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} is invalid: must be a positive number of tokens")
        if max_model_len <= 0:
            raise ValueError(f"max_model_len={max_model_len} is invalid: must be positive")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # request id -> its block table (block i holds tokens [i * block_size, (i + 1) * block_size)).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many leading blocks of its table have had their hash recorded (or came
        # from hits), so each allocation only hashes the blocks that became full since.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.block_pool.num_cached_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of KV-cache blocks in use."""
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as (blocks, number of tokens they hold).

        The blocks are not referenced yet: pass them to ``allocate_slots`` in the same step,
        before any other allocation can evict them.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
            return [], 0
        update_block_hashes(request, self.block_size)
        # NOTE: never report every token as computed: the last one must run through the model to
        # produce the logits of the next token. Hence at most (num_tokens - 1) // block_size blocks.
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks = []
        for block_hash in request.block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        # NOTE: stats are recorded when the request is admitted (allocate_slots), not here: the
        # scheduler looks up a waiting request again every step until it fits.
        return computed_blocks, len(computed_blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of the request.

        After the call the request holds blocks for ``request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens`` tokens. ``new_computed_blocks`` (prefix hits
        from ``get_computed_blocks``, holding ``num_new_computed_tokens`` tokens) may only be
        passed on the request's first allocation; they start its block table.

        Returns the newly allocated blocks (possibly empty), or None when there are not enough
        free blocks — in which case nothing has changed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} is invalid: must be >= 0")
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks and not new_computed_blocks:
            # The common case (a decode step): the held blocks may already have room.
            num_total_tokens = request.num_computed_tokens + num_new_tokens
            if num_total_tokens <= len(req_blocks) * self.block_size and num_total_tokens <= self.max_model_len:
                if self.enable_caching:
                    self._cache_full_blocks(request, req_blocks, min(num_total_tokens, request.num_tokens))
                return []
        new_computed_blocks = new_computed_blocks or []
        if new_computed_blocks and req_blocks:
            raise ValueError(
                f"request {request.request_id!r} already holds blocks; prefix hits may only be "
                "passed on its first allocation"
            )
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_total_tokens = num_computed_tokens + num_new_tokens
        if num_total_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} needs KV slots for {num_total_tokens} tokens, more "
                f"than max_model_len={self.max_model_len}"
            )
        num_held_blocks = len(req_blocks) if req_blocks else 0
        num_required_blocks = -(-num_total_tokens // self.block_size)
        num_new_blocks = max(0, num_required_blocks - num_held_blocks - len(new_computed_blocks))

        # Hit blocks that are currently free leave the free pool when touched, so they compete
        # with the new blocks for the same free slots.
        num_revived_blocks = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_revived_blocks > self.block_pool.num_free_blocks:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
            if self.enable_caching:
                stats = self.prefix_cache_stats
                stats.num_requests += 1
                stats.num_queries_tokens += request.num_tokens
                stats.num_hit_tokens += num_new_computed_tokens
        if new_computed_blocks:
            # NOTE: touch the hits before taking new blocks; otherwise get_new_blocks could pop
            # (and evict) a free hit block that this very request is about to reuse.
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, min(num_total_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_known_tokens: int) -> None:
        # NOTE: blocks are recorded when scheduled, before their K/V are written. That is safe:
        # a later hit is scheduled in a later step (or later in the same forward pass, which
        # writes every layer's K/V before reading it), and a block's tokens never change.
        num_full_blocks = num_known_tokens // self.block_size
        num_cached_blocks = self.num_cached_blocks[request.request_id]
        if num_full_blocks <= num_cached_blocks:
            return
        update_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached_blocks, num_full_blocks)
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks and forget it; a no-op for a request holding none."""
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if req_blocks:
            # Reverse order: a sequence's tail blocks are evicted before its head, because the
            # head is the part other requests are most likely to share.
            self.block_pool.free_blocks(reversed(req_blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (the live list: do not modify it)."""
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; fails (returns False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def reset_prefix_cache_stats(self) -> PrefixCacheStats:
        """Start counting afresh; returns the counters collected so far."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats
