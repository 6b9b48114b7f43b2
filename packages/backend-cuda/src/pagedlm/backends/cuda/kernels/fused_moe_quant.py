"""The quantized ``fused_experts`` ops in Triton, on :mod:`.fused_moe`'s grouped-GEMM kernel.

- ``fused_experts_fp8``: float8_e4m3fn experts (per-channel float32 scales). Each GEMM's input is
  quantized to FP8 per row first (:func:`quantize_fp8_rows`: the hidden states per token, the
  SiLU-and-mul output per pair), the kernel multiplies FP8 by FP8 on the tensor cores (float32
  accumulation) and applies both scales in its epilogue.
- ``fused_experts_wna16``: int4 / int8 experts in compressed-tensors' packed layout (``[E, N, K //
  pack]`` int32 words, group scales ``[E, N, K // G]``, optional unpacked zero points). The kernel
  reads the words and dequantizes each ``[BLOCK_K, BLOCK_N]`` tile to the activation dtype in its
  inner loop (one group of scales per tile: ``BLOCK_K`` is shrunk to divide the group size), so
  only the packed bytes come from memory.

Both keep the unquantized op's launch rules: block-aligned routing without host synchronisation
(``moe_align_block_size``), grids from the shapes, so a CUDA graph captures them; the start-up's
compile pass queues every :data:`~.fused_moe.CONFIGS` variant. Contracts (and core's torch
references) in :mod:`pagedlm.core.layers.custom_ops`. Registered for platform ``cuda`` by the
backend's ``pagedlm_register_ops``.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedlm.backends.cuda.kernels.fused_moe import (
    CONFIGS,
    W_FP8,
    W_INT,
    _for_dtype,
    get_config,
    invoke_fused_moe_kernel,
)
from pagedlm.backends.cuda.kernels.launch import _COMPILE_ONLY
from pagedlm.core.layers.fused_moe.reference import moe_align_block_size

__all__ = ["fused_experts_fp8", "fused_experts_wna16", "quantize_fp8_rows"]

_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, K]`` -> ``(x_q [R, K] float8_e4m3fn, scale [R] float32)``, ``scale = amax(|row|) /
    448`` (at least 1e-12), values divided by it and clamped to +-448 (no host synchronisation)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / _FP8_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8), scale.reshape(-1)


def _combine(per_pair: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    if top_k == 1:
        return per_pair
    return per_pair.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(per_pair.dtype)


def _check_contiguous(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the layer's parameter), got strides {t.stride()}")


def _other_configs(cfg: dict[str, Any], dtype: torch.dtype) -> list[dict[str, Any]]:
    """Inside the start-up's compile pass: the other batch sizes' configs, to queue their variants."""
    if not _COMPILE_ONLY.get():
        return []
    return [c for c in (_for_dtype(c, dtype) for _, c in CONFIGS) if c != cfg]


def fused_experts_fp8(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_map: torch.Tensor | None = None, config: dict[str, Any] | None = None) -> torch.Tensor:
    """The ``fused_experts_fp8`` op: ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` float8_e4m3fn, ``w13_scale
    [E, 2I]``, ``w2_scale [E, H]`` float32; the rest as ``fused_experts``. ``config`` overrides
    :func:`~.fused_moe.get_config`."""
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if num_tokens == 0:
        return hidden_states.new_empty(0, hidden)
    _check_contiguous(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)
    dtype, device = hidden_states.dtype, hidden_states.device
    cfg = config or get_config(num_tokens, num_experts, inter, hidden, top_k, dtype)
    if config is None:
        for other in _other_configs(cfg, dtype):
            fused_experts_fp8(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map, other)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg["BLOCK_M"], num_experts, expert_map)
    pairs = num_tokens * top_k
    weights = topk_weights.to(torch.float32).contiguous()
    x_q, x_scale = quantize_fp8_rows(hidden_states)
    act = torch.empty(pairs, inter, dtype=dtype, device=device)
    invoke_fused_moe_kernel(x_q, w13, act, weights, sorted_ids, expert_ids, num_post, top_k=top_k, a_per_token=True,
                            gated=True, mul_routed_weight=False, config=cfg, a_scale=x_scale, b_scale=w13_scale,
                            w_kind=W_FP8)
    # NOTE: rows of other ranks' experts hold garbage here; their scales are never read
    act_q, act_scale = quantize_fp8_rows(act)
    per_pair = (torch.zeros if expert_map is not None else torch.empty)(pairs, hidden, dtype=dtype, device=device)
    invoke_fused_moe_kernel(act_q, w2, per_pair, weights, sorted_ids, expert_ids, num_post, top_k=top_k,
                            a_per_token=False, gated=False, mul_routed_weight=True, config=cfg, a_scale=act_scale,
                            b_scale=w2_scale, w_kind=W_FP8)
    return _combine(per_pair, num_tokens, top_k)


def _int_block_k(block_k: int, k: int, group: int) -> int:
    """The largest power of two ``<= block_k`` dividing both ``K`` and the group (>= 16, tl.dot's least)."""
    b = block_k
    while b > 16 and (group % b or k % b):
        b //= 2
    if group % b or k % b:
        raise ValueError(f"fused_experts_wna16: K={k} and group size {group} need a common power-of-two divisor "
                         ">= 16 (the kernel's K block)")
    return b


def fused_experts_wna16(hidden_states: torch.Tensor, w13_qweight: torch.Tensor, w2_qweight: torch.Tensor,
                        w13_scales: torch.Tensor, w2_scales: torch.Tensor, w13_zeros: torch.Tensor | None,
                        w2_zeros: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        expert_map: torch.Tensor | None, bits: int, group_size: int,
                        config: dict[str, Any] | None = None) -> torch.Tensor:
    """The ``fused_experts_wna16`` op: packed-integer experts (module docstring; ``group_size``
    -1: one group over K), the rest as ``fused_experts``."""
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13_qweight.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if num_tokens == 0:
        return hidden_states.new_empty(0, hidden)
    if bits not in (4, 8):
        raise ValueError(f"fused_experts_wna16: bits={bits}; supported: 4, 8")
    _check_contiguous(w13_qweight=w13_qweight, w2_qweight=w2_qweight, w13_scales=w13_scales, w2_scales=w2_scales,
                      w13_zeros=w13_zeros, w2_zeros=w2_zeros)
    if hidden_states.stride(1) != 1:
        hidden_states = hidden_states.contiguous()
    dtype, device = hidden_states.dtype, hidden_states.device
    cfg = config or get_config(num_tokens, num_experts, inter, hidden, top_k, dtype)
    if config is None:
        for other in _other_configs(cfg, dtype):
            fused_experts_wna16(hidden_states, w13_qweight, w2_qweight, w13_scales, w2_scales, w13_zeros, w2_zeros,
                                topk_weights, topk_ids, expert_map, bits, group_size, other)
    g13 = hidden if group_size == -1 else group_size
    g2 = inter if group_size == -1 else group_size
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg["BLOCK_M"], num_experts, expert_map)
    pairs = num_tokens * top_k
    weights = topk_weights.to(torch.float32).contiguous()
    act = torch.empty(pairs, inter, dtype=dtype, device=device)
    invoke_fused_moe_kernel(hidden_states, w13_qweight, act, weights, sorted_ids, expert_ids, num_post, top_k=top_k,
                            a_per_token=True, gated=True, mul_routed_weight=False,
                            config={**cfg, "BLOCK_K": _int_block_k(cfg["BLOCK_K"], hidden, g13)},
                            b_scale=w13_scales, b_zero=w13_zeros, w_kind=W_INT, bits=bits, group_k=g13)
    per_pair = (torch.zeros if expert_map is not None else torch.empty)(pairs, hidden, dtype=dtype, device=device)
    invoke_fused_moe_kernel(act, w2_qweight, per_pair, weights, sorted_ids, expert_ids, num_post, top_k=top_k,
                            a_per_token=False, gated=False, mul_routed_weight=True,
                            config={**cfg, "BLOCK_K": _int_block_k(cfg["BLOCK_K"], inter, g2)},
                            b_scale=w2_scales, b_zero=w2_zeros, w_kind=W_INT, bits=bits, group_k=g2)
    return _combine(per_pair, num_tokens, top_k)
