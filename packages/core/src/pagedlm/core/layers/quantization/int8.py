"""The ``int8`` method: online int8 weight-only quantization (W8A16) of a full-precision checkpoint.

``quantization="int8"`` on a float32/bf16/fp16 checkpoint quantizes each linear weight as its
tensor loads: symmetric, one scale per output channel, ``amax / 127.5`` of the channel's whole
input row (so every tensor-parallel rank quantizes a row alike, whichever part of it the rank
holds), values rounded half to even and clamped to [-128, 127]: compressed-tensors' W8A16 int8
scheme (its minmax observer), so the result is what llm-compressor would have written. The
layer's weight is int8 from the start, so peak memory stays near the int8 size. Activations stay
in the model's dtype: the forward is the ``int8_weight_only_gemm`` op (the CPU backend's
``torch._weight_int8pack_mm``; core's torch reference dequantizes). Embeddings, the LM head and
``ignored_layers`` stay in full precision, as with the other methods.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedlm.core.layers.quantization.base_config import QuantizationConfig
from pagedlm.core.layers.quantization.schemes import W8A8LinearMethod, online_quantized_weight
from pagedlm.core.layers.quantization.utils import INT8_SCALE_DIVISOR

__all__ = ["Int8Config", "Int8OnlineLinearMethod", "quantize_int8_per_channel"]


def quantize_int8_per_channel(weight: torch.Tensor, row_amax: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (int8 ``[N, K]``, float32 scales ``[N]``): ``q = round(w / s)`` with
    ``s = amax / 127.5`` per row; ``row_amax`` (``[N]``) replaces the rows' own maxima."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if row_amax is None else row_amax.float()
    scale = amax.clamp(min=1e-12) / INT8_SCALE_DIVISOR
    q = torch.round(w / scale.unsqueeze(1)).clamp(-128, 127).to(torch.int8)
    return q, scale


class Int8OnlineLinearMethod(W8A8LinearMethod):
    """Quantizes full-precision checkpoint tensors to int8 per output channel while they load."""

    def __init__(self) -> None:
        super().__init__(kind="int8", per_channel=True, static_input=False, act_quant=False)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        def quantize(src: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # NOTE: a row-parallel rank holds part of every row (its input slice): the maxima come
            # from the whole checkpoint rows, so the ranks' scales agree; elsewhere src has whole rows.
            row_amax = full.float().abs().amax(dim=1).to(src.device) if src.shape[1] != full.shape[1] else None
            return quantize_int8_per_channel(src, row_amax)

        online_quantized_weight(layer, sum(output_partition_sizes), input_size_per_partition, torch.int8, quantize,
                                **extra_weight_attrs)


class Int8Config(QuantizationConfig):
    def __init__(self, ignored_layers: list[str] | None = None) -> None:
        self.ignored_layers = list(ignored_layers or [])

    @classmethod
    def get_name(cls) -> str:
        return "int8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int8Config:
        method = str(config.get("quant_method", "int8")).lower()
        if method != "int8":
            raise ValueError(f"int8 reads no checkpoint format (quant_method={method!r}); it quantizes a "
                             "float32/bf16/fp16 checkpoint online: pass quantization='int8' on one")
        return cls(ignored_layers=config.get("ignored_layers") or config.get("modules_to_not_convert"))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any:
        if any(name in prefix for name in self.ignored_layers):
            return None
        from pagedlm.core.layers.fused_moe.layer import FusedMoE

        if isinstance(layer, FusedMoE):
            raise ValueError(f"{prefix}: quantization='int8' covers linear layers, not mixture-of-experts "
                             "experts; supported for experts: fp8 (online), compressed-tensors")
        return Int8OnlineLinearMethod()

    def describe(self) -> str:
        return "int8 (online, per-channel weight-only)"
