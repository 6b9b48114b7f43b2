"""RMSNorm and SiLU-and-mul fused with the per-token FP8 quantization of the next linear layer's
input: the ``rms_norm_fp8_quant``, ``fused_add_rms_norm_fp8_quant`` and ``silu_and_mul_fp8_quant``
ops of :data:`pagedlm.core.layers.custom_ops.OP_CONTRACTS`.

Unfused, an FP8 W8A8 layer's input took two kernels: the producer (:mod:`.layer_ops`) wrote the
bf16 row, and :func:`.quant_act.quantize_rows` read it back to write float8 values and a scale
(~6% of a Llama-3.1-8B profile, H100). Here a program per row computes the producer's values,
keeps them in registers (the norm, and SiLU-and-mul rows up to 16384 values; wider ones are
recomputed in a second pass), takes the row's amax and writes only the float8 row and its scale.

NOTE: results must be bit for bit the unfused kernels' (the op contracts): the producer part
repeats :mod:`.layer_ops`' expressions in the same order, with the same block size and warps
where a reduction is involved (the norm's sum of squares), rounding to the model dtype where
they store; the quantization repeats :mod:`.quant_act`'s (``div_rn``: IEEE division, as core's
reference divides). Registered for platform ``cuda`` by :mod:`pagedlm.backends.cuda.plugin`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch, pdl_options, pdl_wait
from pagedlm.backends.cuda.kernels.layer_ops import norm_launch_shape

__all__ = ["fused_add_rms_norm_fp8_quant", "rms_norm_fp8_quant", "silu_and_mul_fp8_quant"]

FP8_MAX = tl.constexpr(float(torch.finfo(torch.float8_e4m3fn).max))  # 448
#: SiLU-and-mul rows up to this many values (Llama-3.1-8B's 14336 included) are held in registers
#: by 16 warps and read once; wider ones (intermediate sizes reach 30k, which would spill) are
#: walked twice in chunks of SILU_BLOCK_MAX
SILU_ONE_PASS_MAX = 16384
SILU_BLOCK_MAX = 4096


@triton.jit
def _fp8_scale(amax):
    """``max(amax / 448, 1e-12)``; NOTE: div_rn, not ``/`` (approximate on the GPU), as quant_act."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), 1e-12)


@triton.jit
def _fp8_store(q_ptrs, y, scale, mask):
    """``clamp(y / scale, -448, 448)`` (IEEE division) rounded to float8 at ``q_ptrs``."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -FP8_MAX), FP8_MAX)
    tl.store(q_ptrs, v.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, sum_ptr, stride_x, stride_r, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program ``row``: ``y = rms_norm(x_row (+ res_row))`` in the model dtype, as
    ``layer_ops._rms_norm_kernel`` computes it; ``scale_ptr[row]`` and the float8 ``q`` row of
    ``y``; with ``HAS_RESIDUAL`` the sum row into ``sum_ptr``. Outputs are contiguous ``[rows, N]``."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # rounded like torch's add
        tl.store(sum_ptr + row * N + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    normed = (h * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(dt).to(tl.float32)  # the unfused op's output; masked columns are 0
    scale = _fp8_scale(tl.max(tl.abs(y), 0))
    tl.store(scale_ptr + row, scale)
    _fp8_store(q_ptr + row * N + cols, y, scale, mask)


def _launch_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, N] with a contiguous last dimension, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    rows, n = x.shape
    x_q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    summed = torch.empty(rows, n, dtype=x.dtype, device=x.device) if residual is not None else None
    if residual is not None:
        residual = residual.reshape(rows, n)
    if rows:
        block, num_warps = norm_launch_shape(n)
        launch(
            _rms_norm_quant_kernel, (rows,),
            x, residual if residual is not None else x, weight, x_q, scale, summed if summed is not None else x,
            x.stride(0), residual.stride(0) if residual is not None else 0, float(eps),
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
            **pdl_options(x.device),
        )
    return x_q, scale, summed


def rms_norm_fp8_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, N]`` (last dim contiguous) -> ``(x_q [T, N] float8_e4m3fn, scale [T, 1] float32)``:
    ``quantize_rows(rms_norm(x, weight, eps))`` in one pass."""
    x_q, scale, _ = _launch_norm_quant(x, None, weight, eps)
    return x_q, scale


def fused_add_rms_norm_fp8_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_q, scale, s)``: ``s = x + residual`` ``[T, N]`` in x's dtype and the quantized
    ``rms_norm(s)``, in one pass."""
    x_q, scale, summed = _launch_norm_quant(x, residual, weight, eps)
    assert summed is not None
    return x_q, scale, summed


@triton.jit
def _silu_and_mul_chunk(x_row, k, inter):
    """``silu(gate) * up`` of columns ``k`` of a row, rounded as ``layer_ops._silu_and_mul_kernel``
    rounds (F.silu to the dtype first, then the product), back in float32; 0 where masked."""
    dt = x_row.dtype.element_ty
    mask = k < inter
    gate = tl.load(x_row + k, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + k, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    return (act * up).to(dt).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, stride_x, inter, BLOCK: tl.constexpr,
                               ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr):
    """Program ``token``: with ``ONE_PASS`` (``BLOCK >= inter``) the row's ``silu(gate) * up``, its
    amax and its quantized values from registers; else the amax over chunks (first pass), then
    the values again (elementwise, so the same bits; the row is re-read from L1/L2) quantized
    (second pass)."""
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + token * stride_x
    if ONE_PASS:
        k = tl.arange(0, BLOCK)
        y = _silu_and_mul_chunk(x_row, k, inter)
        scale = _fp8_scale(tl.max(tl.abs(y), 0))
        tl.store(scale_ptr + token, scale)
        _fp8_store(q_ptr + token * inter + k, y, scale, k < inter)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_silu_and_mul_chunk(x_row, k, inter)))
    scale = _fp8_scale(tl.max(amax, 0))
    tl.store(scale_ptr + token, scale)
    for k0 in range(0, inter, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        _fp8_store(q_ptr + token * inter + k, _silu_and_mul_chunk(x_row, k, inter), scale, k < inter)


def silu_and_mul_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, 2I]`` (last dim contiguous) -> ``(x_q [T, I] float8_e4m3fn, scale [T, 1] float32)``:
    ``quantize_rows(silu_and_mul(x))`` in one pass."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, 2I] with a contiguous last dimension, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    num_tokens, width = x.shape
    inter = width // 2
    x_q = torch.empty(num_tokens, inter, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    if num_tokens:
        block = triton.next_power_of_2(inter)
        one_pass = block <= SILU_ONE_PASS_MAX
        if one_pass:
            num_warps = max(4, block // 1024)  # at most 32 values a thread
        else:
            block, num_warps = SILU_BLOCK_MAX, 8
        launch(_silu_and_mul_quant_kernel, (num_tokens,), x, x_q, scale, x.stride(0), inter, BLOCK=block,
               ONE_PASS=one_pass, num_warps=num_warps, **pdl_options(x.device))
    return x_q, scale
