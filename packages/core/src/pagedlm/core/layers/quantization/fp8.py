"""The ``fp8`` method: FP8 checkpoints (``quant_method: fp8``) and online FP8 quantization.

- A checkpoint saved in FP8 (``is_checkpoint_fp8_serialized``) stores float8_e4m3 ``weight [N, K]``
  with a per-tensor ``weight_scale`` per stacked tensor and, for ``activation_scheme: static``,
  an ``input_scale``.
- A block-wise FP8 checkpoint (``weight_block_size: [block_n, block_k]``: DeepSeek-V3, Qwen3-FP8)
  stores ``weight_scale_inv [N / block_n, K / block_k]`` instead, with dynamic activations
  quantized per token and group of ``block_k`` (:class:`Fp8BlockLinearMethod`).
- ``FusedMoE`` experts get :class:`~pagedlm.core.layers.quantization.moe_methods.Fp8MoEMethod`
  (online, or per-tensor scales from the checkpoint; dynamic activations only).
- ``quantization="fp8"`` on a bf16/fp16/fp32 checkpoint quantizes each weight as it loads: the
  layer's parameter is float8 from the start; each checkpoint tensor gets a per-tensor scale
  ``amax / 448`` (taken over the whole checkpoint tensor, so every tensor-parallel rank quantizes
  alike) kept per output row, so peak memory stays near the FP8 size. Activations are quantized
  dynamically per token.

Dynamic per-token activations may arrive already quantized by the norm or SiLU-and-mul that
produced them (``W8A8LinearMethod.accepts_fp8_activations``; ``PreNormDecoderLayer``), bit for bit
what the layer would have made of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedlm.core.layers.quantization.base_config import QuantizationConfig
from pagedlm.core.layers.quantization.schemes import (
    Fp8BlockLinearMethod,
    W8A8LinearMethod,
    block_size_of,
    online_quantized_weight,
)
from pagedlm.core.layers.quantization.utils import FP8_DTYPE, FP8_MAX

__all__ = ["Fp8Config", "Fp8OnlineLinearMethod"]

ACTIVATION_SCHEMES = ("static", "dynamic")


class Fp8OnlineLinearMethod(W8A8LinearMethod):
    """Quantizes full-precision checkpoint tensors to FP8 while they load (module docstring)."""

    def __init__(self) -> None:
        super().__init__(kind="fp8", per_channel=True, static_input=False)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        def quantize(src: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            s = full.float().abs().amax().clamp(min=1e-12) / FP8_MAX
            return (src.float() / s.to(src.device)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s

        online_quantized_weight(layer, sum(output_partition_sizes), input_size_per_partition, FP8_DTYPE, quantize,
                                **extra_weight_attrs)


class Fp8Config(QuantizationConfig):
    def __init__(self, is_checkpoint_fp8_serialized: bool = False, activation_scheme: str = "dynamic",
                 ignored_layers: list[str] | None = None, weight_block_size: list[int] | None = None) -> None:
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation_scheme={activation_scheme!r} is not supported; supported: "
                             f"{', '.join(ACTIVATION_SCHEMES)}")
        if not is_checkpoint_fp8_serialized and activation_scheme == "static":
            raise ValueError("fp8 with activation_scheme='static' needs an FP8 checkpoint (its input scales)")
        self.weight_block_size = None
        if weight_block_size is not None:
            self.weight_block_size = block_size_of(weight_block_size, "fp8 weight_block_size")
            if not is_checkpoint_fp8_serialized:
                raise ValueError("fp8 weight_block_size needs an FP8 checkpoint; online quantization="
                                 "'fp8' makes per-tensor scales")
            if activation_scheme != "dynamic":
                raise ValueError("fp8 block-wise weights with activation_scheme='static' are not supported; "
                                 "supported: dynamic (per token and group of block_k)")
        self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers or [])

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    @classmethod
    def get_min_capability(cls) -> int:
        return 89

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        serialized = "fp8" in str(config.get("quant_method", ""))
        return cls(is_checkpoint_fp8_serialized=serialized,
                   activation_scheme=str(config.get("activation_scheme", "dynamic")),
                   ignored_layers=config.get("ignored_layers") or config.get("modules_to_not_convert"),
                   weight_block_size=config.get("weight_block_size"))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any:
        if any(name in prefix for name in self.ignored_layers):
            return None
        from pagedlm.core.layers.fused_moe.layer import FusedMoE

        if isinstance(layer, FusedMoE):
            return self._moe_method(prefix)
        if not self.is_checkpoint_fp8_serialized:
            return Fp8OnlineLinearMethod()
        if self.weight_block_size is not None:
            block_n, block_k = self.weight_block_size
            return Fp8BlockLinearMethod(block_n=block_n, block_k=block_k, scale_name="weight_scale_inv")
        return W8A8LinearMethod(kind="fp8", per_channel=False, static_input=self.activation_scheme == "static")

    def _moe_method(self, prefix: str) -> Any:
        from pagedlm.core.layers.quantization.moe_methods import Fp8MoEMethod

        if self.weight_block_size is not None:
            raise ValueError(f"{prefix}: block-wise FP8 experts (weight_block_size={list(self.weight_block_size)}) are "
                             "not supported; supported for experts: per-tensor FP8 scales (or online quantization)")
        if self.activation_scheme == "static":
            raise ValueError(f"{prefix}: FP8 experts with activation_scheme='static' are not supported; supported "
                             "for experts: dynamic per-token activation scales (or online quantization)")
        return Fp8MoEMethod(online=not self.is_checkpoint_fp8_serialized)

    def describe(self) -> str:
        how = "checkpoint" if self.is_checkpoint_fp8_serialized else "online"
        blocks = f", blocks {list(self.weight_block_size)}" if self.weight_block_size else ""
        return f"fp8 ({how}{blocks}, {self.activation_scheme} activations)"
