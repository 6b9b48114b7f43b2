"""Core's torch layer ops as plain functions with the signatures of ``layers.custom_ops``.

These repeat, step for step, the torch paths of ``RMSNorm``, ``GemmaRMSNorm``, ``RotaryEmbedding`` and
``SiluAndMul`` (HF's arithmetic and rounding order), so a platform's replacement is checked
against exactly what core computes without it. Calling the layers instead would route through
whatever replacement is registered; tests/core checks these agree with the layers bit for bit.
``fused_experts`` is core's torch op itself (a function ``FusedMoE`` calls when no kernel is bound).
``unquantized_gemm`` is the contract's float32 product rounded once (what ``F.linear`` computes on a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlm.core.layers.fused_moe.reference import fused_experts

__all__ = ["cos_sin_cache", "fused_add_rms_norm", "fused_experts", "gemma_fused_add_rms_norm",
           "gemma_qk_norm_rotary_embedding", "gemma_rms_norm", "qk_norm_rotary_embedding", "rms_norm",
           "rotary_embedding", "silu_and_mul", "unquantized_gemm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual  # in the model dtype, as HF adds the residual
    return rms_norm(summed, weight, eps), summed


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gemma_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return gemma_rms_norm(summed, weight, eps), summed


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, rotary_dim: int,
            is_neox_style: bool) -> torch.Tensor:
    num_tokens = x.shape[0]
    x = x.reshape(num_tokens, -1, head_size)
    rot = x[..., :rotary_dim]
    x1, x2 = rot.chunk(2, dim=-1) if is_neox_style else (rot[..., 0::2], rot[..., 1::2])
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if is_neox_style else torch.stack((o1, o2), dim=-1).flatten(-2)
    if rotary_dim < head_size:
        out = torch.cat((out, x[..., rotary_dim:]), dim=-1)
    return out.reshape(num_tokens, -1)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                     is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    cos_sin = cos_sin_cache.index_select(0, positions.flatten())
    cos, sin = cos_sin.to(query.dtype).unsqueeze(1).chunk(2, dim=-1)
    q = _rotate(query, cos, sin, head_size, rotary_dim, is_neox_style)
    k = None if key is None else _rotate(key, cos, sin, head_size, rotary_dim, is_neox_style)
    return q, k


def qk_norm_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                             q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                             cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                             is_neox_style: bool, norm=rms_norm) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens = query.shape[0]
    q = norm(query.reshape(num_tokens, -1, head_size), q_weight, eps).reshape(num_tokens, -1)
    k = norm(key.reshape(num_tokens, -1, head_size), k_weight, eps).reshape(num_tokens, -1)
    q, k_out = rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim, is_neox_style)
    assert k_out is not None
    return q, k_out


def gemma_qk_norm_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                   q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                                   cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                                   is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return qk_norm_rotary_embedding(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, head_size,
                                    rotary_dim, is_neox_style, norm=gemma_rms_norm)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def unquantized_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def cos_sin_cache(base: float, rotary_dim: int, max_position: int) -> torch.Tensor:
    """``[max_position, rotary_dim]`` float32, cos then sin (``RotaryEmbedding``'s table)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
