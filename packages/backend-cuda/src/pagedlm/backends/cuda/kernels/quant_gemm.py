"""Quantized GEMMs for platform ``cuda``: the ``wna16_gemm``, ``fp8_scaled_mm`` and
``int8_scaled_mm`` ops of :data:`pagedlm.core.layers.custom_ops.OP_CONTRACTS`.

- ``wna16_gemm``: 4-bit weights of the shapes :func:`.w4a16_mma.mma_layout_supported` takes are
  stored in the tensor-core GEMV's layout by ``wna16_repack`` (at loading), and up to
  ``CHUNKED_MAX_ROWS`` rows run that CUDA kernel (:mod:`.w4a16_mma`, a launch per 8 rows); the
  other weights, at most ``GEMV_MAX_ROWS`` rows (decode), the matrix-vector kernel of
  :mod:`.wna16_gemv`. More rows on mma-layout weights: the weights dequantized chunk by chunk
  and multiplied by cuBLAS (:mod:`.w4a16_dequant`; a GEMM's tiles would gather that layout value
  by value). Other weights, more rows: a Triton GEMM that reads the packed int4/int8 weights
  (``[K // pack, N]`` int32, GPTQ's K-major layout every integer format is converted to, or the
  mma layout for float32 activations) and dequantizes each
  ``[BLOCK_K, BLOCK_N]`` tile in its inner loop (scales and zero points by group, or through
  ``g_idx`` for act-order), accumulating in float32 on tensor cores; weights are read from memory
  once, at 4 or 8 bits. Up to 16 rows it splits K across programs (reduced in the same launch,
  :func:`.wna16_gemv.split_k_store`), so a small batch still spreads over the GPU.
- ``fp8_scaled_mm``: per-token (or static) activation quantization in one kernel
  (:mod:`.quant_act`), then, where cuBLASLt's tiles would leave SMs idle (decode batches on
  narrow weights), the Triton GEMM of :mod:`.fp8_gemm` (tiles chosen per row count), else
  ``torch._scaled_mm`` with row-wise scales (Hopper / Ada FP8 tensor cores).
- ``int8_scaled_mm``: the same quantization to int8, ``torch._int_mm`` (int32 accumulation), then
  one kernel for the scales and bias.

Registered by the backend's ``pagedlm_register_ops`` (:mod:`pagedlm.backends.cuda.plugin`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.fp8_gemm import fp8_rowwise_mm, num_sms, rowwise_tiles
from pagedlm.backends.cuda.kernels.launch import launch
from pagedlm.backends.cuda.kernels.quant_act import int8_dequant_epilogue, quantize_rows
from pagedlm.backends.cuda.kernels.w4a16_dequant import mma_dequantized_matmul
from pagedlm.backends.cuda.kernels.w4a16_mma import (
    CHUNKED_MAX_ROWS,
    mma_layout_supported,
    mma_repack,
    prepare_mma_kernel,
    w4a16_mma_gemv,
)
from pagedlm.backends.cuda.kernels.wna16_gemv import GEMV_MAX_ROWS, split_k_counters, split_k_store, wna16_gemv

__all__ = ["fp8_quantized_mm", "fp8_scaled_mm", "int8_scaled_mm", "wna16_gemm", "wna16_repack", "wna16_triton_gemm"]


@triton.jit
def _wna16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_om, k_per_split,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MMA_LAYOUT: tl.constexpr,
):
    """``out [M, N] = x [M, K] @ dequant(qweight)``; program ``(m, n, split)`` computes one output
    tile over the K range ``[split * k_per_split, (split + 1) * k_per_split)``. ``MMA_LAYOUT``:
    4-bit ``qweight`` in :mod:`.w4a16_mma`'s layout (``mma_word_and_shift``'s arithmetic)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if MMA_LAYOUT:
            # word = k part + n part, field offset likewise (w4a16_mma.mma_word_and_shift)
            k_word = ((rk >> 6) * 32 + ((rk >> 4) & 3)) * 4 + ((rk >> 2) & 3)
            n_word = ((rn >> 4) * (K // 64) * 32 + (rn & 7) * 4) * 4
            shift = 4 * (4 * (rk & 1) + 2 * ((rk >> 1) & 1))[:, None] + (4 * ((rn >> 3) & 1))[None, :]
            words = tl.load(qw_ptr + k_word[:, None] + n_word[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0)
            q = (words >> shift) & MASK
        else:
            words = tl.load(qw_ptr + (rk // PACK)[:, None] * N + rn[None, :], mask=k_ok[:, None] & n_ok[None, :],
                            other=0)
            q = (words >> ((rk % PACK) * BITS)[:, None]) & MASK
        if HAS_G_IDX:
            g = tl.load(g_ptr + rk, mask=k_ok, other=0)
        else:
            g = rk // GROUP_SIZE  # a constexpr: a shift, not an integer division per value
        s = tl.load(s_ptr + g[:, None] * N + rn[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g[:, None] * N + rn[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0)
        else:
            z = 1 << (BITS - 1)
        w = ((q - z).to(tl.float32) * s.to(tl.float32)).to(x_ptr.dtype.element_ty)
        acc += tl.dot(x, w, out_dtype=tl.float32, input_precision=DOT_PRECISION)
    split_k_store(acc, out_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_om, pid_m * tl.num_programs(1) + pid_n,
                  pid_k, SPLIT_K)


def _wna16_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)`` for an ``[m, k] x [k, n]`` product."""
    if m <= 16:
        # decode: one row tile; split K so that ~2 programs per SM-ish cover the weights
        block_n, block_k = 64, 64
        tiles = triton.cdiv(n, block_n)
        split = max(1, min(k // block_k, 256 // max(tiles, 1)))
        while split > 1 and k % (split * block_k):
            split -= 1
        return 16, block_n, block_k, split
    if m <= 64:
        return 32, 64, 64, 1
    return 64, 128, 32, 1


def wna16_repack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 g_idx: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """The ``wna16_repack`` op: the tensor-core GEMV's layout where it applies (its kernel built
    now, before any graph capture), else ``qweight`` as it is."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    if not mma_layout_supported(bits, group_size, g_idx is not None, k, n, scales.dtype, qweight.device):
        return qweight
    prepare_mma_kernel(qweight.device, n, k, group_size, scales.dtype, zeros is not None)
    return mma_repack(qweight)


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               g_idx: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """The ``wna16_gemm`` op (contract in core's ``custom_ops``): ``x [M, K] -> [M, N]``, reading
    ``qweight`` as :func:`wna16_repack` returned it."""
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not hold {k} rows of {bits}-bit values")
    mma = mma_layout_supported(bits, group_size, g_idx is not None, k, n, scales.dtype, qweight.device)
    if mma and 0 < m <= CHUNKED_MAX_ROWS and x.dtype == scales.dtype:
        return w4a16_mma_gemv(x, qweight, scales, zeros, group_size)
    if 0 < m <= GEMV_MAX_ROWS and not mma:
        return wna16_gemv(x, qweight, scales, zeros, g_idx, bits, group_size)
    if mma and m > CHUNKED_MAX_ROWS and x.dtype == scales.dtype:
        return mma_dequantized_matmul(x, qweight, scales, zeros, group_size)
    return wna16_triton_gemm(x, qweight, scales, zeros, g_idx, bits, group_size, mma_layout=mma)


def wna16_triton_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      g_idx: torch.Tensor | None, bits: int, group_size: int, *, mma_layout: bool) -> torch.Tensor:
    """The Triton GEMM of ``wna16_gemm`` (any row count; ``x`` contiguous), reading 4-bit
    ``qweight`` in :mod:`.w4a16_mma`'s layout when ``mma_layout``."""
    m, k = x.shape
    n = qweight.shape[1]
    block_m, block_n, block_k, split = _wna16_config(m, n, k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    counters = split_k_counters(x.device, grid[0] * grid[1]) if split > 1 else None
    if split > 1 and counters is None:
        grid, split = grid[:2] + (1,), 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    launch(_wna16_kernel, grid,
           x, qweight, scales, zeros if zeros is not None else scales, g_idx if g_idx is not None else qweight, out,
           part, counters if counters is not None else qweight,
           m, n, k, x.stride(0), out.stride(0), k_per_split,
           GROUP_SIZE=group_size if g_idx is None else 32 // bits,
           BITS=bits, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None, SPLIT_K=split,
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
           # float32 activations are the HF-parity configuration: no TF32 rounding of the dot
           # (with it, a tiny W4A16 Llama's logprobs were 3e-2 from HF's on an H200)
           DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", MMA_LAYOUT=mma_layout)
    return out


_UNIT_SCALES: dict[torch.device, torch.Tensor | None] = {}


def _float32_unit_scale(device: torch.device) -> torch.Tensor | None:
    """A float32 ``1.0`` on ``device`` when ``torch._scaled_mm`` gives float32 outputs under
    tensor-wise scales there, else None (asked once, eagerly; inside a graph capture before that:
    None). NOTE: a probe rather than an assumption because this path had not run on an H200 yet
    when it was written (2026-12-04); test_quant_kernels.py's float32 case fails if it says no."""
    if device not in _UNIT_SCALES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        a = torch.zeros(16, 32, dtype=torch.float8_e4m3fn, device=device)
        one = torch.ones((), dtype=torch.float32, device=device)
        try:
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        except RuntimeError:
            one = None
        _UNIT_SCALES[device] = one
    return _UNIT_SCALES[device]


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  input_scale: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``fp8_scaled_mm`` op: ``x [.., K]`` quantized to float8_e4m3fn (per token, or with the
    static ``input_scale``) in one kernel, then :func:`fp8_quantized_mm`."""
    shape = x.shape
    x_q, scale_a = quantize_rows(x.reshape(-1, shape[-1]), torch.float8_e4m3fn, input_scale)
    out = fp8_quantized_mm(x_q, scale_a, weight, weight_scale, bias, x.dtype)
    return out.reshape(*shape[:-1], weight.shape[0])


def fp8_quantized_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x_q [M, K]`` float8_e4m3fn with row scales ``x_scale [M, 1]`` float32, times ``weight [N,
    K]`` float8_e4m3fn with ``weight_scale [N]`` -> ``[M, N]`` in ``out_dtype`` (+ bias): for a
    decode batch's row counts, where cuBLASLt's tiles would not fill the GPU, the Triton GEMM of
    :mod:`.fp8_gemm`, else ``torch._scaled_mm`` with row-wise scales ``[M, 1] x [1, N]``."""
    scale_b = weight_scale.float().reshape(1, -1)
    # weight [N, K] row-major is the column-major [K, N] operand cuBLASLt's FP8 kernels take.
    one = _float32_unit_scale(x_q.device) if out_dtype == torch.float32 else None
    if one is not None:
        # NOTE: row-wise scales need a bf16 output on Hopper, whose rounding (2^-9) a float32
        # model (the HF-parity configuration) would see: its products come out in float32 under
        # unit scales instead, scaled here in the reference's order
        out = torch._scaled_mm(x_q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        out = out * x_scale * scale_b
    elif (out_dtype != torch.float32 and weight.stride(-1) == 1
          and (tiles := rowwise_tiles(x_q.shape[0], weight.shape[0], x_q.shape[1],
                                      num_sms(x_q.device))) is not None):
        return fp8_rowwise_mm(x_q, x_scale, weight, scale_b.reshape(-1), bias, out_dtype, tiles)
    else:
        mm_dtype = torch.bfloat16 if out_dtype == torch.float32 else out_dtype
        out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scale_b, out_dtype=mm_dtype).to(out_dtype)
    if bias is not None:
        out = out + bias
    return out


def int8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``int8_scaled_mm`` op: per-token (or static) int8 activations in one kernel,
    ``torch._int_mm`` (int32 accumulation; it needs more than 16 rows, so short batches are padded
    with unused rows), then one kernel applying the scales and bias."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    rows = max(32, -(-m // 8) * 8)
    x_q, scale_a = quantize_rows(x2, torch.int8, input_scale, rows=rows)
    acc = torch._int_mm(x_q, weight.t())
    out = int8_dequant_epilogue(acc, scale_a, weight_scale.float().reshape(-1), bias, m, x.dtype)
    return out.reshape(*shape[:-1], weight.shape[0])
