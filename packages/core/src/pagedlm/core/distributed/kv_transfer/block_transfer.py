"""A base for connectors that move whole prompt blocks named by their prefix-cache hashes.

Scheduler half: a consumer offers the blocks after the local hit that its store holds
(``_count_available``), loaded asynchronously; a producer exports a finished request's full
prompt blocks (``_export_indices``), keeping them allocated until its workers copied them out.
Worker half: in ``start_load_kv`` it copies exports out (``_export`` / ``_store``) and loads in (``_load``);
loads report the blocks that did not arrive as invalid, so the scheduler recomputes from there.

NOTE: blocks are identified by the chained hash of their tokens (kv_cache/block_hash.py) plus
:func:`layout_fingerprint` (model shape, dtype, block size): equal keys mean equal K/V.
"""

from __future__ import annotations

import hashlib
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
    from pagedlm.core.distributed.kv_transfer.kv_layout import PagedBlockIO
    from pagedlm.core.request import Request
    from pagedlm.core.sched.output import SchedulerOutput


def layout_fingerprint(vllm_config: VllmConfig) -> str:
    """A short digest of what makes two instances' blocks interchangeable."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    text = mc.text_config if mc.hf_config is not None else None
    parts = [
        ",".join(mc.architectures) if mc.hf_config is not None else "",
        *(str(getattr(text, k, "")) for k in ("num_hidden_layers", "num_key_value_heads", "hidden_size",
                                                "vocab_size")),
        str(mc.head_dim if mc.hf_config is not None else ""), str(mc.dtype), cc.cache_dtype, str(cc.block_size),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@dataclass
class BlockLoad:
    """Blocks ``block_ids`` of request ``req_id`` receive the blocks named ``block_hashes``,
    which start at block ``first_block`` of the request."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    first_block: int
    #: where from, for connectors with several sources (P2P: the producer's address)
    source: dict[str, Any] | None = None


@dataclass
class BlockExport:
    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class BlockTransferMetadata(KVConnectorMetadata):
    loads: list[BlockLoad] = field(default_factory=list)
    exports: list[BlockExport] = field(default_factory=list)


class BlockTransferConnector(KVConnectorBase_V1):
    """Subclasses implement ``_count_available``, ``_export_indices`` and (worker) ``_store`` /
    ``_load``; optionally ``_load_source`` and ``_transfer_params``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheInfo) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = kv_cache_config.block_size
        self.fingerprint = layout_fingerprint(vllm_config)
        # scheduler half
        self._matched_first_block: dict[str, int] = {}
        self._pending = BlockTransferMetadata()
        # worker half
        self._io: PagedBlockIO | None = None
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()

    # -- scheduler half ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._kv_transfer_config.is_kv_consumer:
            return 0, False
        first = num_computed_tokens // self.block_size
        limit = (request.num_tokens - 1) // self.block_size  # the last token is always computed
        if first >= limit:
            return 0, False
        update_block_hashes(request, self.block_size)
        num_blocks = self._count_available(request, first, limit)
        if num_blocks:
            self._matched_first_block[request.request_id] = first
        return num_blocks * self.block_size, True

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        first = self._matched_first_block.pop(request.request_id, None)
        if not num_external_tokens or first is None:
            return
        num_blocks = num_external_tokens // self.block_size
        block_ids = [b.block_id for b in blocks[0][first:first + num_blocks]]
        self._pending.loads.append(BlockLoad(request.request_id, block_ids,
                                             list(request.block_hashes[first:first + num_blocks]), first,
                                             self._load_source(request)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BlockTransferMetadata | None:
        meta, self._pending = self._pending, BlockTransferMetadata()
        return meta if meta.loads or meta.exports else None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched_first_block.pop(request.request_id, None)
        if not self._kv_transfer_config.is_kv_producer:
            return False, None
        num_full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        update_block_hashes(request, self.block_size)
        indices = self._export_indices(request, num_full)
        params = self._transfer_params(request, num_full)
        if not indices:
            return False, params
        self._pending.exports.append(BlockExport(request.request_id, [block_ids[i] for i in indices],
                                                 [request.block_hashes[i] for i in indices]))
        return True, params

    def _count_available(self, request: Request, first: int, limit: int) -> int:
        """How many of the request's blocks ``first, first + 1, ...`` (below ``limit``) can load."""
        raise NotImplementedError

    def _export_indices(self, request: Request, num_full_blocks: int) -> list[int]:
        """Which of the finished request's first ``num_full_blocks`` blocks to export."""
        raise NotImplementedError

    def _load_source(self, request: Request) -> dict[str, Any] | None:
        return None

    def _transfer_params(self, request: Request, num_full_blocks: int) -> dict[str, Any] | None:
        return None

    # -- worker half ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from pagedlm.core.distributed.kv_transfer.kv_layout import PagedBlockIO

        assert self._kv_cache_config.block_dim is not None
        self._io = PagedBlockIO(kv_caches, self._kv_cache_config.block_dim)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._io is not None, "register_kv_caches first"
        meta = self._connector_metadata
        if isinstance(meta, BlockTransferMetadata):
            for export in meta.exports:
                self._export(export)
            for load in meta.loads:
                self._load(load)
        self._poll(idle=bool(kwargs.get("idle")))

    def _finish_load(self, load: BlockLoad, records: torch.Tensor | None, num_valid: int) -> None:
        """Write the first ``num_valid`` records into the load's blocks; the rest are invalid."""
        assert self._io is not None
        if num_valid:
            assert records is not None
            self._io.scatter(load.block_ids[:num_valid], records[:num_valid])
        self._invalid_block_ids.update(load.block_ids[num_valid:])
        self._done_recving.add(load.req_id)

    def _export(self, export: BlockExport) -> None:
        """Copy the export's blocks out (``_store``) and report it sent. NOTE: the blocks stay
        allocated until the request is reported in ``finished_sending``."""
        assert self._io is not None
        self._store(export, self._io.gather(export.block_ids))
        self._done_sending.add(export.req_id)

    def _store(self, export: BlockExport, records: torch.Tensor) -> None:
        raise NotImplementedError

    def _load(self, load: BlockLoad) -> None:
        raise NotImplementedError

    def _poll(self, idle: bool) -> None:
        """Finish loads that completed in the background (connectors that load asynchronously)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # finished requests' blocks are exported whole, in a later step's start_load_kv

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, self._done_sending = self._done_sending, set()
        recving, self._done_recving = self._done_recving, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid
