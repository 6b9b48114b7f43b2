"""Per-request block tables on top of the block pool; the scheduler's view of the KV cache.

``KVCacheManager`` is the coordinator of the KV-cache groups (kv_cache/spec.py): one
:class:`~pagedlm.core.kv_cache.single_type_manager.SingleTypeKVCacheManager` per group, all
drawing from one :class:`BlockPool`. Block tables travel per group: ``tuple[list, ...]`` indexed by
group id. A model with one attention span has one group, exactly one block table per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedlm.core.kv_cache.block_hash import update_block_hashes
from pagedlm.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedlm.core.kv_cache.single_type_manager import SingleTypeKVCacheManager, make_single_type_manager
from pagedlm.core.kv_cache.spec import FullAttentionSpec, KVCacheGroupSpec
from pagedlm.core.request import Request

#: one list of blocks per KV-cache group
GroupBlocks = tuple[Sequence[KVCacheBlock], ...]


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
    """Maps requests to KV-cache blocks, per group, and finds prefix-cache hits for new requests.

    The scheduler calls ``get_computed_blocks`` once for a request it is about to start, then
    ``allocate_slots`` every step it schedules tokens for the request, and ``free`` when the
    request finishes or is preempted. ``kv_cache_groups`` defaults to one full-attention group.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int,
                 kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} is invalid: must be a positive number of tokens")
        if max_model_len <= 0:
            raise ValueError(f"max_model_len={max_model_len} is invalid: must be positive")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        groups = list(kv_cache_groups) if kv_cache_groups else [KVCacheGroupSpec((), FullAttentionSpec())]
        self.kv_cache_groups = groups
        self.managers: list[SingleTypeKVCacheManager] = [
            make_single_type_manager(group.spec, self.block_pool, block_size, group_id)
            for group_id, group in enumerate(groups)
        ]
        self.num_groups = len(groups)
        #: the one manager of a single full-attention group (most models), for the decode fast path
        self._single_full = self.managers[0] if groups == [KVCacheGroupSpec(groups[0].layer_names,
                                                                            FullAttentionSpec())] else None
        # NOTE: shared empty hit lists: nothing appends to a hit list, it is only read.
        self._no_blocks: GroupBlocks = tuple([] for _ in groups)
        self.prefix_cache_stats = PrefixCacheStats()
        #: request id -> ``num_computed_tokens + num_new_tokens`` up to which ``allocate_slots``
        #: has nothing to do (kept for one full-attention group, where it is one comparison per
        #: decode step; absent means "look")
        self._no_op_limit: dict[str, int] = {}

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

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix of the request, as (blocks per group, number of tokens they hold).

        The hit length is one every group supports (each group's cached prefix is at least that
        long). The blocks are not referenced yet: pass them to ``allocate_slots`` in the same
        step, before any other allocation can evict them.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
            return self._no_blocks, 0
        update_block_hashes(request, self.block_size)
        # NOTE: never report every token as computed: the last one must run through the model to
        # produce the logits of the next token. Hence at most (num_tokens - 1) // block_size blocks.
        num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for manager in self.managers:
            group_hits = manager.find_cache_hit(request.block_hashes, num_hit_blocks)
            num_hit_blocks = len(group_hits)
            hits.append(group_hits)
        # NOTE: stats are recorded when the request is admitted (allocate_slots), not here: the
        # scheduler looks up a waiting request again every step until it fits.
        return tuple(group_hits[:num_hit_blocks] for group_hits in hits), num_hit_blocks * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
        num_new_computed_tokens: int = 0,
        num_tokens_to_cache: int | None = None,
    ) -> GroupBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of the request.

        After the call the request holds blocks for ``request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens`` tokens, minus the blocks of sliding-window
        groups that no query from ``request.num_computed_tokens`` on can see (those are freed
        first). ``new_computed_blocks`` (prefix hits from ``get_computed_blocks``, holding
        ``num_new_computed_tokens`` tokens) may only be passed on the request's first allocation;
        they start its block tables.

        ``num_tokens_to_cache`` caps the prefix-cache recording of the request's full blocks (blocks
        a KV connector has yet to fill: :meth:`cache_computed_blocks` records them once filled).

        Returns the newly allocated blocks per group (possibly empty), or None when there are not
        enough free blocks — in which case nothing has changed but the freeing of dead blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} is invalid: must be >= 0")
        request_id = request.request_id
        if not new_computed_blocks and \
                request.num_computed_tokens + num_new_tokens <= self._no_op_limit.get(request_id, -1):
            # The common case (a decode step of a one-table model): the held blocks have room and
            # no block becomes full, so there is nothing to do.
            return self._no_blocks
        managers, single = self.managers, self._single_full
        is_new = request_id not in managers[0].req_to_blocks
        hits = new_computed_blocks or self._no_blocks
        if new_computed_blocks and any(new_computed_blocks) and any(m.req_to_blocks.get(request_id) for m in managers):
            raise ValueError(
                f"request {request_id!r} already holds blocks; prefix hits may only be passed on its "
                "first allocation"
            )
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_total_tokens = num_computed_tokens + num_new_tokens
        if num_total_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r} needs KV slots for {num_total_tokens} tokens, more "
                f"than max_model_len={self.max_model_len}"
            )
        if single is None:
            for manager in managers:
                manager.remove_skipped_blocks(request_id, num_computed_tokens)
        # Hit blocks that are currently free leave the free pool when touched, so they compete
        # with the new blocks for the same free slots.
        num_needed = 0
        for manager, group_hits in zip(managers, hits):
            num_needed += manager.num_blocks_to_allocate(request_id, num_total_tokens, group_hits,
                                                         num_computed_tokens)
        if num_needed > self.block_pool.num_free_blocks:
            return None
        if is_new and self.enable_caching:
            stats = self.prefix_cache_stats
            stats.num_requests += 1
            stats.num_queries_tokens += request.num_tokens
            stats.num_hit_tokens += num_new_computed_tokens
        new_blocks = tuple(
            manager.allocate(request_id, num_total_tokens, group_hits, num_computed_tokens)
            for manager, group_hits in zip(managers, hits)
        )
        if self.enable_caching:
            num_known_tokens = min(num_total_tokens, request.num_tokens)
            if num_tokens_to_cache is not None:
                num_known_tokens = min(num_known_tokens, num_tokens_to_cache)
            for manager in managers:
                manager.cache_blocks(request, num_known_tokens)
        if single is not None:
            self._no_op_limit[request_id] = self._next_no_op_limit(single, request_id)
        return new_blocks

    def _next_no_op_limit(self, manager: SingleTypeKVCacheManager, request_id: str) -> int:
        """Tokens up to which the request's next allocations change nothing (one full-attention
        group): its blocks hold them, and its next block to cache is not full yet."""
        limit = min(len(manager.req_to_blocks[request_id]) * self.block_size, self.max_model_len)
        if self.enable_caching:
            # (cache_blocks records a block once the request's known tokens fill it)
            limit = min(limit, (manager.num_cached_blocks[request_id] + 1) * self.block_size - 1)
        return limit

    def cache_computed_blocks(self, request: Request, num_tokens: int) -> None:
        """Record in the prefix cache the request's full blocks within its first ``num_tokens``
        tokens (blocks a KV connector filled after they were allocated)."""
        if not self.enable_caching:
            return
        for manager in self.managers:
            manager.cache_blocks(request, min(num_tokens, request.num_tokens))
        self._no_op_limit.pop(request.request_id, None)

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group and forget it; a no-op for a request
        holding none."""
        self._no_op_limit.pop(request.request_id, None)
        for manager in self.managers:
            manager.free(request.request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        """The request's block table per group (the live lists: do not modify them)."""
        return tuple(manager.req_to_blocks.get(request_id, []) for manager in self.managers)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids per group; a sliding group's freed entries read 0 (``NULL_BLOCK``)."""
        return tuple([block.block_id for block in manager.req_to_blocks.get(request_id, ())]
                     for manager in self.managers)

    def num_held_blocks(self, request_id: str) -> int:
        """Pool blocks the request holds over all groups (freed window entries not counted)."""
        return sum(
            sum(1 for block in manager.req_to_blocks.get(request_id, ()) if block.ref_cnt > 0)
            for manager in self.managers
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; fails (returns False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def reset_prefix_cache_stats(self) -> PrefixCacheStats:
        """Start counting afresh; returns the counters collected so far."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats
