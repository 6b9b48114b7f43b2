"""Gated activations over a merged ``[gate | up]`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.core.layers.custom_ops import bound_op


class SiluAndMul(nn.Module):
    """``x [..., 2I] -> silu(x[..., :I]) * x[..., I:]``, shape ``[..., I]``."""

    def __init__(self) -> None:
        super().__init__()
        # the platform's kernel, if it registered one (layers.custom_ops); bound once, at build
        self._silu_and_mul_op = bound_op("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._silu_and_mul_op is not None:
            return self._silu_and_mul_op(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


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
