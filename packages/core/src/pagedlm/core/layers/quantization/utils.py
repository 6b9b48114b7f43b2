"""Bit packing, the layouts the quantized-GEMM ops read, and core's torch references of those ops.

Every integer weight-only format (compressed-tensors ``pack-quantized``, GPTQ, AWQ) is converted
after loading to one layout, the one the ``wna16_gemm`` op reads (GPTQ's, K-major):

- ``qweight [K // pack, N] int32``, ``pack = 32 // bits``: element ``(k, n)`` is the unsigned
  ``bits``-wide field at bit ``bits * (k % pack)`` of word ``qweight[k // pack, n]``;
- ``scales [K // G, N]`` in the activation dtype (``G = K`` for per-channel scales);
- ``zeros [K // G, N] int32`` unsigned zero points, or None for symmetric weights (zero point
  ``2 ** (bits - 1)``);
- ``g_idx [K] int32`` the group of each input row (GPTQ ``desc_act``), or None (``k // G``).

``W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]``; the op computes ``x @ W``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "AWQ_PACK_ORDER",
    "FP8_DTYPE",
    "FP8_MAX",
    "QuantizedActivation",
    "fp8_block_dequantize",
    "fp8_block_scaled_mm_ref",
    "fp8_quantized_mm_ref",
    "fp8_scaled_mm_ref",
    "int8_scaled_mm_ref",
    "int8_weight_only_gemm_ref",
    "pack_cols",
    "pack_rows",
    "quantize_fp8_per_group",
    "quantize_fp8_per_token",
    "unpack_cols",
    "unpack_rows",
    "wna16_dequantize",
    "wna16_gemm_ref",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
#: dynamic int8 activation scale = amax / 127.5: compressed-tensors' convention (the 255 steps of
#: [-128, 127] span [-amax, amax]), which defines the numerics its W8A8 checkpoints were made for
INT8_SCALE_DIVISOR = 127.5
#: AWQ's GEMM layout stores the 8 nibbles of a word in this column order: field i holds column
#: ``AWQ_PACK_ORDER[i]`` of its group of 8
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_factor(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits={bits}: packed int32 layouts hold 2, 4 or 8 bits per value")
    return 32 // bits


def pack_cols(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``q [R, C]`` unsigned values ``< 2**bits`` -> ``[R, C // pack] int32``, column ``j`` in field
    ``j % pack`` of word ``j // pack`` (or in the field given by ``order``, AWQ)."""
    pack = _pack_factor(bits)
    rows, cols = q.shape
    if cols % pack:
        raise ValueError(f"{cols} columns are not a multiple of {pack} ({bits}-bit values per int32)")
    q = q.to(torch.int64).view(rows, cols // pack, pack)
    if order is not None:
        q = q[..., list(order)]
    shifts = torch.arange(pack, device=q.device, dtype=torch.int64) * bits
    words = (q << shifts).sum(-1)
    # two's complement into int32 (a set top bit makes the word negative)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_cols(packed: torch.Tensor, bits: int, cols: int | None = None,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_cols`: ``[R, C // pack] int32 -> [R, C] int32`` (unsigned values)."""
    pack = _pack_factor(bits)
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C/pack, pack]
    if order is not None:
        inverse = [0] * pack
        for i, col in enumerate(order):
            inverse[col] = i
        fields = fields[..., inverse]
    out = fields.reshape(packed.shape[0], -1)
    return out if cols is None else out[:, :cols]


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q [R, C]`` -> ``[R // pack, C] int32`` packed along rows (GPTQ's ``qweight``)."""
    return pack_cols(q.t(), bits).t().contiguous()


def unpack_rows(packed: torch.Tensor, bits: int, rows: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_rows`."""
    return unpack_cols(packed.t(), bits, rows).t()


def wna16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     g_idx: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """The ``[K, N]`` weight of the ``wna16_gemm`` layout (module docstring), in ``scales``' dtype."""
    pack = _pack_factor(bits)
    k = qweight.shape[0] * pack
    q = unpack_rows(qweight, bits, k)
    groups = g_idx.to(torch.int64) if g_idx is not None else torch.arange(k, device=q.device) // group_size
    z = zeros.index_select(0, groups) if zeros is not None else 1 << (bits - 1)
    return (q - z).to(scales.dtype) * scales.index_select(0, groups)


def wna16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   g_idx: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """The ``wna16_gemm`` op in torch: dequantize, then ``x [T, K] @ W [K, N]`` in ``x``'s dtype."""
    return x @ wna16_dequantize(qweight, scales, zeros, g_idx, bits, group_size).to(x.dtype)


def quantize_fp8_per_token(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> ``(x_q [T, K] float8_e4m3fn, scale)``: ``scale`` ``[T, 1]`` float32
    (``amax / 448`` per row) when not given, else the given static scale."""
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.float()


class QuantizedActivation(NamedTuple):
    """A linear layer's input already quantized to FP8 per token by the op that produced it (a
    norm or SiLU-and-mul fused with the quantization): what an FP8 linear method with dynamic
    per-token activations takes instead of a tensor (``accepts_fp8_activations``).

    NOTE: ``x_q`` and ``scale`` are exactly ``quantize_fp8_per_token`` of the producer's output
    rounded to ``dtype`` (on the platform's kernels: of its unfused op's output), so the layer's
    result is bit for bit the one it gives the unquantized tensor.
    """

    #: ``[T, K]`` float8_e4m3fn
    x_q: torch.Tensor
    #: ``[T, 1]`` float32, ``max(amax(|row|) / 448, 1e-12)``
    scale: torch.Tensor
    #: the model dtype the layer's output takes (the dtype the producer rounded to)
    dtype: torch.dtype


def fp8_quantized_mm_ref(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The ``fp8_quantized_mm`` op in torch: ``x_q [M, K]`` float8 with row scales ``x_scale [M, 1]``
    times ``weight [N, K]`` float8 with ``weight_scale [N]`` -> ``[M, N]`` in ``out_dtype`` (float32
    products of the fp8 values, plus bias, rounded once)."""
    out = (x_q.float() @ weight.float().t()) * x_scale * weight_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_scaled_mm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``fp8_scaled_mm`` op in torch: :func:`quantize_fp8_per_token`, then
    :func:`fp8_quantized_mm_ref`."""
    x_q, x_scale = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]), input_scale)
    out = fp8_quantized_mm_ref(x_q, x_scale, weight, weight_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def quantize_fp8_per_group(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> ``(x_q [T, K] float8_e4m3fn, scale [T, ceil(K / group_size)] float32)``: each
    run of ``group_size`` values of a row (the last one may be shorter) by its own ``amax / 448``."""
    t, k = x.shape
    groups = -(-k // group_size)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group_size - k)).view(t, groups, group_size)
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    x_q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q.view(t, -1)[:, :k], scale


def fp8_block_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """``weight [N, K]`` float8 with one scale per ``[block_n, block_k]`` block (``weight_scale
    [ceil(N / block_n), ceil(K / block_k)]``) -> the ``[N, K]`` float32 weight."""
    n, k = weight.shape
    scale = weight_scale.float().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    return weight.float() * scale


def fp8_block_scaled_mm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int,
                            block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``fp8_block_scaled_mm`` op in torch: activations quantized per token and group of
    ``block_k``, float32 products of the dequantized values."""
    x_q, x_scale = quantize_fp8_per_group(x.reshape(-1, x.shape[-1]), block_k)
    x_dq = x_q.float() * x_scale.repeat_interleave(block_k, 1)[:, : x_q.shape[1]]
    out = x_dq @ fp8_block_dequantize(weight, weight_scale, block_n, block_k).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def quantize_int8_per_token(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> ``(x_q int8, scale [T, 1] or the static one)``, ``scale = amax / 127.5``."""
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / INT8_SCALE_DIVISOR).clamp(min=1e-12)
    return torch.round(xf / scale).clamp(-128, 127).to(torch.int8), scale.float()


def int8_scaled_mm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``int8_scaled_mm`` op in torch: integer products accumulated exactly (float64)."""
    x_q, x_scale = quantize_int8_per_token(x.reshape(-1, x.shape[-1]), input_scale)
    acc = x_q.double() @ weight.double().t()
    out = acc.float() * x_scale * weight_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def int8_weight_only_gemm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``int8_weight_only_gemm`` op in torch: the weight dequantized in x's dtype, then ``F.linear``."""
    w = weight.to(x.dtype) * weight_scale.to(x.dtype).reshape(-1, 1)
    return torch.nn.functional.linear(x, w, bias)
