"""``OffloadingConnector``: a host-memory tier under the device prefix cache (vLLM's name).

A cached block the device prefix cache evicts (its K/V still intact: the step that reuses the
block has not run yet) is copied to a slot of a bounded host pool before that step's forward;
a later request whose prefix continues past its local hit into blocks the pool holds gets them
copied back into its new blocks before its forward, counted as computed (a synchronous load:
host memory does not fail). The pool evicts least recently used blocks, never one that a load
of the current step reads.

The scheduler half owns the pool's index (block hash -> slot), the worker half the bytes; the
metadata of a step tells the worker which device blocks to save to which slots (first) and which
slots to load into which device blocks (then).

``kv_connector_extra_config``: ``cpu_bytes_to_use`` (vLLM's), the pool's size in bytes;
``--kv-offloading-size GIB`` (alias ``--kv-offload-gib``) sets it up.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedlm.core.distributed.kv_transfer.base import (
    KVCacheInfo,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from pagedlm.core.kv_cache.block_hash import update_block_hashes

if TYPE_CHECKING:
    import torch

    from pagedlm.core.config import VllmConfig
    from pagedlm.core.kv_cache import KVCacheManager
    from pagedlm.core.kv_cache.block_pool import KVCacheBlock
    from pagedlm.core.request import Request
    from pagedlm.core.sched.output import SchedulerOutput


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    #: (device block id, host slot): copy out, before the loads and the forward
    saves: list[tuple[int, int]] = field(default_factory=list)
    #: (host slot, device block id): copy in, before the forward
    loads: list[tuple[int, int]] = field(default_factory=list)


class OffloadingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheInfo) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        size = self._kv_transfer_config.get_from_extra_config("cpu_bytes_to_use", None)
        if isinstance(size, bool) or not isinstance(size, int | float) or size <= 0:
            raise ValueError(f"OffloadingConnector: kv_connector_extra_config.cpu_bytes_to_use={size!r} must be a "
                             "positive number of bytes (or pass --kv-offloading-size GIB)")
        #: host blocks the pool holds; the two halves compute the same number
        self.num_host_blocks = int(size) // kv_cache_config.bytes_per_block
        if self.num_host_blocks < 1:
            raise ValueError(f"OffloadingConnector: cpu_bytes_to_use={size} holds no KV block "
                             f"({kv_cache_config.bytes_per_block} bytes each)")
        self.block_size = kv_cache_config.block_size
        # scheduler half: block hash -> slot, least recently used first
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._free_slots = list(range(self.num_host_blocks - 1, -1, -1))
        self._pending = OffloadingMetadata()
        #: slots a load of the step being built reads: not to be reused by a save of that step
        self._pinned: set[int] = set()
        self._matched: dict[str, tuple[int, list[int]]] = {}
        # worker half
        self._pool: torch.Tensor | None = None
        self._io: Any = None

    # -- scheduler half ------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Watch the device prefix cache's evictions (the scheduler calls this once)."""
        kv_cache_manager.block_pool.evict_listener = self._on_evict

    def _on_evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot is read this step: this block is dropped, as without the tier
        self._index[block_hash] = slot
        self._pending.saves.append((block.block_id, slot))

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for victim, slot in self._index.items():
            if slot not in self._pinned:
                del self._index[victim]
                return slot
        return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        first = num_computed_tokens // self.block_size
        limit = (request.num_tokens - 1) // self.block_size
        slots = []
        if first < limit:
            update_block_hashes(request, self.block_size)
            for block_hash in request.block_hashes[first:limit]:
                slot = self._index.get(block_hash)
                if slot is None:
                    break
                slots.append(slot)
        if not slots:
            return 0, False
        # NOTE: pinned from the lookup on: the allocation that follows may evict device blocks,
        # whose saves must not take these slots before the load reads them.
        self._pinned.update(slots)
        self._matched[request.request_id] = (first, slots)
        return len(slots) * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        first, slots = self._matched.pop(request.request_id, (0, []))
        num_blocks = num_external_tokens // self.block_size
        targets = blocks[0][first:first + num_blocks]
        for block_hash, slot, block in zip(request.block_hashes[first:first + num_blocks], slots, targets,
                                           strict=False):
            self._index.move_to_end(block_hash)
            self._pending.loads.append((slot, block.block_id))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata | None:
        meta, self._pending = self._pending, OffloadingMetadata()
        self._pinned.clear()
        self._matched.clear()
        return meta if meta.saves or meta.loads else None

    # -- worker half ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        import torch

        from pagedlm.core.distributed.kv_transfer.kv_layout import PagedBlockIO

        assert self._kv_cache_config.block_dim is not None
        self._io = PagedBlockIO(kv_caches, self._kv_cache_config.block_dim)
        from pagedlm.core.platforms import HOST, current_platform

        pin = self._io.device.type != HOST.type and current_platform.is_pin_memory_available()
        self._pool = torch.empty((self.num_host_blocks, self._io.bytes_per_block), dtype=torch.uint8,
                                 pin_memory=pin)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        import torch

        meta = self._connector_metadata
        if not isinstance(meta, OffloadingMetadata):
            return
        assert self._pool is not None and self._io is not None
        if meta.saves:
            block_ids, slots = zip(*meta.saves, strict=True)
            self._pool[torch.tensor(slots)] = self._io.gather(block_ids)
        if meta.loads:
            slots, block_ids = zip(*meta.loads, strict=True)
            self._io.scatter(block_ids, self._pool[torch.tensor(slots)])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load is in place before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are saved when the prefix cache evicts them, not when written

    def wait_for_save(self) -> None:
        return
