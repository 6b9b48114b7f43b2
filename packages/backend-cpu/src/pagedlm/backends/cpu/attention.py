"""``cpu_paged``: plain-torch paged attention, the reference backend (DESIGN.md §6).

The KV cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0
keys, 1 values). Token ``j`` of a request lives in flat slot
``block_table[req, j // block_size] * block_size + j % block_size``.

One step is computed with a few batched tensor operations, no Python loop over requests or
tokens: this step's K/V are scattered into the cache through ``slot_mapping``; then each
request's whole context (cached prefix + the tokens just written) is gathered through its block
table into a padded ``[R, S, num_kv_heads, head_size]`` tensor, its queries into a padded
``[R, Q, num_heads, head_size]`` tensor, and attention runs under a ``[R, Q, S]`` mask built
from absolute positions (causal, optionally a sliding window).

Requests are split into at most two such groups: single-token decodes and multi-token
prefill chunks. Padding every decode to the longest prefill chunk's query length would multiply
decode work by that length, so decodes get their own ``Q = 1`` group; within a group, padding
costs at most the spread of lengths. Every index tensor is built on the metadata's device, so the
backend also runs (slowly) on a GPU.

On the CPU, a float32 decode group (no soft cap) skips the gather: ``kernels/attention_decode.c``
reads each request's keys and values in place through its block table (and, in a step of
decodes only, writes this step's K/V in the same call). At Gemma 3 270M's batch 32 the torch
path took ~1.2 ms a layer, mostly the padded copies, for ~0.1 ms of arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedlm.backends.cpu.kernels.attention_ops import decode_attention
from pagedlm.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

__all__ = [
    "CpuAttentionGroup",
    "CpuAttentionMetadata",
    "CpuAttentionMetadataBuilder",
    "CpuPagedAttentionBackend",
    "CpuPagedAttentionImpl",
]

#: upper bound on the float32 score tensor of the explicit (soft-capped) path, per chunk
_MAX_SCORE_ELEMENTS = 1 << 26
#: SDPA's ``enable_gqa`` exists from torch 2.5; core allows 2.4, where K/V are repeated instead
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class CpuAttentionGroup:
    """Requests of one step attended together with one padded shape.

    Shapes: ``R`` requests in the group, ``Q`` = their longest query length, ``S`` = their
    longest context length (``seq_lens``). All tensors are int64/bool on the step's device.
    """

    #: ``[R, Q]`` row of the flat query/output for each padded query slot; padding repeats the
    #: request's first row so gathers stay in bounds
    query_index: torch.Tensor
    #: ``[R, Q]`` bool, True for real query slots; ``None`` when nothing is padded (decodes)
    query_valid: torch.Tensor | None
    #: ``[N]`` output rows written by this group: ``query_index[query_valid]`` (row-major)
    out_index: torch.Tensor
    #: ``[R, Q]`` absolute position of each query token in its request; 0 for padding, so a
    #: padded row still sees one key (position 0) and its softmax stays finite
    query_pos: torch.Tensor
    #: ``[R, max_blocks]`` int32, contiguous: the block table rows of the group's requests
    block_table: torch.Tensor
    #: ``[R]`` int64: each request's context length (``seq_lens``)
    seq_lens: torch.Tensor
    block_size: int
    #: ``S``, the longest context of the group
    max_seq_len: int
    #: ``sliding_window`` -> ``[R, Q, S]`` bool mask (True = attend); filled lazily by the first
    #: layer needing it and reused by every later layer of the step
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    #: ``([R, Q], [R, S])`` int64 span ids of query slots and key positions (-1: none): a query
    #: also sees every key of its own span (``CommonAttentionMetadata.bidirectional_spans``)
    span_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    _context_slots: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return self.query_index.shape[0]

    @property
    def max_query_len(self) -> int:
        return self.query_index.shape[1]

    @property
    def context_slots(self) -> torch.Tensor:
        """``[R, S]`` int64 flat cache slot of each context position (the torch path's gather
        index, built by the first layer that needs it). Positions past a request's ``seq_len``
        point at its position-0 slot: always written, hence finite, and masked out anyway
        (uninitialised cache memory could hold NaN, which a 0 weight would not cancel)."""
        if self._context_slots is None:
            pos = torch.arange(self.max_seq_len, device=self.block_table.device)[None, :]  # [1, S]
            pos = torch.where(pos < self.seq_lens[:, None], pos, 0)  # [R, S]
            block_ids = self.block_table.to(torch.int64).gather(1, pos // self.block_size)
            self._context_slots = block_ids * self.block_size + pos % self.block_size
        return self._context_slots

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[R, Q, S]`` bool: key position ``s`` visible to query slot ``(r, q)``.

        Causal by absolute position, which also excludes positions past ``seq_len`` because a
        real query's position is at most ``seq_len - 1``. With a sliding window ``w``, a token
        at position ``p`` sees only ``p - w < s <= p`` (the last ``w`` positions including
        itself, the HF/Mistral definition).
        """
        cached = self.masks.get(sliding_window)
        if cached is not None:
            return cached
        key_pos = torch.arange(self.max_seq_len, device=self.query_pos.device)[None, None, :]
        query_pos = self.query_pos[:, :, None]
        mask = key_pos <= query_pos
        if self.span_ids is not None:
            span_q, span_k = self.span_ids
            mask |= (span_q[:, :, None] == span_k[:, None, :]) & (span_q[:, :, None] >= 0)
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        self.masks[sliding_window] = mask
        return mask


