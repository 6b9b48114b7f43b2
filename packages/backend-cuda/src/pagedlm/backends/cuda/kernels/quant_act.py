"""Per-token activation quantization for the W8A8 GEMMs, one launch each (``quant_gemm``).

:func:`quantize_rows` turns ``x [M, K]`` into 8-bit values and a float32 scale per row in one
kernel: a program per row takes the row's ``amax`` (dynamic) or the static scale, divides, clamps
and casts. Unfused, the same took eight torch kernels per linear layer (``float``, ``abs``,
``amax``, ``div``, ``clamp``, ``div``, ``clamp``, cast), about a thousand launches per decode step
of an 8B model. The numerics are core's references' (``quantize_fp8_per_token``,
``quantize_int8_per_token`` in ``pagedlm.core.layers.quantization.utils``): float32 division by
the scale (IEEE), clamp, then round to nearest even.

:func:`int8_dequant_epilogue` applies ``x_scale * weight_scale`` (and the bias) to
``torch._int_mm``'s int32 result in one kernel instead of four.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch, pdl_options, pdl_wait

__all__ = ["FP8_MAX", "INT8_SCALE_DIVISOR", "int8_dequant_epilogue", "quantize_rows"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
INT8_SCALE_DIVISOR = 127.5  # core's convention (compressed-tensors'): see the op contract
#: 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude <= 2**22 to the nearest
#: integer, ties to even (IEEE round-to-nearest); libdevice's rint has no interpreter version
_RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_scale_ptr, K, stride_xm, stride_qm,
    QMIN: tl.constexpr, QMAX: tl.constexpr, DIVISOR: tl.constexpr, STATIC: tl.constexpr,
    ROUND: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program ``row``: ``scale = max(amax(|x_row|) / DIVISOR, 1e-12)`` (or the static one) into
    ``scale_ptr[row]``; ``q_row = clamp(x_row / scale, QMIN, QMAX)`` (rounded when ``ROUND``)."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        # NOTE: div_rn, as for the values below: ``/`` is approximate on the GPU, and an int8 scale
        # one ulp above the reference's turns a row's negative extreme, -127.5 steps exactly,
        # into -127 instead of -128 (a quarter of a tiny model's rows differed, H100)
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), DIVISOR), 1e-12)
    tl.store(scale_ptr + row, scale)
    # NOTE: the second pass re-reads the row (from L1/L2: a row is at most a few tens of KiB)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        # NOTE: div_rn, not ``/`` (an approximate division on the GPU): int8 rounding must see
        # the reference's IEEE quotient (a GPU run found values one step off for K > 4096)
        v = tl.math.div_rn(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32), scale)
        v = tl.minimum(tl.maximum(v, QMIN), QMAX)
        if ROUND:  # clamped to integer bounds first, so rounding cannot leave them
            v = (v + _RNE_MAGIC) - _RNE_MAGIC
        tl.store(q_row + k, v.to(q_ptr.dtype.element_ty), mask=k < K)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, static_scale: torch.Tensor | None,
                  rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (last dim contiguous) -> ``(x_q [rows, K] dtype, scale [M, 1] float32)``.

    ``dtype`` is ``torch.float8_e4m3fn`` (``amax / 448``, clamp +-448) or ``torch.int8``
    (``amax / 127.5``, round half to even, clamp [-128, 127]); ``static_scale`` ``[1]`` float32
    replaces the per-row scale (it is then written to every row of ``scale``, the row-wise
    layout ``torch._scaled_mm`` takes). ``rows >= M`` allocates extra rows left uninitialised
    (``torch._int_mm``'s padding)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    x_q = torch.empty(rows or m, k, dtype=dtype, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return x_q, scale
    if dtype == torch.int8:
        qmin, qmax, divisor = -128.0, 127.0, INT8_SCALE_DIVISOR
    else:
        qmin, qmax, divisor = -FP8_MAX, FP8_MAX, FP8_MAX
    block_k = min(triton.next_power_of_2(k), 4096)
    launch(_quantize_rows_kernel, (m,),
           x, x_q, scale, static_scale if static_scale is not None else scale, k, x.stride(0), x_q.stride(0),
           QMIN=qmin, QMAX=qmax, DIVISOR=divisor, STATIC=static_scale is not None, ROUND=dtype == torch.int8,
           BLOCK_K=block_k, num_warps=4 if block_k <= 2048 else 8, **pdl_options(x.device))
    return x_q, scale


@triton.jit
def _int8_epilogue_kernel(
    acc_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, stride_am, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    mask = m_ok[:, None] & n_ok[None, :]
    acc = tl.load(acc_ptr + rm[:, None].to(tl.int64) * stride_am + rn[None, :], mask=mask, other=0).to(tl.float32)
    xs = tl.load(x_scale_ptr + rm, mask=m_ok, other=0.0)
    ws = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
    out = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


def int8_dequant_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None, m: int, dtype: torch.dtype) -> torch.Tensor:
    """``acc [>= m, N] int32`` -> ``[m, N]`` in ``dtype``: ``(acc * x_scale) * weight_scale (+ bias)``
    in float32, rounded once (the reference's order). ``x_scale [m, 1]``, ``weight_scale [N]``
    float32."""
    n = acc.shape[1]
    out = torch.empty(m, n, dtype=dtype, device=acc.device)
    if m == 0:
        return out
    block_m, block_n = min(16, triton.next_power_of_2(m)), 128
    launch(_int8_epilogue_kernel, (triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
           acc, x_scale, weight_scale, bias if bias is not None else weight_scale, out, m, n, acc.stride(0),
           out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n)
    return out
