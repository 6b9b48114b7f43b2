"""Triton kernels: KV-cache write and one paged-attention kernel for a flat mixed batch.

Cache layout (shared with ``cpu_paged``): ``kv_cache[0]`` keys and ``kv_cache[1]`` values, each
``[num_blocks, block_size, num_kv_heads, head_size]`` and contiguous, so flat slot ``s`` of kv head
``h`` starts at element ``(s * num_kv_heads + h) * head_size``. Token ``j`` of a request lives in
slot ``block_table[req, j // block_size] * block_size + j % block_size``.

The attention kernel's grid is ``(query tiles, kv heads, kv splits)``. A program takes up to
``BLOCK_Q`` consecutive query tokens of one request together with all ``G = num_heads //
num_kv_heads`` query heads that share its kv head, so each K/V tile it loads serves
``BLOCK_Q * G`` rows (GQA costs no extra K/V traffic). Request ``r`` owns tiles starting at
``query_start_loc[r] // BLOCK_Q + r``: that numbering needs no host-side tile table, leaves at most
``num_reqs`` idle tiles, and a program finds its request by a binary search over
``query_start_loc``. Decode-only launches set ``DECODE_ONLY``: their grid is ``(kv heads,
requests, kv splits)`` and tile ``r`` serves request ``req_order[r]`` (or ``r`` without an order).

Load balance of decode batches (why the order): a decode program's work is its request's context
length, which in a continuous batch ranges over several times. The GPU hands out programs in grid
order (first axis fastest), so with the runner's ``req_order`` (requests by descending context)
and the kv head as the fastest axis, the longest programs start first and the short ones fill the
tail: the longest-processing-time-first rule, which keeps the SMs busy until the end of the launch.

Causality is by absolute position: query ``i`` of a request with ``q_len`` new tokens and
``seq_len`` context sits at ``seq_len - q_len + i`` and sees keys ``<=`` that (and, with a sliding
window ``w``, ``>`` that ``- w``). This one rule covers fresh prefills, prefix-cached prompts,
chunked-prefill continuations and decodes alike.

Split-KV (flash-decoding): with ``num_splits > 1`` each program covers one contiguous slice of
the key range and writes an unnormalised partial result plus its running max and sum;
``_combine_splits_kernel`` merges them in a second launch. With ``PAGEDLM_CUDA_SPLIT_KV_MERGE=kernel``
(:func:`split_merge_in_kernel`) the last program of a (query tile, kv head) to finish merges them
instead, in the same launch (a counter per pair, taken with an acquire-release atomic:
:func:`.wna16_gemv.split_k_counters`, shared with the split-K GEMMs; where the counters do not
exist yet inside a CUDA-graph capture, the combine launch still runs). Split-KV is used when there
are too few (request, kv head) pairs to fill the GPU, i.e. small decode batches over long contexts.

FP8 cache (float8_e4m3fn, stored = value / scale): every launch under a 16-bit query converts
each tile to float16 for float16 dots. Decode-only launches run the key loop transposed
(``_fp8_decode_tiles``: ``S^T = K Q^T`` with the keys on the MMA's M side), with the block ids one
tile ahead; the others take the common loop (``FP8_FP16_DOTS``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch, pdl_options, pdl_wait
from pagedlm.backends.cuda.kernels.wna16_gemv import split_k_counters

__all__ = ["paged_attention", "write_kv_cache", "choose_num_splits", "launch_shape", "split_merge_in_kernel"]

#: the combine kernel's split capacity (one variant up to it; choose_num_splits never exceeds it)
MAX_COMBINED_SPLITS = 16
# exp2 is cheaper than exp on GPUs; scores are scaled by log2(e) once so exp2 gives exp.
_LOG2E = tl.constexpr(1.4426950408889634)
# Triton 3.6's interpreter computes bf16 tl.dot wrongly (garbage, seen on CPU); under it the dots
# take float32 copies of the same bf16 values instead. Never set on a GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def split_merge_in_kernel() -> bool:
    """Whether split-KV launches merge their partials in the kernel (``PAGEDLM_CUDA_SPLIT_KV_MERGE``
    ``kernel``) rather than in a second, combine launch (``launch``, the default until the in-kernel
    merge is timed on a GPU: its test passed on an H200, 2026-12-07; any other value is an error)."""
    value = os.environ.get("PAGEDLM_CUDA_SPLIT_KV_MERGE", "launch")
    if value not in ("launch", "kernel"):
        raise ValueError(f"PAGEDLM_CUDA_SPLIT_KV_MERGE={value!r}: allowed values are 'launch' (a combine kernel "
                         "after the attention launch) and 'kernel' (the last split of each group merges)")
    return value == "kernel"


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per token: copy its ``[Hkv, D]`` key and value into the cache slot."""
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # negative slots are padding: nothing to store
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, HEAD_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)
        dst = slot * (NUM_KV_HEADS * HEAD_SIZE) + h * HEAD_SIZE + d
        k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e4m3_to_f16(x, ASM: tl.constexpr):
    """float8e4nv -> float16 (exact), in ``x``'s own register layout when ``ASM``."""
    if not ASM:
        return x.to(tl.float16)
    # NOTE: not ``x.to(tl.float16)``, and not pure: for a pure cast Triton hoists the tile's
    # layout conversion above it and converts in the dot-operand layout, whose 8-bit values it
    # then reads from shared memory one byte per instruction (64 LDS.U8 per thread per V tile,
    # sm_90, Triton 3.6). An opaque op keeps the conversion in the load layout (16-byte reads).
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _block_ids(bt_row, start, kv_hi, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_N]`` block-table entries of keys ``[start, start + BLOCK_N)`` (0 from ``kv_hi`` on)."""
    pos = start + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < kv_hi, other=0)


@triton.jit
def _kv_tile(start, block_ids, kv_hi, head_off, d, d_valid, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys ``[start, start + BLOCK_N)`` of one sequence and kv head, whose blocks are
    ``block_ids``: their positions ``[BLOCK_N]``, which are ``< kv_hi``, and the cache offsets and
    mask of their ``[BLOCK_N, HEAD_PAD]`` tile."""
    pos = start + tl.arange(0, BLOCK_N)
    pos_valid = pos < kv_hi
    slot = block_ids.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_off = slot[:, None] * (NUM_KV_HEADS * HEAD_SIZE) + head_off + d[None, :]
    return pos, pos_valid, kv_off, pos_valid[:, None] & d_valid[None, :]


