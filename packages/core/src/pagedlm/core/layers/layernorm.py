"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.core.layers.custom_ops import bound_op
from pagedlm.core.model_loader.weight_utils import (
    default_weight_loader,
    set_weight_attrs,
)


class RMSNorm(nn.Module):
    """``y = weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension.

    ``forward(x [..., hidden])`` returns the normed ``[..., hidden]``.
    ``forward(x, residual)`` first forms ``s = x + residual`` and returns ``(norm(s), s)``, so a
    decoder layer can hand the running residual stream to the next norm without a separate add.

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

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            if self._rms_norm_op is not None:
                return self._rms_norm_op(x, self.weight, self.variance_epsilon)
            return self._norm(x)
        if self._fused_add_rms_norm_op is not None:
            return self._fused_add_rms_norm_op(x, residual, self.weight, self.variance_epsilon)
        # HF adds the residual in the model dtype before normalising; do the same.
        summed = x + residual
        return self._norm(summed), summed

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
