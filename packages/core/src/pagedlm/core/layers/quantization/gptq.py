"""GPTQ checkpoints (AutoGPTQ / GPTQModel exports), read as stored on disk.

Per linear layer: ``qweight [K // pack, N] int32`` (packed along the input), ``qzeros
[K // G, N // pack] int32`` (packed along the output; the ``gptq`` checkpoint format stores
``zero - 1``, ``gptq_v2`` the zero itself), ``scales [K // G, N]`` (float16) and ``g_idx [K]``,
the group of each input row (``desc_act: true`` orders rows by activation size, so groups are
scattered). ``qweight`` is already the ``wna16_gemm`` layout.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedlm.core.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase, shard_names
from pagedlm.core.layers.quantization.compressed_tensors import _g_idx_init
from pagedlm.core.layers.quantization.schemes import WNA16LinearMethod, new_param, same_for_every_shard
from pagedlm.core.layers.quantization.utils import unpack_cols, unpack_rows

__all__ = ["GPTQConfig", "GPTQLinearMethod"]

SUPPORTED_BITS = (4, 8)
#: the fields a ``dynamic`` entry may override (GPTQModel's per-module overrides)
DYNAMIC_FIELDS = ("bits", "group_size", "desc_act", "sym")
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GPTQLinearMethod(WNA16LinearMethod):
    def __init__(self, config: GPTQConfig) -> None:
        super().__init__(bits=config.weight_bits, group_size=config.group_size, symmetric=config.sym,
                         act_order=config.desc_act)
        self.zero_offset = 1 if config.checkpoint_format == "gptq" else 0

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        groups, sharded = self._groups(layer, k, input_size)
        pack = self.pack_factor
        if n % pack:
            raise ValueError(f"{layer.prefix}: {n} output features per rank are not a multiple of {pack} "
                             "(GPTQ zero points are packed along the output)")
        group_in = 0 if sharded else None
        new_param(layer, "qweight", (k // pack, n), torch.int32, input_dim=0, output_dim=1, packed_dim=0,
                  packed_factor=pack, **extra_weight_attrs)
        new_param(layer, "qzeros", (groups, n // pack), torch.int32, input_dim=group_in, output_dim=1, packed_dim=1,
                  packed_factor=pack, **extra_weight_attrs)
        new_param(layer, "scales", (groups, n), params_dtype, input_dim=group_in, output_dim=1, **extra_weight_attrs)
        group = self.group_size if self.group_size != -1 else input_size
        g_idx = new_param(layer, "g_idx", (k,), torch.int32, input_dim=0, dummy_init=_g_idx_init(group),
                          **extra_weight_attrs)
        if self.act_order:
            same_for_every_shard(g_idx, f"{layer.prefix}.g_idx")

    def _unpack_checkpoint(self, layer: nn.Module):
        n, k = layer.scales.shape[1], layer.input_size_per_partition
        q = unpack_rows(layer.qweight.data, self.bits, k)
        zeros = None
        if not self.symmetric:
            zeros = (unpack_cols(layer.qzeros.data, self.bits, n) + self.zero_offset) & ((1 << self.bits) - 1)
        g_idx = layer.g_idx.data if self.act_order else None
        return q, layer.scales.data, zeros, g_idx, ["qweight", "qzeros", "scales", "g_idx"]


class GPTQConfig(QuantizationConfig):
    """The ``gptq`` method: ``bits`` 4 or 8, ``group_size`` -1/32/64/128, ``desc_act``, ``sym``;
    ``lm_head: true`` quantizes the LM head too; ``dynamic`` (GPTQModel's per-module overrides):
    ``{"+:REGEX": {"bits": 8, ...}, "-:REGEX": {}}``, the first pattern that ``re.match``-es a
    checkpoint module name decides: ``-:`` leaves the module unquantized, any other overrides
    the fields it gives (vLLM's rule)."""

    def __init__(self, weight_bits: int, group_size: int, desc_act: bool, sym: bool,
                 checkpoint_format: str = "gptq", lm_head_quantized: bool = False,
                 dynamic: dict[str, dict[str, Any]] | None = None) -> None:
        if weight_bits not in SUPPORTED_BITS:
            raise ValueError(f"GPTQ bits={weight_bits} is not supported; supported: {list(SUPPORTED_BITS)}")
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"GPTQ group_size={group_size} is not supported; supported: {list(SUPPORTED_GROUP_SIZES)}")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format={checkpoint_format!r} is not supported; supported: "
                             f"{', '.join(CHECKPOINT_FORMATS)}")
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format
        self.lm_head_quantized = lm_head_quantized
        self.dynamic = [_dynamic_rule(pattern, fields) for pattern, fields in (dynamic or {}).items()]

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        return cls(
            weight_bits=int(cls.get_from_keys(config, ["bits", "w_bit"])),
            group_size=int(cls.get_from_keys(config, ["group_size"])),
            desc_act=bool(cls.get_from_keys_or(config, ["desc_act"], False)),
            sym=bool(cls.get_from_keys_or(config, ["sym"], True)),
            checkpoint_format=str(cls.get_from_keys_or(config, ["checkpoint_format"], "gptq") or "gptq"),
            lm_head_quantized=bool(cls.get_from_keys_or(config, ["lm_head"], False)),
            dynamic=config.get("dynamic") or None,
        )

    @classmethod
    def get_dummy_config(cls) -> dict[str, Any]:
        return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not self.dynamic:
            return GPTQLinearMethod(self)
        decided = {name: self._dynamic_override(name) for name in shard_names(prefix, self.packed_modules_mapping)}
        override = next(iter(decided.values()))
        if any(d != override for d in decided.values()):
            raise ValueError(f"gptq dynamic: the modules fused into {prefix} get different overrides ({decided}); "
                             "pagedlm needs one scheme per fused layer")
        if override is None:
            return None
        if not override:
            return GPTQLinearMethod(self)
        fields = {"bits": self.weight_bits, "group_size": self.group_size, "desc_act": self.desc_act,
                  "sym": self.sym, **override}
        return GPTQLinearMethod(GPTQConfig(int(fields["bits"]), int(fields["group_size"]), bool(fields["desc_act"]),
                                           bool(fields["sym"]), self.checkpoint_format))

    def _dynamic_override(self, name: str) -> dict[str, Any] | None:
        """The fields ``dynamic`` overrides for module ``name`` ({} when none), or None to skip it."""
        for skip, regex, fields in self.dynamic:
            if regex.match(name):
                return None if skip else fields
        return {}

    def describe(self) -> str:
        head = ", lm_head quantized" if self.lm_head_quantized else ""
        return f"gptq (int{self.weight_bits}, group {self.group_size}, desc_act={self.desc_act}{head})"


