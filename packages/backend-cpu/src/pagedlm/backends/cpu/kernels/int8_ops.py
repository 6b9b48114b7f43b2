"""The CPU platform's ``int8_weight_only_gemm``: torch's int8 weight-only matmul.

``torch._weight_int8pack_mm(x, weight, scales)`` multiplies ``x [T, K]`` (float32/bf16/fp16) by the
int8 ``weight [N, K]`` in one vectorised kernel (per-channel scales applied to the sums), without
a float copy of the weight. It is used where it is known to be safe: ``K % 32 == 0`` (a bf16
``x`` with ``K = 33`` crashed torch 2.13's kernel) and at least one row; other shapes take core's
reference (dequantize, then ``F.linear``).
"""

from __future__ import annotations

import torch

from pagedlm.core.layers.quantization.utils import int8_weight_only_gemm_ref

__all__ = ["int8_weight_only_gemm"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def int8_weight_only_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """See the op's contract in ``pagedlm.core.layers.custom_ops``."""
    if (x.dtype not in _DTYPES or x.dim() != 2 or x.shape[0] == 0 or x.shape[1] % 32
            or weight.dtype != torch.int8 or not weight.is_contiguous()):
        return int8_weight_only_gemm_ref(x, weight, weight_scale, bias)
    out = torch._weight_int8pack_mm(x.contiguous(), weight, weight_scale.to(x.dtype))
    return out if bias is None else out + bias.to(out.dtype)