@dataclass
class CpuAttentionMetadata:
    """One step's batch for ``cpu_paged``. ``B = num_reqs``, ``T = num_actual_tokens``."""

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    block_table: torch.Tensor  # [B, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token (< 0: skip)
    #: requests with exactly one query token this step
    num_decodes: int
    #: at most two groups (decodes, then multi-token prefill chunks) covering rows ``[0, T)``
    groups: list[CpuAttentionGroup]


class CpuAttentionMetadataBuilder(AttentionMetadataBuilder[CpuAttentionMetadata]):
    """Precomputes, once per step, the gather indices every layer reuses."""

    def build(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        if common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs and not common.bidirectional_spans:
            groups, num_decodes = [self._decode_group(common)], common.num_reqs
        else:
            query_start_cpu = common.query_start_loc_cpu.to(torch.int64)
            query_lens_cpu = query_start_cpu[1:] - query_start_cpu[:-1]
            seq_lens_cpu = common.seq_lens_cpu.to(torch.int64)
            # Group membership and padded sizes come from the host copies, so building never waits
            # on the device; only index arithmetic runs on it.
            decode_reqs = torch.nonzero(query_lens_cpu == 1).flatten()
            prefill_reqs = torch.nonzero(query_lens_cpu > 1).flatten()
            groups = [
                self._build_group(common, reqs, query_lens_cpu, seq_lens_cpu)
                for reqs in (decode_reqs, prefill_reqs)
                if reqs.numel() > 0
            ]
            num_decodes = int(decode_reqs.numel())
        return CpuAttentionMetadata(
            num_reqs=common.num_reqs,
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            num_decodes=num_decodes,
            groups=groups,
        )

    def _decode_group(self, common: CommonAttentionMetadata) -> CpuAttentionGroup:
        """The group of a step of decodes only (request r's one token is row r): what
        :meth:`_build_group` gives for every request, in a few ops (a decode step of a small
        model runs this once per KV-cache group)."""
        device = common.block_table.device
        rows = torch.arange(common.num_reqs, device=device)
        seq_len = common.seq_lens.to(device=device, dtype=torch.int64)
        return CpuAttentionGroup(
            query_index=rows[:, None],
            query_valid=None,
            out_index=rows,
            query_pos=(seq_len - 1)[:, None],
            block_table=common.block_table[: common.num_reqs].to(torch.int32).contiguous(),
            seq_lens=seq_len,
            block_size=self.block_size,
            max_seq_len=common.max_seq_len,
        )

    def _build_group(
        self,
        common: CommonAttentionMetadata,
        reqs_cpu: torch.Tensor,
        query_lens_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
    ) -> CpuAttentionGroup:
        """Index tensors for the requests ``reqs_cpu`` (``[R]`` int64, ascending)."""
        device = common.block_table.device
        max_q = int(query_lens_cpu[reqs_cpu].max())
        max_s = int(seq_lens_cpu[reqs_cpu].max())
        reqs = reqs_cpu.to(device)
        starts = common.query_start_loc.to(device=device, dtype=torch.int64)
        q_start = starts[reqs]  # [R]
        q_len = starts[reqs + 1] - q_start  # [R]
        seq_len = common.seq_lens.to(device=device, dtype=torch.int64)[reqs]  # [R]

        offs = torch.arange(max_q, device=device)[None, :]  # [1, Q]
        valid = offs < q_len[:, None]  # [R, Q]
        query_index = q_start[:, None] + torch.where(valid, offs, 0)
        # the new tokens are the last q_len positions of the context
        query_pos = torch.where(valid, (seq_len - q_len)[:, None] + offs, 0)
        if max_q == 1:
            query_valid, out_index = None, query_index[:, 0]
        else:
            query_valid, out_index = valid, query_index[valid]

        return CpuAttentionGroup(
            query_index=query_index,
            query_valid=query_valid,
            out_index=out_index,
            query_pos=query_pos,
            block_table=common.block_table[reqs].to(torch.int32).contiguous(),
            seq_lens=seq_len,
            block_size=self.block_size,
            max_seq_len=max_s,
            span_ids=_span_ids(common.bidirectional_spans, reqs_cpu, query_pos, max_s),
        )


def _span_ids(spans: list[list[tuple[int, int]]] | None, reqs_cpu: torch.Tensor, query_pos: torch.Tensor,
              max_s: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Span ids ``([R, Q], [R, S])`` of the group's requests' bidirectional spans, or None."""
    if spans is None or not any(spans[int(r)] for r in reqs_cpu):
        return None
    span_k = torch.full((len(reqs_cpu), max_s), -1, dtype=torch.int64)
    for i, r in enumerate(reqs_cpu.tolist()):
        for j, (start, end) in enumerate(spans[r]):
            span_k[i, start:min(end, max_s)] = j
    span_k = span_k.to(query_pos.device)
    # a query's span is the span of the key at its own position (padding: position 0, harmless)
    span_q = span_k.gather(1, query_pos.clamp(max=max_s - 1))
    return span_q, span_k


class CpuPagedAttentionImpl(AttentionImpl[CpuAttentionMetadata]):
    """Writes K/V through ``slot_mapping``, then attends through the block table.

    Without a soft cap, attention is ``torch.nn.functional.scaled_dot_product_attention``
    (torch's fused CPU kernel accumulates and takes the softmax in float32 for bf16/fp16, and
    never materialises the full score matrix). With ``logits_soft_cap`` the scores must be
    transformed before the softmax, which SDPA cannot do, so an explicit float32
    matmul/softmax path runs instead, chunked over queries to bound its memory.
    """

    #: use SDPA when no soft cap is set (tests switch it off to exercise the explicit path)
    use_sdpa: bool = True

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
        super().__init__(
            num_heads=num_heads,
            head_size=head_size,
            scale=scale,
            num_kv_heads=num_kv_heads,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1 (or None for full attention)")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap} must be > 0 (or None for no capping)")
        # query head h reads kv head h // num_queries_per_kv (HF's repeat_kv order)
        self.num_queries_per_kv = num_heads // num_kv_heads

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache``, then attend.

        Args:
            query: ``[T', num_heads, head_size]`` with ``T' >= T = metadata.num_actual_tokens``
                (rows past ``T`` are padding: ignored, returned as zeros)
            key, value: ``[T', num_kv_heads, head_size]``
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, contiguous; in the model
                dtype, or float8_e4m3fn (``kv_cache_dtype="fp8"``: values divided by ``k_scale`` /
                ``v_scale`` when written, multiplied back when read)
            metadata: this step's :class:`CpuAttentionMetadata`
        Returns:
            ``[T', num_heads, head_size]`` in ``query``'s dtype
        """
        num_tokens = metadata.num_actual_tokens
        out = query.new_empty(query.shape)
        if num_tokens < query.shape[0]:
            out[num_tokens:].zero_()
        if num_tokens == 0:
            return out
        # view (not reshape): a copy would silently drop the writes below
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)  # [num_slots, Hkv, D]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        in_c = [self._decode_in_c(query, key_cache, group) for group in metadata.groups]
        # a step of decodes only: the C kernel writes their K/V too (one call per layer)
        write_in_c = in_c == [True] and self._heads_contiguous(key) and self._heads_contiguous(value)
        slot_mapping = metadata.slot_mapping[:num_tokens].to(torch.int64)
        if not write_in_c:
            self._write_kv(key[:num_tokens], value[:num_tokens], key_cache, value_cache, slot_mapping)

        for group, c_kernel in zip(metadata.groups, in_c):
            num_reqs, max_q, max_s = group.num_reqs, group.max_query_len, group.max_seq_len
            if c_kernel:
                decode_attention(query, group.out_index, key_cache, value_cache, group.block_table, group.block_size,
                                 group.query_pos[:, 0], self.sliding_window, self.scale, out, group.out_index,
                                 (key, value, slot_mapping) if write_in_c else None)
                continue
            q = query.index_select(0, group.query_index.flatten()).view(num_reqs, max_q, self.num_heads, self.head_size)
            slots = group.context_slots.flatten()
            k = key_cache.index_select(0, slots).view(num_reqs, max_s, self.num_kv_heads, self.head_size)
            v = value_cache.index_select(0, slots).view(num_reqs, max_s, self.num_kv_heads, self.head_size)
            if k.dtype != q.dtype:  # a cache kept in another dtype than the activations
                k, v = k.to(q.dtype), v.to(q.dtype)
                if self.k_scale is not None:  # FP8: stored values are value / scale
                    k, v = k * self.k_scale.to(q.dtype), v * self.v_scale.to(q.dtype)
            o = self._attend(q, k, v, group.mask(self.sliding_window))  # [R, Q, H, D]
            if group.query_valid is None:
                out.index_copy_(0, group.out_index, o.reshape(-1, self.num_heads, self.head_size))
            else:
                out.index_copy_(0, group.out_index, o[group.query_valid])
        return out

    def _heads_contiguous(self, x: torch.Tensor) -> bool:
        return x.stride(-1) == 1 and x.stride(-2) == self.head_size

    def _decode_in_c(self, query: torch.Tensor, key_cache: torch.Tensor, group: CpuAttentionGroup) -> bool:
        """Whether ``group`` (one query token per request) runs in ``kernels/attention_decode.c``:
        float32 on the CPU, no soft cap, no bidirectional spans; SDPA's slot otherwise (the C
        kernel stands in for SDPA: tests that switch SDPA off get the explicit path)."""
        return (group.query_valid is None and self.use_sdpa and self.logits_soft_cap is None
                and group.span_ids is None and query.device.type == "cpu" and query.dtype == torch.float32
                and key_cache.dtype == torch.float32 and self._heads_contiguous(query))

    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the flat caches at ``slot_mapping`` ``[T]`` int64."""
        slots = slot_mapping
        # Negative slots mark tokens with nothing to store (padding); skip them like vLLM does.
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        if key_cache.dtype == torch.float8_e4m3fn:
            # FP8 cache: value / scale, clamped to the format's range; index_copy_ has no float8
            # kernel on the CPU, so the bytes are copied through uint8 views
            assert self.k_scale is not None and self.v_scale is not None
            fmax = torch.finfo(torch.float8_e4m3fn).max
            for cache, x, scale in ((key_cache, key, self.k_scale), (value_cache, value, self.v_scale)):
                q = (x.float() / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
                cache.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
            return
        key_cache.index_copy_(0, slots, key.to(key_cache.dtype))
        value_cache.index_copy_(0, slots, value.to(value_cache.dtype))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention for one group.

        Args:
            q: ``[R, Q, H, D]``; k, v: ``[R, S, Hkv, D]``; mask: ``[R, Q, S]`` bool (True = attend)
        Returns:
            ``[R, Q, H, D]`` in ``q``'s dtype
        """
        if self.logits_soft_cap is None and self.use_sdpa:
            grouped = self.num_queries_per_kv > 1
            if grouped and not _SDPA_HAS_GQA:
                k = k.repeat_interleave(self.num_queries_per_kv, dim=2)
                v = v.repeat_interleave(self.num_queries_per_kv, dim=2)
            gqa = {"enable_gqa": True} if grouped and _SDPA_HAS_GQA else {}
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),  # [R, H, Q, D]
                k.transpose(1, 2),  # [R, Hkv, S, D] (or [R, H, S, D] when repeated)
                v.transpose(1, 2),
                attn_mask=mask[:, None],  # [R, 1, Q, S]
                scale=self.scale,
                **gqa,
            )
            return o.transpose(1, 2)
        return self._attend_explicit(q, k, v, mask)

    def _attend_explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Float32 matmul/softmax attention with optional tanh soft capping (same contract as
        :meth:`_attend`). GQA uses a grouped reshape, so K/V are never repeated per head."""
        num_reqs, max_q, num_heads, head_size = q.shape
        max_s, num_kv, group = k.shape[1], self.num_kv_heads, self.num_queries_per_kv
        kf = k.float().permute(0, 2, 3, 1)  # [R, Hkv, D, S]
        vf = v.float().transpose(1, 2)  # [R, Hkv, S, D]
        out = torch.empty_like(q)
        # chunk the queries so the float32 scores stay below _MAX_SCORE_ELEMENTS; one chunk
        # except for long prefills
        chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, num_reqs * num_heads * max_s))
        for start in range(0, max_q, chunk):
            stop = min(start + chunk, max_q)
            n = stop - start
            # [R, n, Hkv, G, D] -> [R, Hkv, G * n, D]: queries sharing a kv head stacked together
            qf = q[:, start:stop].float().view(num_reqs, n, num_kv, group, head_size)
            qf = qf.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv, group * n, head_size)
            scores = torch.matmul(qf, kf).mul_(self.scale)  # [R, Hkv, G * n, S]
            if self.logits_soft_cap is not None:
                # Gemma-2 style: cap * tanh(scores / cap), applied after scaling
                scores = torch.tanh(scores.div_(self.logits_soft_cap)).mul_(self.logits_soft_cap)
            scores = scores.view(num_reqs, num_kv, group, n, max_s)
            scores.masked_fill_(~mask[:, None, None, start:stop], float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(num_reqs, num_kv, group * n, max_s)
            o = torch.matmul(probs, vf).view(num_reqs, num_kv, group, n, head_size)
            out[:, start:stop] = o.permute(0, 3, 1, 2, 4).reshape(num_reqs, n, num_heads, head_size).to(q.dtype)
        return out


class CpuPagedAttentionBackend(AttentionBackend):
    """Plain-torch paged attention; any head size; float32, bfloat16, float16."""

    name = "cpu_paged"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_head_sizes = None
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3")
    # NOTE: the tensors would work anywhere, but only the CPU platform's runner builds its metadata
    supported_devices = ("cpu",)
    supports_bidirectional_spans = True

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``: keys at 0, values at 1."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_builder_cls() -> type[CpuAttentionMetadataBuilder]:
        return CpuAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[CpuPagedAttentionImpl]:
        return CpuPagedAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[CpuAttentionMetadata]:
        return CpuAttentionMetadata
