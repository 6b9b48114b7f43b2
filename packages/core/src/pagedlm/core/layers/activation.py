"""Gated activations over a merged ``[gate | up]`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.core.layers.custom_ops import bound_op
from pagedlm.core.layers.quantization.utils import QuantizedActivation, quantize_fp8_per_token

__all__ = ["GeluAndMul", "SiluAndMul", "get_act_and_mul_fn", "silu_and_mul_fp8_quant_reference",
           "silu_and_mul_reference"]


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I] -> silu(x[..., :I]) * x[..., I:]`` in torch (F.silu rounds to x's dtype first)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul_fp8_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``silu_and_mul_fp8_quant`` op in torch: ``x [T, 2I]`` -> ``(x_q [T, I] float8_e4m3fn,
    scale [T, 1] float32)``, :func:`silu_and_mul_reference` then ``quantize_fp8_per_token``."""
    return quantize_fp8_per_token(silu_and_mul_reference(x))


class SiluAndMul(nn.Module):
    """``x [..., 2I] -> silu(x[..., :I]) * x[..., I:]``, shape ``[..., I]``.

    With ``quant_fp8=True`` (``x [T, 2I]``) the result comes back as a :class:`QuantizedActivation`,
    quantized per token to FP8 (in the same pass where the platform registered
    ``silu_and_mul_fp8_quant``): exactly the bytes an FP8 linear layer would make of the tensor.
    """

    def __init__(self) -> None:
        super().__init__()
        # the platform's kernels, if it registered them (layers.custom_ops); bound once, at build
        self._silu_and_mul_op = bound_op("silu_and_mul")
        self._silu_and_mul_quant_op = bound_op("silu_and_mul_fp8_quant")

    def forward(self, x: torch.Tensor, *, quant_fp8: bool = False) -> torch.Tensor | QuantizedActivation:
        if quant_fp8:
            if self._silu_and_mul_quant_op is not None:
                return QuantizedActivation(*self._silu_and_mul_quant_op(x), x.dtype)
            # NOTE: the unfused op's output quantized (the platform's op, if it registered one):
            # the bytes the fused op's contract defines
            return QuantizedActivation(*quantize_fp8_per_token(self.forward(x)), x.dtype)
        if self._silu_and_mul_op is not None:
            return self._silu_and_mul_op(x)
        return silu_and_mul_reference(x)


class GeluAndMul(nn.Module):
    """``x [..., 2I] -> gelu(x[..., :I]) * x[..., I:]``; ``approximate`` is ``"none"`` or ``"tanh"``."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


def get_act_and_mul_fn(hidden_act: str) -> nn.Module:
    """The gated activation for an HF ``hidden_act`` name; ``ValueError`` for others."""
    name = hidden_act.lower()
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name == "gelu":
        return GeluAndMul("none")
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return GeluAndMul("tanh")
    raise ValueError(f"hidden_act={hidden_act!r} is not supported; supported: silu, gelu, gelu_pytorch_tanh")
