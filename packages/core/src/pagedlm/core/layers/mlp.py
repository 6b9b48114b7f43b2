"""The gated MLP of Llama-family blocks, and the checkpoint layout their fused weights load from."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.core.layers.activation import get_act_and_mul_fn
from pagedlm.core.layers.linear import MergedColumnParallelLinear, RowParallelLinear, maybe_prefix
from pagedlm.core.layers.quantization.base_config import QuantizationConfig

#: ``(fused parameter, checkpoint name, shard id)`` of HF checkpoints with separate q/k/v and
#: gate/up projections: what ``QKVParallelLinear`` and :class:`GatedMLP` load from
QKV_GATE_UP_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class GatedMLP(nn.Module):
    """``x [T, hidden] -> down(act(gate(x)) * up(x)) [T, hidden]``, gate and up as one
    column-parallel matmul (``gate_up_proj``), down row-parallel (``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, prefix: str,
                 bias: bool = False, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, prefix=maybe_prefix(prefix, "gate_up_proj"),
            quant_config=quant_config,
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           prefix=maybe_prefix(prefix, "down_proj"), quant_config=quant_config)
        self.act_fn = get_act_and_mul_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
