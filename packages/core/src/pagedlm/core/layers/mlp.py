"""The gated MLP of Llama-family blocks, and the checkpoint layout their fused weights load from."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.core.layers.activation import SiluAndMul, get_act_and_mul_fn
from pagedlm.core.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    maybe_prefix,
    takes_fp8_activations,
)
from pagedlm.core.layers.quantization.base_config import QuantizationConfig
from pagedlm.core.layers.quantization.utils import QuantizedActivation

#: model dtypes whose layers may pass FP8-quantized activations from producer to linear layer
#: (float32 models, the HF-parity configuration, keep the unfused path)
FP8_FUSION_DTYPES = (torch.bfloat16, torch.float16)

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
    column-parallel matmul (``gate_up_proj``), down row-parallel (``down_proj``).

    ``x`` may be a :class:`QuantizedActivation` where ``gate_up_proj`` takes one
    (:func:`takes_fp8_activations`). When ``down_proj`` takes one too, the activation is SiLU and
    the model is bf16/fp16, SiLU-and-mul quantizes its output for it in the same pass (decided at
    the first forward, once LoRA has wrapped whichever layers it adapts).
    """

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
        self._fuse_down_quant: bool | None = None

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if self._fuse_down_quant is None:
            self._fuse_down_quant = (x.dtype in FP8_FUSION_DTYPES and isinstance(self.act_fn, SiluAndMul)
                                     and takes_fp8_activations(self.down_proj))
        gate_up = self.gate_up_proj(x)
        if self._fuse_down_quant:
            return self.down_proj(self.act_fn(gate_up, quant_fp8=True))
        return self.down_proj(self.act_fn(gate_up))
