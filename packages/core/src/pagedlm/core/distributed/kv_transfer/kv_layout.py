"""Whole KV-cache blocks in and out of a worker's paged cache, as flat bytes.

A block's record is the bytes of that block in every layer's cache tensor, layer after layer:
``[bytes_per_block]`` uint8, whatever the attention backend's cache layout and dtype (FP8 too).
Connectors store and ship records; only this module knows where a block sits in a tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pagedlm.core.platforms import HOST


def block_dim_of(attn_backend: type, block_size: int, num_kv_heads: int, head_size: int) -> int:
    """The dimension of the backend's cache tensor that indexes blocks (the one that grows with
    ``num_blocks``)."""
    one = attn_backend.get_kv_cache_shape(1, block_size, num_kv_heads, head_size)
    two = attn_backend.get_kv_cache_shape(2, block_size, num_kv_heads, head_size)
    dims = [d for d, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    if len(dims) != 1:
        raise ValueError(f"attention backend {getattr(attn_backend, 'name', attn_backend)!r}: cannot tell the block "
                         f"dimension of its KV-cache shape {one}")
    return dims[0]


class PagedBlockIO:
    """Gathers and scatters block records of a set of layers' caches.

    ``kv_caches``: layer name -> cache tensor (all on one device), ``block_dim``: the dimension
    that indexes blocks in each of them.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_dim: int) -> None:
        if not kv_caches:
            raise ValueError("no KV-cache tensors to transfer")
        self.layer_names = list(kv_caches)
        self.caches = list(kv_caches.values())
        self.block_dim = block_dim
        self.device = self.caches[0].device
        #: bytes of one block in each layer, in layer order
        self.layer_bytes = [c[(slice(None),) * block_dim + (0,)].numel() * c.element_size() for c in self.caches]
        self.bytes_per_block = sum(self.layer_bytes)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``[len(block_ids), bytes_per_block]`` uint8 on the host: the blocks' records."""
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        parts = []
        for cache in self.caches:
            blocks = cache.index_select(self.block_dim, idx).movedim(self.block_dim, 0).contiguous()
            parts.append(blocks.view(torch.uint8).reshape(len(block_ids), -1))
        return torch.cat(parts, dim=1).to(HOST)

    def scatter(self, block_ids: Sequence[int], records: torch.Tensor) -> None:
        """Write ``records`` ``[len(block_ids), bytes_per_block]`` uint8 into the blocks."""
        n = len(block_ids)
        if records.shape != (n, self.bytes_per_block):
            raise ValueError(f"records of shape {tuple(records.shape)} do not fit {n} blocks of "
                             f"{self.bytes_per_block} bytes")
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        data = records.to(self.device, non_blocking=True)
        offset = 0
        for cache, nbytes in zip(self.caches, self.layer_bytes, strict=True):
            per_block = list(cache.shape)
            del per_block[self.block_dim]
            part = data[:, offset:offset + nbytes].contiguous().view(cache.dtype).reshape(n, *per_block)
            cache.index_copy_(self.block_dim, idx, part.movedim(0, self.block_dim))
            offset += nbytes


class SideStream:
    """Block copies on a thread beside the engine's: on CUDA a stream of their own that first
    waits for what the engine's stream had queued at :meth:`mark`; on the CPU plain calls (the
    engine's ops are done by the time it returns to the host)."""

    def __init__(self, device: torch.device) -> None:
        from pagedlm.core.platforms import current_platform

        self.device = device
        self.platform = current_platform
        self.stream = None if device.type == HOST.type else current_platform.new_stream(device)

    def mark(self) -> Any:
        """A point in the engine stream's work (call on the engine's thread)."""
        if self.stream is None:
            return None
        return self.platform.record_event()

    @contextlib.contextmanager
    def after(self, mark: Any) -> Iterator[None]:
        """Run the block's copies after ``mark``; they are complete when it exits."""
        if self.stream is None:
            yield
            return
        with self.platform.use_stream(self.stream, self.device):
            self.stream.wait_event(mark)
            yield
            self.stream.synchronize()
