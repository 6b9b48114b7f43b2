"""``triton``: paged attention through Triton kernels (DESIGN.md §6), the CUDA default.

Same KV-cache layout as ``cpu_paged`` (``[2, num_blocks, block_size, num_kv_heads, head_size]``),
so the reference backend can check these kernels on identical caches. One step is two launches
per layer (three with split-KV, unless ``PAGEDLM_CUDA_SPLIT_KV_MERGE=kernel`` merges the split
partials in the attention launch): the KV write through ``slot_mapping``, then one attention
kernel over the whole flat batch (prefill chunks, prefix-cached prompts and decodes together);
see :mod:`pagedlm.backends.cuda.kernels.paged_attention`. Given the layer's rotary unapplied
(``fuses_rotary``), the KV write is the rotary kernel's: it rotates the query and key and
stores the rotated key and the value, so the model's rotary launch and the key it wrote are gone.

Also usable on the CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter), which is how the
kernels are tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from pagedlm.backends.cuda.kernels.kv_cache_fp8 import write_kv_fp8
from pagedlm.backends.cuda.kernels.layer_ops import rotary_embedding_write_kv
from pagedlm.backends.cuda.kernels.paged_attention import (
    INTERPRET,
    choose_num_splits,
    paged_attention,
    split_merge_in_kernel,
    write_kv_cache,
)
from pagedlm.backends.cuda.kernels.wna16_gemv import split_k_counters
from pagedlm.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedlm.core.layers.rotary import PendingRotary

__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
]


@dataclass
class TritonAttentionMetadata:
    """One step's batch. ``B`` = ``num_reqs`` (padded in graph replays), ``T`` = ``num_tokens``.

    Padding (CUDA-graph replays): padded requests have one query token, a slot of ``-1`` (nothing
    written) and ``seq_len`` 1; their rows are computed and ignored.
    """

    num_reqs: int
    #: rows the kernels process (``>=`` the real tokens when padded)
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    #: key-range splits of the split-KV path (1 = off); decided on the host
    num_splits: int = 1
    #: ``[B]`` int32, decode-only steps: requests longest context first (see the kernel's load balance)
    req_order: torch.Tensor | None = None
    #: ``[T]`` int32, steps with bidirectional spans (Gemma 3's images): per token, the end of
    #: the span it is in (0 outside one); None otherwise. Such steps run eagerly, never in graphs.
    span_end: torch.Tensor | None = None


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder[TritonAttentionMetadata]):
    """Passes the common tensors through and picks the split-KV factor from host-side sizes."""

    def __init__(self, *, block_size: int, device: torch.device) -> None:
        super().__init__(block_size=block_size, device=device)
        if device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            # interpreter runs: a small "GPU" so the split-KV path is exercised too
            self.num_sms = 4
        #: number of kv heads of the model (splits depend on it); 8 until bind_model
        self.num_kv_heads = 8
        if split_merge_in_kernel():
            # NOTE: made here, outside any CUDA-graph capture: split-KV launches merge their
            # partials in the kernel only where the counters exist when they are captured
            split_k_counters(device, 0)

    def bind_model(self, *, num_kv_heads: int, head_size: int) -> None:
        self.num_kv_heads = num_kv_heads

    def precompile_metadata(self, batch_sizes, prefill_tokens, stage):
        """Decode variants differ only in whether the key range is split (the count is a runtime
        argument of the kernels), which :meth:`build` decides from the batch size and the longest
        context: the unsplit variant, and the split one if some batch size can be built with it;
        then one prefill."""
        sizes = sorted(set(batch_sizes))
        yield sizes[0], dataclasses.replace(self.build(stage(sizes[0], sizes[0])), num_splits=1)
        for size in sizes:
            metadata = self.build(stage(size, size))
            if metadata.num_splits > 1:
                yield size, metadata
                break
        yield prefill_tokens, self.build(stage(prefill_tokens, 1))

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        num_splits = 1
        if common.max_query_len == 1:
            num_splits = choose_num_splits(common.num_reqs, self.num_kv_heads, common.max_seq_len, self.num_sms)
        return TritonAttentionMetadata(
            num_reqs=common.num_reqs,
            num_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            num_splits=num_splits,
            req_order=common.decode_order if common.max_query_len == 1 else None,
            span_end=_span_end(common),
        )


def _span_end(common: CommonAttentionMetadata) -> torch.Tensor | None:
    """The step's ``span_end`` per token from ``common.bidirectional_spans``, or None. A span is
    clipped to the request's ``seq_len``: keys past it are not in the cache."""
    spans = common.bidirectional_spans
    if not spans or not any(spans):
        return None
    qsl = common.query_start_loc_cpu.tolist()
    seq_lens = common.seq_lens_cpu.tolist()
    span_end = torch.zeros(common.num_actual_tokens, dtype=torch.int32)
    for req, req_spans in enumerate(spans):
        context = seq_lens[req] - (qsl[req + 1] - qsl[req])
        for start, end in req_spans:
            lo, hi = max(start, context), min(end, seq_lens[req])
            if lo < hi:
                span_end[qsl[req] + lo - context : qsl[req] + hi - context] = hi
    return span_end.to(common.query_start_loc.device, non_blocking=True)


