"""RMSNorm (Llama's and Gemma's) with an optional fused residual add.

:func:`rms_norm_reference` and :func:`gemma_rms_norm_reference` are the arithmetic the layers run
when the platform registered no op (``rms_norm`` / ``gemma_rms_norm``): HF's op sequence, which a
platform's kernel must reproduce rounding for rounding. :class:`RMSNorm` can also hand the next
FP8 linear layer its input quantized per token (``quant_fp8=True``; ops ``rms_norm_fp8_quant`` /
``fused_add_rms_norm_fp8_quant``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.core.layers.custom_ops import bound_op
from pagedlm.core.layers.quantization.utils import QuantizedActivation, quantize_fp8_per_token
from pagedlm.core.model_loader.weight_utils import (
    default_weight_loader,
    set_weight_attrs,
)

__all__ = [
    "GemmaRMSNorm",
    "RMSNorm",
    "fused_add_rms_norm_fp8_quant_reference",
    "gemma_rms_norm_reference",
    "rms_norm_fp8_quant_reference",
    "rms_norm_reference",
]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, cast back to x's dtype, multiply by the weight."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def rms_norm_fp8_quant_reference(x: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rms_norm_fp8_quant`` op in torch: ``x [T, N]`` -> ``(x_q [T, N] float8_e4m3fn, scale
    [T, 1] float32)``, :func:`rms_norm_reference` then ``quantize_fp8_per_token``."""
    return quantize_fp8_per_token(rms_norm_reference(x, weight, eps))


def fused_add_rms_norm_fp8_quant_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``fused_add_rms_norm_fp8_quant`` op in torch: ``(x_q, scale, s)`` with ``s = x + residual``
    in x's dtype and ``(x_q, scale)`` :func:`rms_norm_fp8_quant_reference` of ``s``."""
    summed = x + residual
    return (*rms_norm_fp8_quant_reference(summed, weight, eps), summed)


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Gemma3RMSNorm: normalise and scale by ``1 + weight`` in float32, then cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * (1.0 + weight.float())
    return h.to(x.dtype)


class RMSNorm(nn.Module):
    """``y = weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension.

    ``forward(x [..., hidden])`` returns the normed ``[..., hidden]``.
    ``forward(x, residual)`` first forms ``s = x + residual`` and returns ``(norm(s), s)``, so a
    decoder layer can hand the running residual stream to the next norm without a separate add.

    With ``quant_fp8=True`` (``x [T, hidden]``) the normed output comes back as a
    :class:`QuantizedActivation` instead, quantized per token to FP8 (in the same pass where the
    platform registered ``rms_norm_fp8_quant`` / ``fused_add_rms_norm_fp8_quant``): exactly the
    bytes an FP8 linear layer would make of the tensor.

    NOTE: the arithmetic follows HF's LlamaRMSNorm step by step (normalise in float32, cast back
    to the input dtype, then multiply by the weight in that dtype); reordering it changes bf16
    results by an ulp and breaks greedy-token parity with transformers.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})
        # the platform's kernels, if it registered them (layers.custom_ops); bound once, at build
        self._rms_norm_op = bound_op("rms_norm")
        self._fused_add_rms_norm_op = bound_op("fused_add_rms_norm")
        self._rms_norm_quant_op = bound_op("rms_norm_fp8_quant")
        self._fused_add_rms_norm_quant_op = bound_op("fused_add_rms_norm_fp8_quant")

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.variance_epsilon)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, quant_fp8: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | QuantizedActivation | tuple[QuantizedActivation,
                                                                                         torch.Tensor]:
        if quant_fp8:
            return self._forward_fp8(x, residual)
        if residual is None:
            if self._rms_norm_op is not None:
                return self._rms_norm_op(x, self.weight, self.variance_epsilon)
            return self._norm(x)
        if self._fused_add_rms_norm_op is not None:
            return self._fused_add_rms_norm_op(x, residual, self.weight, self.variance_epsilon)
        # HF adds the residual in the model dtype before normalising; do the same.
        summed = x + residual
        return self._norm(summed), summed

    def _forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
        eps = self.variance_epsilon
        if residual is None:
            if self._rms_norm_quant_op is not None:
                x_q, scale = self._rms_norm_quant_op(x, self.weight, eps)
            else:
                # NOTE: the unfused op's output quantized (the platform's op, if it registered one):
                # the bytes the fused op's contract defines
                x_q, scale = quantize_fp8_per_token(self.forward(x))
            return QuantizedActivation(x_q, scale, x.dtype)
        if self._fused_add_rms_norm_quant_op is not None:
            x_q, scale, summed = self._fused_add_rms_norm_quant_op(x, residual, self.weight, eps)
        else:
            normed, summed = self.forward(x, residual)
            x_q, scale = quantize_fp8_per_token(normed)
        return QuantizedActivation(x_q, scale, x.dtype), summed

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class GemmaRMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * (1 + weight)`` over the last dimension (Gemma's norm).

    ``forward(x [..., D]) -> [..., D]`` in ``x``'s dtype; ``forward(x, residual)`` forms ``s = x +
    residual`` in x's dtype first and returns ``(norm(s), s)``, as :class:`RMSNorm` does. Unlike
    Llama's, the scaling by the weight also happens in float32 and only the result is cast back
    (HF's Gemma3RMSNorm does the same; bf16 results differ by an ulp otherwise). The stored weight
    is zero-centred: 0 means identity.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})
        self._norm_op = bound_op("gemma_rms_norm")
        self._fused_add_norm_op = bound_op("gemma_fused_add_rms_norm")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            if self._norm_op is not None:
                return self._norm_op(x, self.weight, self.eps)
            return gemma_rms_norm_reference(x, self.weight, self.eps)
        if self._fused_add_norm_op is not None:
            return self._fused_add_norm_op(x, residual, self.weight, self.eps)
        summed = x + residual
        return gemma_rms_norm_reference(summed, self.weight, self.eps), summed

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
