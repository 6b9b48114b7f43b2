"""AWQ checkpoints in AutoAWQ's GEMM layout, read as stored on disk.

Per linear layer: ``qweight [K, N // 8] int32`` and ``qzeros [K // G, N // 8] int32``, both packed
along the output with the eight nibbles of a word in AWQ's order (field ``i`` holds column
``AWQ_PACK_ORDER[i]`` of its group of eight), and ``scales [K // G, N]`` (float16). Zero points are
stored as they are (no offset). Converted to the ``wna16_gemm`` layout after loading.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedlm.core.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from pagedlm.core.layers.quantization.schemes import WNA16LinearMethod, new_param
from pagedlm.core.layers.quantization.utils import AWQ_PACK_ORDER, unpack_cols

__all__ = ["AWQConfig", "AWQLinearMethod"]

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
SUPPORTED_VERSIONS = ("gemm",)


class AWQLinearMethod(WNA16LinearMethod):
    def __init__(self, config: AWQConfig) -> None:
        super().__init__(bits=4, group_size=config.group_size, symmetric=False)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        groups, sharded = self._groups(layer, k, input_size)
        if n % 8:
            raise ValueError(f"{layer.prefix}: {n} output features per rank are not a multiple of 8 (AWQ packs "
                             "eight 4-bit values per int32 along the output)")
        group_in = 0 if sharded else None
        new_param(layer, "qweight", (k, n // 8), torch.int32, input_dim=0, output_dim=1, packed_dim=1,
                  packed_factor=8, **extra_weight_attrs)
        new_param(layer, "qzeros", (groups, n // 8), torch.int32, input_dim=group_in, output_dim=1, packed_dim=1,
                  packed_factor=8, **extra_weight_attrs)
        new_param(layer, "scales", (groups, n), params_dtype, input_dim=group_in, output_dim=1, **extra_weight_attrs)

    def _unpack_checkpoint(self, layer: nn.Module):
        n = layer.scales.shape[1]
        q = unpack_cols(layer.qweight.data, 4, n, order=AWQ_PACK_ORDER)
        zeros = unpack_cols(layer.qzeros.data, 4, n, order=AWQ_PACK_ORDER)
        return q, layer.scales.data, zeros, None, ["qweight", "qzeros", "scales"]


class AWQConfig(QuantizationConfig):
    """The ``awq`` method: 4-bit weights with zero points, GEMM layout, ``modules_to_not_convert``;
    ``lm_head: true`` quantizes the LM head too."""

    def __init__(self, weight_bits: int, group_size: int, zero_point: bool, version: str = "gemm",
                 modules_to_not_convert: list[str] | None = None, lm_head_quantized: bool = False) -> None:
        if weight_bits != 4:
            raise ValueError(f"AWQ w_bit={weight_bits} is not supported; supported: [4]")
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"AWQ group_size={group_size} is not supported; supported: {list(SUPPORTED_GROUP_SIZES)}")
        if str(version).lower() not in SUPPORTED_VERSIONS:
            raise ValueError(f"AWQ version={version!r} (layout) is not supported; supported: "
                             f"{', '.join(SUPPORTED_VERSIONS)}")
        if not zero_point:
            raise ValueError("AWQ zero_point=false is not supported; supported: AutoAWQ's GEMM checkpoints with "
                             "zero points")
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.lm_head_quantized = lm_head_quantized

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quant_config.json", "quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        return cls(
            weight_bits=int(cls.get_from_keys(config, ["w_bit", "bits"])),
            group_size=int(cls.get_from_keys(config, ["q_group_size", "group_size"])),
            zero_point=bool(cls.get_from_keys_or(config, ["zero_point"], True)),
            version=str(cls.get_from_keys_or(config, ["version"], "gemm")),
            modules_to_not_convert=cls.get_from_keys_or(config, ["modules_to_not_convert"], None),
            lm_head_quantized=bool(cls.get_from_keys_or(config, ["lm_head"], False)),
        )

    @classmethod
    def get_dummy_config(cls) -> dict[str, Any]:
        return {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True, "version": "gemm"}

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # vLLM's rule: a module is skipped when any listed name is a substring of its path
        if any(name in prefix for name in self.modules_to_not_convert):
            return None
        return AWQLinearMethod(self)

    def describe(self) -> str:
        return f"awq (int4, group {self.group_size})"