@functools.cache
def rotary_fused_with_kv_write() -> bool:
    """``PAGEDLM_CUDA_FUSED_ROTARY``: ``1`` (default) lets the impl take the model's rotary and
    apply it in the K/V write's kernel; ``0`` keeps the separate rotary launch (for A/B runs)."""
    value = os.environ.get("PAGEDLM_CUDA_FUSED_ROTARY", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PAGEDLM_CUDA_FUSED_ROTARY={value!r}: allowed values are 1 (the rotary in the K/V "
                         "write's kernel) and 0 (a separate rotary launch)")
    return value == "1"


class TritonAttentionImpl(AttentionImpl[TritonAttentionMetadata]):
    """KV write + unified paged attention; GQA, causal, sliding window, logits soft cap."""

    #: launch-parameter overrides (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``), for tuning
    kernel_config: dict[str, int] | None = None
    @property
    def fuses_rotary(self) -> bool:  # type: ignore[override]
        """The rotary embedding runs in the K/V write's kernel (``forward(rotary=)``) unless
        ``PAGEDLM_CUDA_FUSED_ROTARY=0``."""
        return rotary_fused_with_kv_write()

    def __init__(
        self,
        *,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__(num_heads=num_heads, head_size=head_size, scale=scale, num_kv_heads=num_kv_heads,
                         sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1 (or None for full attention)")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap} must be > 0 (or None for no capping)")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata | None,
        rotary: PendingRotary | None = None,
    ) -> torch.Tensor:
        """Write K/V, then attend.

        Args:
            query: ``[T', num_heads, head_size]``, ``T' >= metadata.num_tokens`` (extra rows: zeros out)
            key, value: ``[T', num_kv_heads, head_size]``
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` contiguous
            metadata: this step's metadata; ``None`` in a profiling run (no cache yet: zeros out)
            rotary: if given, ``query`` and ``key`` are not rotated yet: one kernel rotates both
                and writes the rotated key and the value into the cache
                (``layer_ops.rotary_embedding_write_kv``)
        Returns:
            ``[T', num_heads, head_size]`` in ``query``'s dtype
        """
        if metadata is None:
            return torch.zeros_like(query)
        num_tokens = metadata.num_tokens
        out = torch.empty_like(query)
        if num_tokens < query.shape[0]:
            out[num_tokens:].zero_()
        if num_tokens == 0:
            return out
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        fp8 = self.kv_cache_dtype != "auto"
        slots = metadata.slot_mapping[:num_tokens]
        if rotary is not None:
            r = rotary.rotary
            query = rotary_embedding_write_kv(
                rotary.positions, query.flatten(1), key.flatten(1), value.flatten(1), r.cos_sin_cache, r.head_size,
                r.rotary_dim, r.is_neox_style, key_cache, value_cache, slots, qk_norm_weights=rotary.qk_norm_weights,
                eps=rotary.eps, kv_scales=(self.k_scale, self.v_scale) if fp8 else None,
            ).view(query.shape)
        else:
            write = write_kv_fp8 if fp8 else write_kv_cache
            write(key[:num_tokens], value[:num_tokens], key_cache, value_cache, slots,
                  *((self.k_scale, self.v_scale) if fp8 else ()))
        paged_attention(
            out, query, key_cache, value_cache,
            block_table=metadata.block_table, seq_lens=metadata.seq_lens,
            query_start_loc=metadata.query_start_loc, num_reqs=metadata.num_reqs, num_tokens=num_tokens,
            max_query_len=metadata.max_query_len, scale=self.scale, sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap, num_splits=metadata.num_splits, req_order=metadata.req_order,
            config=self.kernel_config,
            k_scale=self.k_scale if fp8 else None, v_scale=self.v_scale if fp8 else None,
            span_end=metadata.span_end,
        )
        return out


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention; head sizes up to 256; float32, bfloat16, float16."""

    name = "triton"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_head_sizes = tuple(range(8, 257, 8))
    #: the CPU too under Triton's interpreter (kernel tests without a GPU)
    supported_devices = ("cuda", "cpu") if INTERPRET else ("cuda",)
    supports_graphs = True
    #: a mixed launch's grid depends only on the padded token and request counts, and a padded
    #: request (no query tokens) or token (slot -1, in no request) does nothing
    supports_mixed_graphs = True
    #: tokens of an image see each other both ways (``span_end``; Gemma 3)
    supports_bidirectional_spans = True
    #: float8_e4m3fn with per-layer scales: written by kernels/kv_cache_fp8.py, read rescaled
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3")

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``: keys at 0, values at 1."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_builder_cls() -> type[TritonAttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[TritonAttentionMetadata]:
        return TritonAttentionMetadata
