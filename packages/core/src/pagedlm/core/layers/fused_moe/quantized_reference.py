"""Core's torch implementations of the quantized ``fused_experts`` ops (the references the
platforms' kernels are checked against): FP8 experts with per-token FP8 activations, and
packed-integer (W4A16 / W8A16) experts.

Both dequantize only the experts the batch routes to (this rank's, with at least one pair), then
run the grouped matmuls of :mod:`.reference` - no Python loop over tokens or experts. The CPU
runs these; their cost is a dequantized copy of the experts in use.

Weight layouts (this rank's experts, ``N`` output and ``K`` input features of one projection):

- FP8: ``w [E, N, K] float8_e4m3fn`` with ``scale [E, N] float32`` (per output channel; per-tensor
  and per-shard checkpoint scales are expanded to it), ``W = w * scale``;
- packed integers (compressed-tensors' ``pack-quantized`` layout, stacked): ``qweight [E, N, K //
  pack] int32``, ``pack = 32 // bits``, element ``(n, k)`` the unsigned ``bits``-wide field at bit
  ``bits * (k % pack)`` of word ``qweight[e, n, k // pack]``; ``scales [E, N, K // G]`` in the
  activation dtype; ``zeros [E, N, K // G] int32`` unsigned, or None (symmetric: ``2 ** (bits -
  1)``); ``W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]``, ``G = K`` when ``group_size`` is -1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlm.core.layers.fused_moe.reference import (
    _check_shapes,
    combine_pairs,
    expert_groups,
    fused_experts,
    grouped_linear,
)
from pagedlm.core.layers.quantization.utils import quantize_fp8_per_token, unpack_cols

__all__ = ["dequantize_packed_experts", "fused_experts_fp8", "fused_experts_wna16"]


def _used_experts(counts: torch.Tensor) -> torch.Tensor:
    """Local ids of the experts with at least one pair (ascending; a host sync, CPU reference only)."""
    return torch.nonzero(counts > 0).reshape(-1)


def fused_experts_fp8(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The ``fused_experts_fp8`` op (contract: layers.custom_ops): ``w13 [E, 2I, H]`` and ``w2 [E, H,
    I]`` float8_e4m3fn, ``w13_scale [E, 2I]``, ``w2_scale [E, H]`` float32; the rest as ``fused_experts``.

    Each GEMM's input is quantized to FP8 per row (``amax / 448``: per token for gate/up, per pair
    for down); the products of the FP8 values accumulate in float32, times both scales, rounded to
    the dtype."""
    _check_shapes(hidden_states, w13, w2, topk_weights, topk_ids)
    dtype, inter = hidden_states.dtype, w13.shape[1] // 2
    rows, counts, _ = expert_groups(topk_ids, expert_map, w13.shape[0])
    used = _used_experts(counts)
    used_counts = counts[used]
    ends = torch.cumsum(used_counts, 0).to(torch.int32)
    w13_f = w13[used].float() * w13_scale[used].float().unsqueeze(-1)
    w2_f = w2[used].float() * w2_scale[used].float().unsqueeze(-1)
    x_q, x_scale = quantize_fp8_per_token(hidden_states)
    x = (x_q.float() * x_scale).index_select(0, rows // topk_ids.shape[1])
    gate_up = grouped_linear(x, w13_f, used_counts, ends).to(dtype)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    act_q, act_scale = quantize_fp8_per_token(act)
    down = grouped_linear(act_q.float() * act_scale, w2_f, used_counts, ends).to(dtype)
    return combine_pairs(down, rows, topk_weights)


def dequantize_packed_experts(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                              group_size: int) -> torch.Tensor:
    """``[E, N, K]`` in ``scales``' dtype from the packed-integer expert layout (module docstring)."""
    num_experts, n, words = qweight.shape
    k = words * (32 // bits)
    q = unpack_cols(qweight.reshape(num_experts * n, words), bits).reshape(num_experts, n, k)
    g = k if group_size == -1 else group_size
    z = zeros.repeat_interleave(g, dim=-1) if zeros is not None else 1 << (bits - 1)
    return (q - z).to(scales.dtype) * scales.repeat_interleave(g, dim=-1)


def fused_experts_wna16(hidden_states: torch.Tensor, w13_qweight: torch.Tensor, w2_qweight: torch.Tensor,
                        w13_scales: torch.Tensor, w2_scales: torch.Tensor, w13_zeros: torch.Tensor | None,
                        w2_zeros: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        expert_map: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """The ``fused_experts_wna16`` op (contract: layers.custom_ops): the experts' weights in the
    packed-integer layout (module docstring), dequantized to the dtype, then ``fused_experts``."""
    num_local = w13_qweight.shape[0]
    _, counts, _ = expert_groups(topk_ids, expert_map, num_local)
    used = _used_experts(counts)
    w13 = dequantize_packed_experts(w13_qweight[used], w13_scales[used],
                                    None if w13_zeros is None else w13_zeros[used], bits, group_size)
    w2 = dequantize_packed_experts(w2_qweight[used], w2_scales[used],
                                   None if w2_zeros is None else w2_zeros[used], bits, group_size)
    # global id -> index among the used experts (-1: unused here, or another rank's expert)
    position = torch.full((num_local,), -1, dtype=torch.int32, device=used.device)
    position[used] = torch.arange(used.numel(), dtype=torch.int32, device=used.device)
    if expert_map is not None:
        local = expert_map.to(position.device).long()
        position = torch.where(local >= 0, position[local.clamp(min=0)], -1).to(torch.int32)
    dtype = hidden_states.dtype
    return fused_experts(hidden_states, w13.to(dtype), w2.to(dtype), topk_weights, topk_ids, position)
