"""Row-wise scaled FP8 GEMM in Triton, for the row counts of a decode batch.

``torch._scaled_mm`` with row-wise scales runs one cuBLASLt kernel with 128 x 128 output tiles
at every row count (the only FP8 kernel in a profile of Llama-3.1-8B's fixed 256 x 512/512
workload, H100, 2026-12-06). A small decode batch then gives a 4096-wide weight (the o and down
projections) 32 tiles, and most of an H100's 132 SMs idle while the weight streams through the
others. Where cuBLASLt's tiles would not fill the SMs once (:func:`rowwise_tiles`) and the row
count has an entry in :data:`ROWWISE_TILES` (measured by ``bench_quant.py --sweep-fp8``), this
kernel runs instead with more, smaller tiles, or with cuBLASLt-sized tiles split along K
(``SPLIT_K``: each split's float32 partial tile summed by the tile's last program, in split
order, as the W4A16 GEMV does). Measured without splits (H100, 2026-12-07, the q/k/v, o and down
projections together): 1.41x cuBLASLt at 16 rows, 1.26x at 64, 1.10x at 128, but 0.85x at 256,
where smaller tiles read each weight tile once per row tile (and a profiled fixed-workload run
was 10 % slower with this kernel there): the split tiles are for those row counts. Wide weights
(gate_up) and prefills keep cuBLASLt.

The numerics are ``torch._scaled_mm``'s: FP8 x FP8 products summed on the tensor cores, promoted
to float32 after each ``BLOCK_K`` slice (Hopper's FP8 MMAs keep fewer accumulator bits than
float32; cuBLASLt promotes likewise), then ``acc * x_scale[m] * w_scale[n]`` (+ bias) in float32,
rounded once to the output dtype.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch, pdl_options, pdl_wait
from pagedlm.backends.cuda.kernels.wna16_gemv import split_k_counters, split_k_store

__all__ = ["ROWWISE_TILES", "fp8_rowwise_mm", "num_sms", "product_split", "rowwise_tiles", "split_k"]

# The interpreter's FP8 dots are inexact (numpy); there the tiles are multiplied as float32
# copies of the same FP8 values. Never set on a GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

Tiles = tuple[int, int, int, int, int, int, int]
#: ``max rows -> (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, MAX_SPLIT)``, or None
#: for ``torch._scaled_mm``: the first entry whose bound is at least M applies, and M above every
#: bound takes ``torch._scaled_mm`` too. ``MAX_SPLIT`` caps the split along K (:func:`split_k`).
#: ``bench_quant.py --sweep-fp8 --apply`` rewrites it (this table: its run on an H100, 2026-12-07,
#: before splits existed; the split tiles' sweep at 256 rows on an H200 the same day found none
#: faster than cuBLASLt, so 256 rows keep it).
ROWWISE_TILES: dict[int, Tiles | None] = {
    16: (64, 64, 128, 8, 4, 5, 1),
    64: (64, 32, 128, 8, 4, 5, 1),
    128: (64, 64, 128, 8, 4, 5, 1),
}


@triton.jit
def _fp8_rowwise_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
    stride_om, k_per_split,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, ON_GPU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out [M, N] = (xq [M, K] @ w[N, K]^T) * xs[M] * ws[N] (+ bias)``: program ``(tile,
    split)`` multiplies output tile ``tile`` over K range ``[split * k_per_split, ...)``.

    Tiles are numbered column tile by column tile, ``GROUP_M`` row tiles at a time, so the
    programs that read one weight tile run together and it comes from HBM once. With
    ``SPLIT_K > 1`` each split's scaled product is a float32 partial (``part [SPLIT_K, M, N]``)
    that the tile's last program sums (``split_k_store``); the bias goes with split 0's."""
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    rk = k_start + tl.arange(0, BLOCK_K)
    # NOTE: rows and columns past the edge load row / column 0 instead of being masked (their
    # results are never stored), so only K needs a mask, and only when it does not tile evenly
    # (k_per_split is a multiple of BLOCK_K)
    a_ptrs = xq_ptr + (rm % M).to(tl.int64)[:, None] * stride_xm + rk[None, :]
    b_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (k0 - k_start + rk) < k_end
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
        if ON_GPU:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    m_ok = rm < M
    n_ok = rn < N
    xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:  # noqa: SIM102 (a compile-time branch around a runtime one)
        if pid_k == 0:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        split_k_store(acc, out_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_om, pid, pid_k, SPLIT_K)