def _dynamic_rule(pattern: str, fields: Any) -> tuple[bool, re.Pattern[str], dict[str, Any]]:
    """``(skip, regex, overridden fields)`` of one ``dynamic`` entry; ``ValueError`` naming a bad one."""
    skip = pattern.startswith("-:")
    body = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
    try:
        regex = re.compile(body)
    except re.error as e:
        raise ValueError(f"gptq dynamic pattern {pattern!r} is not a regular expression: {e}") from None
    unknown = sorted(set(fields or {}) - set(DYNAMIC_FIELDS)) if isinstance(fields, dict) else None
    if unknown is None or unknown:
        raise ValueError(f"gptq dynamic[{pattern!r}]={fields!r}: supported overrides are a dict of "
                         f"{', '.join(DYNAMIC_FIELDS)}")
    if fields.get("bits", SUPPORTED_BITS[0]) not in SUPPORTED_BITS:
        raise ValueError(f"gptq dynamic[{pattern!r}]: bits={fields['bits']} is not supported; supported: "
                         f"{list(SUPPORTED_BITS)}")
    if fields.get("group_size", SUPPORTED_GROUP_SIZES[0]) not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"gptq dynamic[{pattern!r}]: group_size={fields['group_size']} is not supported; "
                         f"supported: {list(SUPPORTED_GROUP_SIZES)}")
    return skip, regex, dict(fields)
