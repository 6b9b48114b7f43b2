"""``SharedStorageConnector``: prompt KV blocks as files in a directory that instances share.

A producer writes each finished request's full prompt blocks to
``<shared_storage_path>/<layout fingerprint>/<block hash>.safetensors`` (one uint8 record per
file, with its SHA-256 in the header); a consumer, in any process that sees the directory, loads
the blocks it finds after its local prefix-cache hit instead of computing them. A file that is
missing, unreadable, of the wrong size or whose checksum does not match is not loaded: the
request recomputes from that block on (logged, counted in the scheduler's external-cache stats).

``kv_connector_extra_config``: ``shared_storage_path`` (default ``./local_storage``, vLLM's).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import TYPE_CHECKING, Any

from pagedlm.core.distributed.kv_transfer.base import KVCacheInfo, KVConnectorRole
from pagedlm.core.distributed.kv_transfer.block_transfer import BlockExport, BlockLoad, BlockTransferConnector
from pagedlm.core.logger import init_logger

if TYPE_CHECKING:
    import torch

    from pagedlm.core.config import VllmConfig
    from pagedlm.core.request import Request

logger = init_logger(__name__)

_FORMAT = "pagedlm-kv-block-1"


class SharedStorageConnector(BlockTransferConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheInfo) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        path = self._kv_transfer_config.get_from_extra_config("shared_storage_path", "local_storage")
        if not isinstance(path, str) or not path:
            raise ValueError(f"kv_connector_extra_config.shared_storage_path={path!r} must be a directory path")
        self.directory = os.path.join(os.path.abspath(path), self.fingerprint)
        os.makedirs(self.directory, exist_ok=True)

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + ".safetensors")

    # -- scheduler half ------------------------------------------------------------------------
    def _count_available(self, request: Request, first: int, limit: int) -> int:
        count = 0
        for i in range(first, limit):
            if not os.path.exists(self._path(request.block_hashes[i])):
                break
            count += 1
        return count

    def _export_indices(self, request: Request, num_full_blocks: int) -> list[int]:
        return [i for i in range(num_full_blocks) if not os.path.exists(self._path(request.block_hashes[i]))]

    # -- worker half ---------------------------------------------------------------------------
    def _store(self, export: BlockExport, records: torch.Tensor) -> None:
        from safetensors.torch import save

        for block_hash, record in zip(export.block_hashes, records, strict=True):
            record = record.contiguous()
            digest = hashlib.sha256(record.numpy().tobytes()).hexdigest()
            data = save({"kv": record}, metadata={"format": _FORMAT, "sha256": digest})
            # NOTE: written under a temporary name and renamed: a reader sees a whole file or none
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self._path(block_hash))
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise

    def _load(self, load: BlockLoad) -> None:
        import torch

        records = []
        for block_hash in load.block_hashes:
            record = self._read(block_hash)
            if record is None:
                break
            records.append(record)
        if len(records) < len(load.block_hashes):
            logger.warning("request %s: %d of %d stored KV blocks are missing or corrupt in %s; they are recomputed",
                           load.req_id, len(load.block_hashes) - len(records), len(load.block_hashes), self.directory)
        self._finish_load(load, torch.stack(records) if records else None, len(records))

    def _read(self, block_hash: bytes) -> Any:
        """The block's record, or None when its file is missing or does not check out."""
        from safetensors import safe_open

        path = self._path(block_hash)
        assert self._io is not None
        try:
            with safe_open(path, framework="pt") as f:
                expected = (f.metadata() or {}).get("sha256")
                record = f.get_tensor("kv")
        except Exception as e:  # noqa: BLE001 - any unreadable file is a miss, never an error
            logger.warning("KV block file %s cannot be read (%s: %s)", path, type(e).__name__, e)
            return None
        if tuple(record.shape) != (self._io.bytes_per_block,) or expected is None or \
                hashlib.sha256(record.numpy().tobytes()).hexdigest() != expected:
            logger.warning("KV block file %s does not match its checksum or this cache's layout", path)
            return None
        return record
