"""The CPU platform's ``int8_weight_only_gemm``: torch's int8 weight-only matmul.

``torch._weight_int8pack_mm(x, weight, scales)`` multiplies ``x [T, K]`` (bf16/fp16/float32) by
the int8 ``weight [N, K]`` in one kernel (per-channel scales applied to the sums), without a
dequantized copy of the weight. Measured on the 2-core AVX-512/AMX box of docs/benchmarks.md
(2026-12-02, Qwen3-0.6B's shapes, one row): bf16 0.17-0.27 ms against 0.46-0.59 ms for bf16
``F.linear`` of the dense weight; float32 runs a slow path in torch 2.13 (1.5 ms, 3.5x float32
``F.linear``), still faster end to end than core's reference (dequantize, then ``F.linear``:
Qwen3-0.6B decode 404 against 292 ms a token). Kept to ``K % 32 == 0`` (a bf16 ``x`` with
``K = 33`` crashed the kernel) and at least one row; other inputs take the reference.
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
