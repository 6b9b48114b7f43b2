"""The ``fp8_block_scaled_mm`` op on CUDA: block-wise FP8 weights (``weight_block_size``,
compressed-tensors' ``block`` strategy) times activations quantized per token and group.

Two launches per linear layer:

- :func:`quantize_row_groups`: a program per (row, group of ``block_k`` values) takes the group's
  ``amax``, writes its scale ``amax / 448`` and the group's float8_e4m3fn values (IEEE division,
  clamp, round to nearest even: core's ``quantize_fp8_per_group``);
- :func:`_fp8_block_gemm_kernel`: a program per ``[BLOCK_M, BLOCK_N]`` output tile walks K one
  weight block (``BLOCK_K = block_k``) at a time: an FP8 x FP8 tensor-core dot with float32
  accumulation, scaled by the rows' group scales and the columns' block scales, summed in float32.

NOTE: ``BLOCK_K`` is the weight's ``block_k`` so that every dot sees one activation scale per row
and one weight scale per column; ``block_k`` must therefore be a power of two of at least 32 (an
FP8 dot's K), which every published block size (128) is; other sizes take core's reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch, pdl_options, pdl_wait

__all__ = ["fp8_block_scaled_mm", "quantize_row_groups"]

# The interpreter's FP8 dots are inexact (numpy); there the tiles are multiplied as float32
# copies of the same FP8 values. Never set on a GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, K, num_groups, stride_xm, stride_qm, group_size,
                            BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program ``(row, group)``: ``scale = max(amax / 448, 1e-12)``, ``q = clamp(x / scale)``."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    k = group * group_size + tl.arange(0, BLOCK)
    ok = (k < K) & (tl.arange(0, BLOCK) < group_size)
    x = tl.load(x_ptr + row * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
    # NOTE: div_rn, the reference's IEEE quotients (``/`` is an approximate division on the GPU:
    # scales one ulp off the reference's, H100, 2026-12-06)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), 448.0), 1e-12)
    tl.store(scale_ptr + row * num_groups + group, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_row_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (last dim contiguous) -> ``(x_q [M, K] float8_e4m3fn, scale [M, ceil(K / group_size)]
    float32)``: each run of ``group_size`` values of a row by its own ``amax / 448``."""
    m, k = x.shape
    groups = triton.cdiv(k, group_size)
    x_q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        launch(_quantize_groups_kernel, (m, groups), x, x_q, scale, k, groups, x.stride(0), x_q.stride(0), group_size,
               BLOCK=triton.next_power_of_2(group_size), num_warps=1 if group_size <= 256 else 4,
               **pdl_options(x.device))
    return x_q, scale


@triton.jit
def _fp8_block_gemm_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, num_k_blocks, stride_xm, stride_wn, stride_om,
    block_n, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ON_GPU: tl.constexpr, USE_PDL: tl.constexpr,
):
    """``out [M, N] = sum_kb (xq[:, kb] @ w[:, kb]^T) * xs[:, kb] * ws[n // block_n, kb]`` (+ bias)."""
    pdl_wait(USE_PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    x_rows = xq_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    w_scale_rows = ws_ptr + (rn // block_n) * num_k_blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(num_k_blocks):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if not ON_GPU:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # NOTE: Hopper's FP8 MMAs keep fewer accumulator bits unless promoted; 32 promotes after
        # every MMA's K step, so a block's sum is float32 (H100: ~5e-4 of the output's range off
        # without it, 2026-12-06)
        part = tl.dot(a, tl.trans(b), out_dtype=tl.float32, max_num_imprecise_acc=32 if ON_GPU else None)
        xs = tl.load(xs_ptr + rm * num_k_blocks + kb, mask=m_ok, other=0.0)
        ws = tl.load(w_scale_rows + kb, mask=n_ok, other=0.0)
        acc += part * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` for ``m`` rows."""
    if m <= 16:
        return 16, 64, 4
    if m <= 64:
        return 64, 64, 4
    return 128, 128, 8


def fp8_block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int,
                        block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``fp8_block_scaled_mm`` op (contract in core's ``custom_ops``): ``x [.., K] -> [.., N]``."""
    if block_k < 32 or block_k & (block_k - 1):
        from pagedlm.core.layers.quantization.utils import fp8_block_scaled_mm_ref

        return fp8_block_scaled_mm_ref(x, weight, weight_scale, block_n, block_k, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        x_q, x_scale = quantize_row_groups(x2, block_k)
        block_m, tile_n, num_warps = _tiles(m)
        launch(_fp8_block_gemm_kernel, (triton.cdiv(m, block_m), triton.cdiv(n, tile_n)),
               x_q, x_scale, weight, weight_scale, bias if bias is not None else x_scale, out,
               m, n, k, triton.cdiv(k, block_k), x_q.stride(0), weight.stride(0), out.stride(0), block_n,
               HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=tile_n, BLOCK_K=block_k, ON_GPU=not INTERPRET,
               num_warps=num_warps, num_stages=3, **pdl_options(x.device))
    return out.reshape(*shape[:-1], n)