#: cuBLASLt's row-wise FP8 output tile (rows, columns), whatever the row count
CUBLAS_TILE = (128, 128)


def rowwise_tiles(m: int, n: int, k: int, num_sms: int) -> Tiles | None:
    """The tiles of this kernel for an ``[m, k] x [k, n]`` product on a GPU of ``num_sms`` SMs, or
    None for ``torch._scaled_mm``: the :data:`ROWWISE_TILES` entry for ``m`` where cuBLASLt's
    tiles would leave SMs idle (fewer of them than SMs). An entry that may split K but would not
    split this product (:func:`split_k`: too many tiles for two splits to fit one wave) is left
    to cuBLASLt: its tiles are the ones splitting was to make up for."""
    if triton.cdiv(m, CUBLAS_TILE[0]) * triton.cdiv(n, CUBLAS_TILE[1]) >= num_sms:
        return None
    bound = min((b for b in ROWWISE_TILES if b >= m), default=None)
    tiles = None if bound is None else ROWWISE_TILES[bound]
    if tiles is not None and tiles[6] > 1 and product_split(m, n, k, tiles, num_sms) == 1:
        return None
    return tiles


def split_k(tiles: int, k: int, block_k: int, max_split: int, num_sms: int) -> int:
    """Splits along K for ``tiles`` output tiles: as many as keep the grid within one wave of
    ``num_sms`` programs (a second, partial wave would idle most SMs again), at most
    ``max_split``, each split at least four ``block_k`` steps long."""
    return max(1, min(max_split, num_sms // tiles, k // (4 * block_k)))


def product_split(m: int, n: int, k: int, tiles: Tiles, num_sms: int) -> int:
    """:func:`split_k` for an ``[m, k] x [k, n]`` product in ``tiles``."""
    block_m, block_n, block_k = tiles[:3]
    return split_k(triton.cdiv(m, block_m) * triton.cdiv(n, block_n), k, block_k, tiles[6], num_sms)


@functools.cache
def num_sms(device: torch.device) -> int:
    """The SM count of a CUDA ``device``; 4 elsewhere (interpreter runs: a small GPU, so that
    small test shapes take this kernel)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp8_rowwise_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype, tiles: Tiles) -> torch.Tensor:
    """``x_q [M, K]`` float8_e4m3fn (row-major), ``x_scale [M, 1]`` float32, ``weight [N, K]``
    float8_e4m3fn (row-major), ``weight_scale [N]`` float32 -> ``[M, N]`` in ``out_dtype``.

    ``tiles``: :func:`rowwise_tiles`' choice, or a candidate of the sweep. Row strides that are
    multiples of 16 (any K ``torch._scaled_mm`` takes) let Triton pipeline the loads; other strides
    are read bytewise."""
    m, k = x_q.shape
    n = weight.shape[0]
    block_m, block_n, block_k, group_m, num_warps, num_stages, _ = tiles
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = product_split(m, n, k, tiles, num_sms(x_q.device))
    counters = split_k_counters(x_q.device, num_tiles) if split > 1 else None
    if counters is None:
        split = 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x_q.device) if split > 1 else out
    launch(_fp8_rowwise_kernel, (num_tiles, split), x_q, x_scale, weight, weight_scale,
           bias if bias is not None else x_scale, out, part, counters if counters is not None else x_scale,
           m, n, k, x_q.stride(0), weight.stride(0), out.stride(0), k_per_split,
           HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
           GROUP_M=group_m, SPLIT_K=split, ON_GPU=not INTERPRET, num_warps=num_warps, num_stages=num_stages,
           **pdl_options(x_q.device))
    return out
