"""Quantization methods for ``FusedMoE`` experts (vLLM's ``Fp8MoEMethod``,
``CompressedTensorsW8A8Fp8MoEMethod``, ``CompressedTensorsWNA16MoEMethod``).

A config's ``get_quant_method`` returns one of these for a ``FusedMoE`` layer. Each registers the
stacked per-expert parameters under vLLM's names (checkpoint ``experts.3.gate_proj.weight_scale``
-> ``experts.w13_weight_scale``, through ``FusedMoE.make_expert_params_mapping``), tagged for
``FusedMoE.weight_loader`` (TP slices along the intermediate dimension, scales and zero points
too; expert parallelism loads only this rank's experts), and runs a quantized ``fused_experts`` op
(contracts in :mod:`pagedlm.core.layers.custom_ops`, references in
:mod:`pagedlm.core.layers.fused_moe.quantized_reference`).

- :class:`Fp8MoEMethod`: float8_e4m3fn experts, activations quantized to FP8 per token. Online
  (``quantization="fp8"`` on a full-precision checkpoint): every expert tensor is quantized as it
  loads with its own scale ``amax / 448`` (gate and up keep one each, so nothing is requantized);
  or from an FP8 checkpoint (``fp8`` method, compressed-tensors ``float-quantized``) with
  per-tensor or per-channel scales.
- :class:`CompressedTensorsWNA16MoEMethod`: compressed-tensors ``pack-quantized`` int4 / int8
  experts (group-wise or per channel, symmetric or asymmetric), kept in their packed layout.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedlm.core.layers import custom_ops
from pagedlm.core.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase
from pagedlm.core.layers.fused_moe.quantized_reference import fused_experts_fp8, fused_experts_wna16
from pagedlm.core.layers.quantization.schemes import dummy_positive, new_param, replace_params
from pagedlm.core.layers.quantization.utils import FP8_DTYPE, FP8_MAX, unpack_cols

__all__ = ["CompressedTensorsWNA16MoEMethod", "Fp8MoEMethod"]


def _dummy_fp8_scale(param: torch.Tensor, gen: torch.Generator) -> None:
    # dummy FP8 weights are U(-1e-3, 1e-3) cast to float8: a scale of 1 keeps them that size
    param.data.fill_(1.0)


def _zeros_init(param: torch.Tensor, gen: torch.Generator) -> None:
    param.data.zero_()


class Fp8MoEMethod(FusedMoEMethodBase):
    """FP8 experts (module docstring). After loading the layer holds ``w13_weight [E, 2n, H]``,
    ``w2_weight [E, H, n]`` (float8_e4m3fn), ``w13_weight_scale [E, 2n]`` and ``w2_weight_scale
    [E, H]`` (float32, per output channel) - the ``fused_experts_fp8`` layout."""

    def __init__(self, *, online: bool, per_channel: bool = False) -> None:
        self.online = online
        self.per_channel = per_channel and not online
        self.op = custom_ops.bound_op("fused_experts_fp8") or fused_experts_fp8

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any) -> None:
        loader = extra["weight_loader"]
        e, h, n = num_experts, hidden_size, intermediate_size_per_partition
        w13 = new_param(layer, "w13_weight", (e, 2 * n, h), FP8_DTYPE, weight_loader=loader)
        w2 = new_param(layer, "w2_weight", (e, h, n), FP8_DTYPE, weight_loader=loader)
        if self.per_channel:
            new_param(layer, "w13_weight_scale", (e, 2 * n, 1), torch.float32, weight_loader=loader,
                      dummy_init=_dummy_fp8_scale)
            new_param(layer, "w2_weight_scale", (e, h, 1), torch.float32, weight_loader=loader, moe_w2_sliced=False,
                      dummy_init=_dummy_fp8_scale)
            return
        # one scale per checkpoint tensor: gate's and up's (w13), down's (w2)
        s13 = new_param(layer, "w13_weight_scale", (e, 2), torch.float32, weight_loader=loader,
                        moe_layout="per_shard", dummy_init=_dummy_fp8_scale, optional_in_checkpoint=self.online)
        s2 = new_param(layer, "w2_weight_scale", (e,), torch.float32, weight_loader=loader, moe_layout="per_shard",
                       dummy_init=_dummy_fp8_scale, optional_in_checkpoint=self.online)
        if self.online:
            s13.data.fill_(1.0)
            s2.data.fill_(1.0)
            w13.load_expert_shard = _quantizing_loader(s13)  # type: ignore[attr-defined]
            w2.load_expert_shard = _quantizing_loader(s2)  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        e, h, n = layer.w2_weight.shape[0], layer.hidden_size, layer.intermediate_size_per_partition
        s13, s2 = layer.w13_weight_scale.data.float(), layer.w2_weight_scale.data.float()
        if self.per_channel:
            s13, s2 = s13.reshape(e, 2 * n), s2.reshape(e, h)
        else:
            s13, s2 = s13.repeat_interleave(n, dim=1), s2.unsqueeze(1).expand(e, h)
        replace_params(layer, ["w13_weight_scale", "w2_weight_scale"],
                       {"w13_weight_scale": s13, "w2_weight_scale": s2})

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return self.op(x, layer.w13_weight, layer.w2_weight, layer.w13_weight_scale, layer.w2_weight_scale,
                       topk_weights, topk_ids, layer.expert_map)


def _quantizing_loader(scale: torch.Tensor):
    """``load_expert_shard`` of online FP8: quantize this rank's slice with the scale of the whole
    checkpoint tensor (``amax / 448``: every tensor-parallel rank quantizes alike) and keep the scale."""

    def load(dst: torch.Tensor, src: torch.Tensor, full: Any, local: int, shard_id: str) -> None:
        whole = full if isinstance(full, torch.Tensor) else full.materialize()
        s = (whole.float().abs().amax().clamp(min=1e-12) / FP8_MAX).to(scale.device)
        dst.copy_((src.to(dst.device).float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
        if shard_id == "w2":
            scale.data[local] = s
        else:
            scale.data[local, 0 if shard_id == "w1" else 1] = s

    return load


class CompressedTensorsWNA16MoEMethod(FusedMoEMethodBase):
    """compressed-tensors ``pack-quantized`` experts (module docstring). After loading the layer
    holds ``w13_weight_packed [E, 2n, H / p]``, ``w2_weight_packed [E, H, n / p]`` (int32),
    ``w13_weight_scale [E, 2n, H / G]``, ``w2_weight_scale [E, H, n / G]`` (model dtype) and
    ``w13_zeros`` / ``w2_zeros`` (unpacked ``[E, N, K / G]`` int32, None when symmetric) - the
    ``fused_experts_wna16`` layout."""

    def __init__(self, *, bits: int, group_size: int, symmetric: bool) -> None:
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit integer experts are not supported; supported: 4, 8")
        self.bits = bits
        self.pack_factor = 32 // bits
        self.group_size = group_size
        self.symmetric = symmetric
        self.op = custom_ops.bound_op("fused_experts_wna16") or fused_experts_wna16

    def _check(self, layer: FusedMoE, hidden: int, inter: int) -> None:
        p, g = self.pack_factor, self.group_size
        for what, k in (("hidden size", hidden), ("intermediate size per rank", inter)):
            if k % p or (g != -1 and k % g):
                raise ValueError(
                    f"{layer.prefix}: the experts' {what} is {k}; it must be a multiple of {p} ({self.bits}-bit "
                    f"values per int32)" + ("" if g == -1 else f" and of group_size={g}") + "; use a tensor-parallel "
                    "size that keeps whole groups, or enable_expert_parallel=True")

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any) -> None:
        loader = extra["weight_loader"]
        e, h, n, p = num_experts, hidden_size, intermediate_size_per_partition, self.pack_factor
        self._check(layer, h, n)
        g13, g2 = (1, 1) if self.group_size == -1 else (h // self.group_size, n // self.group_size)
        per_channel = self.group_size == -1
        new_param(layer, "w13_weight_packed", (e, 2 * n, h // p), torch.int32, weight_loader=loader)
        new_param(layer, "w2_weight_packed", (e, h, n // p), torch.int32, weight_loader=loader)
        new_param(layer, "w13_weight_scale", (e, 2 * n, g13), params_dtype, weight_loader=loader,
                  dummy_init=dummy_positive)
        new_param(layer, "w2_weight_scale", (e, h, g2), params_dtype, weight_loader=loader,
                  moe_w2_sliced=not per_channel, dummy_init=dummy_positive)
        for name in ("w13_weight_shape", "w2_weight_shape"):  # read and dropped: the layer knows its shapes
            new_param(layer, name, (e, 2), torch.int64, weight_loader=loader, moe_layout="whole",
                      optional_in_checkpoint=True, dummy_init=_zeros_init)
        if not self.symmetric:
            # packed along the output dimension: gate's and up's rows of this rank in whole words
            if n % p or h % p:
                raise ValueError(f"{layer.prefix}: asymmetric {self.bits}-bit experts need output sizes that are "
                                 f"multiples of {p} (zero points packed along the output), got {n} and {h}")
            new_param(layer, "w13_weight_zero_point", (e, 2 * n // p, g13), torch.int32, weight_loader=loader)
            new_param(layer, "w2_weight_zero_point", (e, h // p, g2), torch.int32, weight_loader=loader,
                      moe_w2_sliced=not per_channel)

    def _unpack_zeros(self, packed: torch.Tensor) -> torch.Tensor:
        """``[E, N / p, G] int32`` packed along N -> ``[E, N, G]`` unsigned."""
        e, words, groups = packed.shape
        flat = packed.transpose(1, 2).reshape(e * groups, words)
        return unpack_cols(flat, self.bits).reshape(e, groups, -1).transpose(1, 2).contiguous()

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        zeros: dict[str, torch.Tensor | None] = {"w13_zeros": None, "w2_zeros": None}
        if not self.symmetric:
            zeros = {"w13_zeros": self._unpack_zeros(layer.w13_weight_zero_point.data),
                     "w2_zeros": self._unpack_zeros(layer.w2_weight_zero_point.data)}
        replace_params(layer, ["w13_weight_shape", "w2_weight_shape", "w13_weight_zero_point",
                               "w2_weight_zero_point"], zeros)

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return self.op(x, layer.w13_weight_packed, layer.w2_weight_packed, layer.w13_weight_scale,
                       layer.w2_weight_scale, layer.w13_zeros, layer.w2_zeros, topk_weights, topk_ids,
                       layer.expert_map, self.bits, self.group_size)
