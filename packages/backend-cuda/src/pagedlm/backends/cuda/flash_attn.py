"""``flash_attn``: FlashAttention-2's varlen kernel with a block table (DESIGN.md §6).

Chosen by the CUDA platform when the ``flash_attn`` package imports and ``block_size`` is a
multiple of 256 (its paged kernels require that). Same cache layout as ``triton``:
``kv_cache[0]``/``kv_cache[1]`` are ``[num_blocks, block_size, num_kv_heads, head_size]``, which is
FlashAttention's paged layout, so the cache is passed as is. K/V are written with the Triton
KV-write kernel. ``causal=True`` in FlashAttention >= 2.1 aligns the causal mask to the bottom
right, which is exactly "query i of q_len sits at seq_len - q_len + i": prefix-cached prompts,
chunked prefill and decodes need nothing else.

NOTE: flash_attn is not installed on the machines this project was measured on, so this backend
is exercised only by the GPU tests where flash_attn exists (they skip otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.backends.cuda.kernels.paged_attention import write_kv_cache
from pagedlm.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

__all__ = ["FlashAttentionBackend", "FlashAttentionImpl", "FlashAttentionMetadata", "FlashAttentionMetadataBuilder"]


@dataclass
class FlashAttentionMetadata:
    """``B`` requests, ``T`` tokens."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: cumulative context lengths
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        seq_lens = common.seq_lens
        cu_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_k[1:])
        return FlashAttentionMetadata(
            num_reqs=common.num_reqs, num_tokens=common.num_actual_tokens, max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len, cu_seqlens_q=common.query_start_loc, cu_seqlens_k=cu_k,
            block_table=common.block_table, slot_mapping=common.slot_mapping,
        )


class FlashAttentionImpl(AttentionImpl[FlashAttentionMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttentionMetadata | None,
    ) -> torch.Tensor:
        """``query [T', H, D]``, ``key/value [T', Hkv, D]`` -> ``[T', H, D]`` (rows past T: zeros)."""
        from flash_attn import flash_attn_varlen_func

        if metadata is None:
            return torch.zeros_like(query)
        n = metadata.num_tokens
        out = torch.zeros_like(query)
        if n == 0:
            return out
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        write_kv_cache(key[:n], value[:n], key_cache, value_cache, metadata.slot_mapping[:n])
        # HF's window w keeps positions p - w < s <= p: w - 1 to the left of the query itself
        window = (self.sliding_window - 1, 0) if self.sliding_window is not None else (-1, -1)
        out[:n] = flash_attn_varlen_func(
            query[:n], key_cache, value_cache,
            cu_seqlens_q=metadata.cu_seqlens_q, cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len, max_seqlen_k=metadata.max_seq_len,
            softmax_scale=self.scale, causal=True, window_size=window,
            softcap=self.logits_soft_cap or 0.0, block_table=metadata.block_table,
        )
        return out


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_sizes = (32, 64, 96, 128, 160, 192, 224, 256)
    supported_devices = ("cuda",)
    block_size_multiple = 256  # flash-attn 2's paged kernels
    # NOTE: never run on this project's GPUs (no flash-attn there): no graph capture until it is
    supports_graphs = False

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl
