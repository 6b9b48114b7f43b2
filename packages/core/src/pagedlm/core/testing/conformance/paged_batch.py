"""Random paged-attention batches for the conformance kit.

A batch is a list of requests ``(cached, new)``: ``cached`` context tokens already in the KV
cache (a prefix-cached prompt, or the earlier chunks and tokens of a running request) and
``new`` tokens computed this step (a prefill chunk when > 1, a decode when 1). Block ids are a
random permutation, so a backend that ignores the block table reads the wrong blocks; every
slot no request owns holds NaN, so reading outside a context shows up as a non-finite output.

Padding, as a runner produces it for fixed-size (graph) launches, comes in two kinds:
``pad_reqs`` extra one-token requests with slot ``-1`` (nothing may be written) and
``seq_len`` 1, and ``pad_rows`` extra rows in q/k/v past ``num_actual_tokens``. Neither
kind's output is compared; neither may change the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedlm.core.attention import CommonAttentionMetadata

#: prefill chunks with and without a cached prefix, decodes at several context lengths, a
#: chunk ending exactly on a block boundary
MIXED = ((0, 7), (20, 1), (35, 9), (0, 1), (50, 1), (16, 16), (3, 2))
DECODES = ((5, 1), (0, 1), (40, 1), (17, 1), (100, 1))
#: contexts longer than the windows and splits a kernel may use
LONG = ((0, 9), (300, 1), (270, 7), (3, 1))


@dataclass
class PagedBatch:
    """One step's inputs on the CPU. ``T`` = rows of q/k/v (real tokens, then padding rows)."""

    common: CommonAttentionMetadata
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor  # [T, Hkv, D]
    #: ``[2, num_blocks, block_size, Hkv, D]`` (the reference layout), NaN where nothing is stored
    kv_cache: torch.Tensor
    #: ``[N]`` flat slots of the real new tokens (rows ``0..N-1``), the only slots a step may write
    new_slots: torch.Tensor
    #: real (compared) rows: the new tokens of the real requests
    num_real_tokens: int
    #: the cached prefix of each real request, for backends whose cache layout differs from the
    #: reference's and so must be filled by running the backend itself: ``(cached keys
    #: [c, Hkv, D], cached values, their slots [c])`` per request
    prefixes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def make_batch(
    reqs: tuple[tuple[int, int], ...],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    seed: int,
    pad_reqs: int = 0,
    pad_rows: int = 0,
    query_gain: float = 1.0,
) -> PagedBatch:
    """A random batch of ``reqs`` (see the module docstring); ``query_gain`` scales the queries
    (large scores make a logits soft cap bend them)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in reqs] + [1] * pad_reqs
    blocks_per_req = [math.ceil((c + n) / block_size) for c, n in reqs]
    # one spare block that no request owns (stays NaN), shared by every padding request
    num_blocks = sum(blocks_per_req) + 1
    spare = num_blocks - 1
    perm = torch.randperm(num_blocks - 1, generator=gen)
    max_blocks = max(blocks_per_req) + 1
    block_table = torch.full((len(seq_lens), max_blocks), spare, dtype=torch.int32)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    flat = cache.view(2, -1, num_kv_heads, head_size)
    keys, values, new_slots, prefixes = [], [], [], []
    used = 0
    for i, ((cached, new), n) in enumerate(zip(reqs, blocks_per_req)):
        ids = perm[used : used + n]
        used += n
        block_table[i, :n] = ids.to(torch.int32)
        pos = torch.arange(cached + new)
        slots = ids[pos // block_size] * block_size + pos % block_size
        k = torch.randn(cached + new, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(cached + new, num_kv_heads, head_size, generator=gen).to(dtype)
        flat[0, slots[:cached]] = k[:cached]
        flat[1, slots[:cached]] = v[:cached]
        prefixes.append((k[:cached], v[:cached], slots[:cached]))
        keys.append(k[cached:])
        values.append(v[cached:])
        new_slots.append(slots[cached:])
    real_slots = torch.cat(new_slots).to(torch.int64)
    num_real = int(real_slots.numel())
    query_lens = [n for _, n in reqs] + [1] * pad_reqs
    num_actual = num_real + pad_reqs
    rows = num_actual + pad_rows

    def rand(heads: int, count: int) -> torch.Tensor:
        return torch.randn(count, heads, head_size, generator=gen).to(dtype)

    query = (torch.randn(rows, num_heads, head_size, generator=gen) * query_gain).to(dtype)
    key = torch.cat([*keys, rand(num_kv_heads, rows - num_real)])
    value = torch.cat([*values, rand(num_kv_heads, rows - num_real)])
    # -1: a padding token stores nothing (padding requests, and the rows past num_actual_tokens)
    slot_mapping = torch.cat([real_slots, torch.full((rows - num_real,), -1, dtype=torch.int64)])
    common = _common(query_lens, seq_lens, block_table, slot_mapping, num_actual,
                     num_computed=[c for c, _ in reqs] + [0] * pad_reqs)
    return PagedBatch(common, query, key, value, cache, real_slots, num_real, prefixes)


def prefill_of_prefixes(batch: PagedBatch, num_heads: int, seed: int) -> tuple[CommonAttentionMetadata, tuple]:
    """A step that writes every real request's cached prefix through a backend: one prefill
    chunk ``(0, cached)`` per request with a prefix, on the same block table rows.

    Returns the step's metadata and its ``(query, key, value)``; the query is random (the
    outputs are discarded). For backends whose cache layout the kit cannot fill directly.
    """
    owners = [i for i, (k, _, _) in enumerate(batch.prefixes) if k.shape[0] > 0]
    if not owners:
        raise ValueError("no request of this batch has a cached prefix")
    keys = torch.cat([batch.prefixes[i][0] for i in owners])
    values = torch.cat([batch.prefixes[i][1] for i in owners])
    slots = torch.cat([batch.prefixes[i][2] for i in owners]).to(torch.int64)
    lens = [batch.prefixes[i][0].shape[0] for i in owners]
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(keys.shape[0], num_heads, keys.shape[-1], generator=gen).to(keys.dtype)
    common = _common(lens, lens, batch.common.block_table[owners], slots, int(slots.numel()),
                     num_computed=[0] * len(owners))
    return common, (query, keys, values)


def _common(query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor, slot_mapping: torch.Tensor,
            num_actual: int, num_computed: list[int]) -> CommonAttentionMetadata:
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, seq_lens_cpu=seq.clone(),
        num_computed_tokens_cpu=torch.tensor(num_computed, dtype=torch.int32), block_table=block_table,
        slot_mapping=slot_mapping, num_reqs=len(query_lens), num_actual_tokens=num_actual,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        # the order a runner passes (longest context first), for backends balancing decodes
        decode_order=torch.argsort(seq, descending=True, stable=True).to(torch.int32),
    )


def to_device(common: CommonAttentionMetadata, device: torch.device) -> CommonAttentionMetadata:
    """The same metadata with its device tensors on ``device`` (host copies stay on the host)."""
    return CommonAttentionMetadata(
        query_start_loc=common.query_start_loc.to(device), query_start_loc_cpu=common.query_start_loc_cpu,
        seq_lens=common.seq_lens.to(device), seq_lens_cpu=common.seq_lens_cpu,
        num_computed_tokens_cpu=common.num_computed_tokens_cpu, block_table=common.block_table.to(device),
        slot_mapping=common.slot_mapping.to(device), num_reqs=common.num_reqs,
        num_actual_tokens=common.num_actual_tokens, max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len,
        decode_order=None if common.decode_order is None else common.decode_order.to(device),
    )