@triton.jit
def _fp8_decode_tiles(q, qk_scale, row_valid, q_pos, kv_lo, kv_hi, bt_row, head_off, d, d_valid,
                      key_cache_ptr, value_cache_ptr, sliding_window,
                      NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      USE_WINDOW: tl.constexpr, ON_GPU: tl.constexpr):
    """The key loop of a decode program over an FP8 cache, transposed: ``S^T = K Q^T`` puts the
    ``BLOCK_N`` keys on the MMA's M side and the few query rows (``BLOCK_M`` = 8, 4 of them real
    under GQA 4) on its N side, where 8 is a whole tile. K is read from shared memory in the dot
    operand layout as e4m3 and converted there to float16 (exact); V is converted once per tile
    in its load layout (:func:`_e4m3_to_f16`) for ``O^T = V^T P^T``.

    Why it runs fast (measured at sm_90, Triton 3.6, 2 warps, 32 keys a tile, 3 stages; the loop
    was latency-bound: an iteration took ~3 us for ~380 instructions a warp; the default is now 1
    warp, 16 keys, 2 stages, whose smaller programs keep more of them resident, see launch_shape):

    - the block ids come one tile ahead, in registers, so the K/V copies of a tile do not wait for
      the block-table load of the same iteration, and the pipeliner keeps ``num_stages - 1`` tiles
      of copies in flight (with the ids loaded in the loop it pipelined the id load instead and
      waited for every copy at the top of each iteration);
    - one float16 dot for the scores: below 4 warps Triton runs even an e4m3 x e4m3 dot as float16
      MMAs, so the former two-tile e4m3 query doubled the MMA chain for nothing;
    - the softmax sum is kept per key column and reduced once at the end, which saves two
      cross-warp reductions (and their barriers) per tile.

    Args:
        q: ``[BLOCK_M, HEAD_PAD]`` float16
        qk_scale: softmax scale x k_scale
    Returns:
        ``acc_t [HEAD_PAD, BLOCK_M]`` (unnormalised, V unscaled), running max and sum ``[BLOCK_M]``
    """
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_t = tl.zeros([HEAD_PAD, BLOCK_M], tl.float32)
    q_t = tl.trans(q)
    if not ON_GPU:  # the interpreter's float16 dots are inexact: the same values in float32
        q_t = q_t.to(tl.float32)
    next_ids = _block_ids(bt_row, kv_lo, kv_hi, BLOCK_SIZE, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        block_ids = next_ids
        next_ids = _block_ids(bt_row, start + BLOCK_N, kv_hi, BLOCK_SIZE, BLOCK_N)
        pos, pos_valid, kv_off, kv_mask = _kv_tile(start, block_ids, kv_hi, head_off, d, d_valid, NUM_KV_HEADS,
                                                   HEAD_SIZE, BLOCK_SIZE, BLOCK_N)
        k = tl.load(key_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v_e4m3 = tl.load(value_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        k = k.to(tl.float16)
        if not ON_GPU:
            k = k.to(tl.float32)
        s_t = tl.dot(k, q_t) * (qk_scale * _LOG2E)  # [BLOCK_N, BLOCK_M]
        visible = pos_valid[:, None] & row_valid[None, :] & (pos[:, None] <= q_pos[None, :])
        if USE_WINDOW:
            visible = visible & (pos[:, None] > q_pos[None, :] - sliding_window)
        s_t = tl.where(visible, s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p_t = tl.exp2(s_t - m_safe[None, :])
        alpha = tl.exp2(m_i - m_safe)
        l_t = l_t * alpha[None, :] + p_t
        v = _e4m3_to_f16(v_e4m3, ON_GPU)
        p_v = p_t.to(tl.float16)
        if not ON_GPU:
            v = v.to(tl.float32)
            p_v = p_v.to(tl.float32)
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p_v)
        m_i = m_new
    return acc_t, m_i, tl.sum(l_t, 0)


@triton.jit
def _tile_start(query_start_loc_ptr, req, BLOCK_Q: tl.constexpr):
    return tl.load(query_start_loc_ptr + req) // BLOCK_Q + req


# num_reqs and the window change from step to step: specialising on their values (== 1,
# divisible by 16) would compile new variants in the middle of a run
# NOTE: the split count is a runtime argument (only split or not is compiled in), so one decode
# variant serves every count: each count as a constexpr was a variant of this kernel and of the
# combine kernel to compile at start-up (8 of 22 for Qwen3-0.6B; these two are the slowest to build).
@triton.jit(do_not_specialize=["num_reqs", "sliding_window", "num_splits"])
def _paged_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, req_order_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, count_ptr, k_scale_ptr, v_scale_ptr, span_end_ptr,
    num_reqs, num_heads, scale, soft_cap, sliding_window, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr, COMBINE: tl.constexpr, DECODE_ONLY: tl.constexpr, ORDERED: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr, FP8_KV: tl.constexpr, FP8_FP16_DOTS: tl.constexpr, FP8_DECODE: tl.constexpr,
    ON_GPU: tl.constexpr, HAS_SPANS: tl.constexpr, USE_PDL: tl.constexpr, IDS_AHEAD: tl.constexpr,
):
    pdl_wait(USE_PDL)
    split = tl.program_id(2)

    # -- which request and which of its query tokens this program owns --------------------------
    if DECODE_ONLY:
        kv_head = tl.program_id(0)
        tile = tl.program_id(1)
        if ORDERED:
            req = tl.load(req_order_ptr + tile)
        else:
            req = tile
        q_tile_start = 0
    else:
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        # largest r with tile_start(r) <= tile; tile_start is strictly increasing in r
        lo = 0
        hi = num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _tile_start(query_start_loc_ptr, mid, BLOCK_Q) <= tile:
                lo = mid
            else:
                hi = mid - 1
        req = lo
        q_tile_start = (tile - _tile_start(query_start_loc_ptr, req, BLOCK_Q)) * BLOCK_Q
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    if q_tile_start < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len  # tokens cached before this step

        # rows: (query token, head in the GQA group) pairs, query-major
        rows = tl.arange(0, BLOCK_M)
        q_local = rows // GROUP_PAD
        g = rows % GROUP_PAD
        q_idx = q_tile_start + q_local
        row_valid = (q_local < BLOCK_Q) & (g < GROUP) & (q_idx < q_len)
        head = kv_head * GROUP + g
        q_pos = context_len + q_idx  # absolute position of each row's token
        token = (q_begin + q_idx).to(tl.int64)

        d = tl.arange(0, HEAD_PAD)
        d_valid = d < HEAD_SIZE
        q = tl.load(
            query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_valid[:, None] & d_valid[None, :], other=0.0,
        )
        if UPCAST_DOTS:
            q = q.to(tl.float32)

        # -- key range: causal end of this tile, window start, then this split's slice ----------
        last_q = tl.minimum(q_tile_start + BLOCK_Q, q_len) - 1
        kv_end = context_len + last_q + 1
        # each row sees the keys before q_limit: its causal end, or past it the end of the
        # bidirectional span (an image) its token is in
        q_limit = q_pos + 1
        if HAS_SPANS:
            span_end = tl.load(span_end_ptr + token, mask=row_valid, other=0)
            q_limit = tl.maximum(q_limit, span_end)
            kv_end = tl.maximum(kv_end, tl.max(tl.where(row_valid, q_limit, 0), 0))
        kv_begin = 0
        if USE_WINDOW:
            kv_begin = tl.maximum(context_len + q_tile_start - sliding_window + 1, 0)
            kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
        if SPLIT_KV:
            span = kv_end - kv_begin
            per_split = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
            kv_lo = kv_begin + split * per_split
            kv_hi = tl.minimum(kv_lo + per_split, kv_end)
        else:
            kv_lo = kv_begin
            kv_hi = kv_end

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        head_off = kv_head * HEAD_SIZE
        # NOTE: an FP8 cache (stored = value / scale) under a 16-bit query: float16 dots of the
        # query (clamped to float16's range: bf16 -> float16 is exact inside it) with the cached
        # values converted to float16 (exact for e4m3); the scales are folded into the score scale
        # (k) and the output (v). Decode-only launches take the transposed loop of
        # _fp8_decode_tiles (FP8_DECODE), the others (prefill tiles, soft caps) the loop below
        # (FP8_FP16_DOTS). (Bare fp8 -> bf16 casts with the scales folded compiled worse: Triton
        # moved those casts into the dot-operand layout, read byte by byte from shared memory.)
        # A float32 query keeps a float32 multiply per value.
        qk_scale = scale
        if FP8_KV:
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
            if FP8_FP16_DOTS or FP8_DECODE:
                qk_scale = scale * k_scale
                q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
                if UPCAST_DOTS:
                    q = q.to(tl.float32)
        if FP8_DECODE:
            acc_t, m_i, l_i = _fp8_decode_tiles(
                q, qk_scale, row_valid, q_pos, kv_lo, kv_hi, bt_row, head_off, d, d_valid,
                key_cache_ptr, value_cache_ptr, sliding_window, NUM_KV_HEADS, HEAD_SIZE, HEAD_PAD,
                BLOCK_SIZE, BLOCK_M, BLOCK_N, USE_WINDOW, ON_GPU)
            acc = tl.trans(acc_t)
        else:
            # NOTE: with IDS_AHEAD the block ids come one tile ahead (see _fp8_decode_tiles)
            if IDS_AHEAD:
                next_ids = _block_ids(bt_row, kv_lo, kv_hi, BLOCK_SIZE, BLOCK_N)
            for start in range(kv_lo, kv_hi, BLOCK_N):
                if IDS_AHEAD:
                    block_ids = next_ids
                    next_ids = _block_ids(bt_row, start + BLOCK_N, kv_hi, BLOCK_SIZE, BLOCK_N)
                else:
                    block_ids = _block_ids(bt_row, start, kv_hi, BLOCK_SIZE, BLOCK_N)
                pos, pos_valid, kv_off, kv_mask = _kv_tile(start, block_ids, kv_hi, head_off, d, d_valid,
                                                           NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, BLOCK_N)
                k = tl.load(key_cache_ptr + kv_off, mask=kv_mask, other=0.0)
                if FP8_FP16_DOTS:
                    k = k.to(tl.float16)
                elif FP8_KV:
                    k = (k.to(tl.float32) * k_scale).to(q.dtype)
                if UPCAST_DOTS:
                    k = k.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
                if USE_SOFT_CAP:
                    # cap * tanh(s * scale / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1)
                    x = s * (qk_scale / soft_cap)
                    s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * _LOG2E
                else:
                    s = s * (qk_scale * _LOG2E)
                visible = row_valid[:, None] & pos_valid[None, :] & (pos[None, :] < q_limit[:, None])
                if USE_WINDOW:
                    visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # a row that has seen no visible key yet keeps m = -inf; subtract 0 there instead
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(value_cache_ptr + kv_off, mask=kv_mask, other=0.0)
                if FP8_FP16_DOTS:
                    v = v.to(tl.float16)
                elif FP8_KV:
                    v = (v.to(tl.float32) * v_scale).to(q.dtype)
                p_v = p.to(v.dtype)  # P@V in the cache dtype, like every flash-attention kernel
                if UPCAST_DOTS:
                    p_v = p_v.to(tl.float32)
                    v = v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
                m_i = m_new
        if FP8_FP16_DOTS or FP8_DECODE:
            acc = acc * v_scale  # the partial results are linear in V: its scale once, at the end

        out_mask = row_valid[:, None] & d_valid[None, :]
        if not SPLIT_KV:
            # a row with no visible key (only padding rows) gets zeros rather than 0/0
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            part = (token * num_heads + head) * num_splits + split  # [BLOCK_M]
            tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=out_mask)
            tl.store(part_max_ptr + part, m_i, mask=row_valid)
            tl.store(part_sum_ptr + part, l_i, mask=row_valid)
            if COMBINE:
                # the group's last split to finish merges the partials (no combine launch); every
                # thread's partial is stored before the (release) count is taken
                tl.debug_barrier()
                arrived = tl.atomic_add(count_ptr + tile * NUM_KV_HEADS + kv_head, 1, sem="acq_rel", scope="gpu")
                if arrived == num_splits - 1:
                    _merge_splits(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, token, head, d, row_valid,
                                  out_mask, num_heads, num_splits, stride_ot, stride_oh, HEAD_PAD, BLOCK_M)
                    tl.atomic_xchg(count_ptr + tile * NUM_KV_HEADS + kv_head, 0)


@triton.jit
def _merge_splits(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, token, head, d, row_valid, out_mask,
                  num_heads, num_splits, stride_ot, stride_oh, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows ``(token, head)`` ``[BLOCK_M]``: the softmax-weighted sum of their ``num_splits``
    partial results (loads from L2 with ``.cg``: the other programs' stores are there, L1 is not
    coherent)."""
    base = (token * num_heads + head) * num_splits
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(num_splits):
        m_all = tl.maximum(m_all, tl.load(part_max_ptr + base + s, mask=row_valid, other=float("-inf"),
                                          cache_modifier=".cg"))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for s in range(num_splits):
        w = tl.exp2(tl.load(part_max_ptr + base + s, mask=row_valid, other=float("-inf"), cache_modifier=".cg")
                    - m_safe)  # 0 for a split that saw no key
        total += w * tl.load(part_sum_ptr + base + s, mask=row_valid, other=0.0, cache_modifier=".cg")
        acc += w[:, None] * tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_PAD + d[None, :], mask=out_mask,
                                    other=0.0, cache_modifier=".cg")
    o = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads, stride_ot, stride_oh, num_splits,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (token, head): merge the ``num_splits <= MAX_SPLITS`` partial softmax results."""
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * num_heads + head) * num_splits
    s = tl.arange(0, MAX_SPLITS)
    s_valid = s < num_splits
    d = tl.arange(0, HEAD_PAD)
    m = tl.load(part_max_ptr + base + s, mask=s_valid, other=float("-inf"))
    l = tl.load(part_sum_ptr + base + s, mask=s_valid, other=0.0)
    m_all = tl.max(m, 0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_safe)  # 0 for splits that saw no key
    total = tl.sum(w * l, 0)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_PAD + d[None, :], mask=s_valid[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V into the paged cache.

    Args:
        key, value: ``[T, Hkv, D]`` (last dim contiguous; token/head strides free)
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` contiguous
        slot_mapping: ``[T]`` int64 flat slot per token; ``< 0`` skips the token
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "K/V must be contiguous in the head dimension"
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    launch(
        _write_kv_kernel, (num_tokens,),
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        num_warps=1 if num_kv_heads * head_size <= 512 else 4, **pdl_options(key.device),
    )


def choose_num_splits(num_tiles: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int = 64) -> int:
    """Splits of the key range: the smallest power of two that gives about 3.5 programs per SM
    (at most :data:`MAX_COMBINED_SPLITS`, and never a split shorter than two key tiles).

    Why 3.5: on an H200 (132 SMs, two decode programs resident per SM) with nano-like ragged
    batches taken longest first, that is where splitting stopped paying for its partial results
    (``bench_attention.py``, 2026-11-29): 64 requests x 8 kv heads ran as fast unsplit, 48 were
    6% faster with 2 splits, 24 were 30% faster with 4, 8 were 2.7x faster with 8."""
    programs = max(1, num_tiles * num_kv_heads)
    target = 7 * num_sms // 2
    limit = min(MAX_COMBINED_SPLITS, max(1, max_seq_len // (2 * block_n)))
    splits = 1
    while programs * splits < target and splits * 2 <= limit:
        splits *= 2
    return splits


def launch_shape(decode_only: bool, fp8_decode: bool, group_pad: int,
                 config: dict[str, int] | None = None) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of a launch: the defaults, or ``config``'s."""
    cfg = config or {}
    if not decode_only:
        return (max(cfg.get("BLOCK_M", 64), group_pad, 16), cfg.get("BLOCK_N", 64), cfg.get("num_warps", 4),
                cfg.get("num_stages", 2))
    if fp8_decode:
        # 8 rows (the MMA's N side), 16 keys a tile, 1 warp, 2 stages: the smallest programs, so
        # more of a batch-256 step's (request, kv head) programs are resident at once (see
        # _fp8_decode_tiles). H100, 256 x 768, Llama-3.1-8B heads: 147 us against 153 at the
        # former 32 keys / 2 warps / 3 stages, and the fixed 256 x 512/512 FP8 run 1.3 % faster
        # (2026-12-07, bench_attention.py and gpu_targets.py; docs/benchmarks.md)
        return (max(cfg.get("BLOCK_M", 8), group_pad, 8), cfg.get("BLOCK_N", 16), cfg.get("num_warps", 1),
                cfg.get("num_stages", 2))
    return max(16, group_pad), cfg.get("BLOCK_N", 64), cfg.get("num_warps", 4), cfg.get("num_stages", 3)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int = 1,
    req_order: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    span_end: torch.Tensor | None = None,
) -> None:
    """Attention of ``num_tokens`` flat query rows over the paged cache, written into ``out``.

    Args:
        out: ``[T', H, D]`` (``T' >= num_tokens``; rows past ``num_tokens`` are left as they are)
        query: ``[T', H, D]``, last dim contiguous
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` contiguous
        block_table: ``[B', max_blocks]`` int32, rows for the first ``num_reqs`` requests
        seq_lens: ``[B']`` int32 context length including this step's tokens
        query_start_loc: ``[B' + 1]`` int32
        max_query_len: longest query of the batch (1 selects the decode-only grid)
        num_splits: key-range splits (power of two); 1 = no split-KV
        req_order: ``[B']`` int32, a permutation of the first ``num_reqs`` requests, longest context
            first; decode-only launches start their programs in this order (load balance)
        config: optional overrides of ``BLOCK_M``/``BLOCK_N``/``num_warps``/``num_stages``, and
            ``IDS_AHEAD`` (the common loop reads the block ids one tile ahead, as the FP8
            decode loop always does)
        k_scale, v_scale: ``[1]`` float32 with a float8 cache (stored = value / scale): the tiles
            are rescaled to the query's dtype as they load; None for a cache in the query's dtype
        span_end: ``[>= num_tokens]`` int32 or None: per query token, the end position of the
            bidirectional span (an image) it is in, 0 outside one; such a token also sees the
            span's keys after its own position (the keys must be in the cache: whole spans are
            computed in one step). Its launches take the prefill grid.
    """
    if num_tokens == 0 or num_reqs == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_size))
    decode_only = max_query_len == 1 and span_end is None
    fp32 = query.dtype == torch.float32
    fp8_kv = key_cache.dtype != query.dtype
    if fp8_kv and (k_scale is None or v_scale is None):
        raise ValueError(f"a {key_cache.dtype} KV cache needs k_scale and v_scale")
    # decode-only launches over an FP8 cache under a 16-bit query take the transposed loop
    # (_fp8_decode_tiles), but for soft-capped models, which read FP8 in the loop of prefill tiles
    fp8_decode = fp8_kv and not fp32 and decode_only and soft_cap is None
    block_m, block_n, num_warps, num_stages = launch_shape(decode_only, fp8_decode, group_pad, config)
    block_q = 1 if decode_only else block_m // group_pad
    num_tiles = num_reqs if decode_only else num_tokens // block_q + num_reqs
    if num_splits > 1:
        assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
        n = out.shape[0] * num_heads * num_splits
        part_acc = torch.empty(n, head_pad, dtype=torch.float32, device=out.device)
        part_max = torch.empty(n, dtype=torch.float32, device=out.device)
        part_sum = torch.empty(n, dtype=torch.float32, device=out.device)
    else:
        part_acc = part_max = part_sum = out  # unused
    # with counters at hand the split groups' last programs merge the partials (else a combine launch)
    merge_in_kernel = num_splits > 1 and split_merge_in_kernel()
    counters = split_k_counters(out.device, num_tiles * num_kv_heads) if merge_in_kernel else None
    grid = (num_kv_heads, num_tiles, num_splits) if decode_only else (num_tiles, num_kv_heads, num_splits)
    ordered = decode_only and req_order is not None
    launch(
        _paged_attention_kernel, grid,
        out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        req_order if ordered else seq_lens, part_acc, part_max, part_sum,
        counters if counters is not None else seq_lens,
        k_scale if fp8_kv else seq_lens, v_scale if fp8_kv else seq_lens,
        span_end if span_end is not None else seq_lens,
        num_reqs, num_heads, float(scale), float(soft_cap or 1.0), int(sliding_window or 0), num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT_KV=num_splits > 1, COMBINE=counters is not None, DECODE_ONLY=decode_only, ORDERED=ordered,
        USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=sliding_window is not None,
        # fp32 models are the HF-parity configuration: no tf32 rounding in the dots there
        DOT_PRECISION="ieee" if fp32 else "tf32",
        UPCAST_DOTS=INTERPRET and query.dtype == torch.bfloat16, FP8_KV=fp8_kv,
        FP8_FP16_DOTS=fp8_kv and not fp32 and not fp8_decode, FP8_DECODE=fp8_decode,
        ON_GPU=not INTERPRET, HAS_SPANS=span_end is not None,
        IDS_AHEAD=bool((config or {}).get("IDS_AHEAD", False)),
        num_warps=num_warps, num_stages=num_stages, **pdl_options(query.device),
    )
    if num_splits > 1 and counters is None:
        launch(
            _combine_splits_kernel, (num_tokens, num_heads),
            out, part_acc, part_max, part_sum, num_heads, out.stride(0), out.stride(1), num_splits,
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, MAX_SPLITS=max(MAX_COMBINED_SPLITS, num_splits), num_warps=1,
            **pdl_options(out.device),
        )
