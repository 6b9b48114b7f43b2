"""What a quantization method is: a ``QuantizationConfig`` (parsed from a checkpoint's
``quantization_config`` or named by ``quantization=``) that hands each layer a ``QuantizeMethodBase``.

The names and the life cycle are vLLM's:

1. ``QuantizationConfig.from_config(hf_quant_config: dict)`` parses ``config.json``'s
   ``quantization_config`` (or ``{}`` for a method named by the user on an unquantized checkpoint).
2. While the model is built, every linear layer calls ``get_quant_method(layer, prefix)`` with its
   module path (``"model.layers.0.self_attn.qkv_proj"``); None (or an
   :class:`UnquantizedLinearMethod`) leaves the layer in full precision (an ignore list, the LM head).
3. The method's ``create_weights(layer, ...)`` registers the layer's parameters as they are stored on
   disk (packed int32 words, scales, zero points, ...), each tagged for the layer's weight loader
   (see :mod:`pagedlm.core.layers.linear`: ``output_dim``, ``input_dim``, ``packed_dim``,
   ``packed_factor``, ``shard_scalar``) so tensor-parallel ranks read only their slice.
4. After the checkpoint is loaded, ``process_weights_after_loading(layer)`` converts them (one layer
   at a time) to the layout the method's kernel reads.
5. ``apply(layer, x, bias)`` computes the layer's output through a registered op
   (:mod:`pagedlm.core.layers.custom_ops`) or core's torch reference.
"""

from __future__ import annotations

import fnmatch
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.core.layers import custom_ops

__all__ = [
    "LinearMethodBase",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "UnquantizedLinearMethod",
    "matches_module_name",
    "shard_names",
]


class QuantizeMethodBase(ABC):
    """Creates a layer's quantized parameters and computes its forward."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, *weight_args: Any, **extra_weight_attrs: Any) -> None:
        """Register the layer's parameters (as stored on disk) on ``layer``."""

    @abstractmethod
    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer's forward."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded parameters to the kernel's layout (once, after loading)."""
        return

    #: whether the layer's weights are quantized (the loader counts quantized layers)
    quantized: bool = True


class LinearMethodBase(QuantizeMethodBase):
    """A method for linear layers (``LinearBase`` subclasses)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        """Register the parameters of this rank's shard.

        Args:
            input_size_per_partition: this rank's input features (``K_r``)
            output_partition_sizes: this rank's output features of each logical shard stacked in the
                layer (``[q_r, kv_r, kv_r]`` for qkv, ``[I_r, I_r]`` for gate/up, ``[N_r]`` otherwise)
            input_size, output_size: the full (unsharded) sizes
            params_dtype: the model's dtype (activations, scales)
            extra_weight_attrs: ``weight_loader`` (the layer's), set on every parameter
        """

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, K_r] -> [T, N_r]`` in ``x``'s dtype (``bias`` added when given)."""


class UnquantizedLinearMethod(LinearMethodBase):
    """Full precision: ``weight [N_r, K_r]`` in the model dtype; the platform's ``unquantized_gemm``
    op when the model is built with one (a decode-shaped GEMV kernel), else ``F.linear``."""

    quantized = False

    def __init__(self) -> None:
        # NOTE: bound once, here: the layer makes its method in its constructor, inside the
        # runner's custom_ops.use_ops block, so a forward makes no registry lookup.
        self.op = custom_ops.bound_op("unquantized_gemm")

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        set_param_attrs(weight, {"output_dim": 0, "input_dim": 1, **extra_weight_attrs})
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.op is None:
            return F.linear(x, layer.weight, bias)
        if x.dim() == 2:
            return self.op(x, layer.weight, bias)
        # the op takes [T, K]: flatten the leading dimensions and restore them
        shape = x.shape
        out = self.op(x.reshape(-1, shape[-1]), layer.weight, bias)
        return out.reshape(*shape[:-1], out.shape[-1])


def set_param_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Tag a parameter for the layer's weight loader (``weight_loader`` may be replaced)."""
    for key, value in attrs.items():
        setattr(param, key, value)


class QuantizationConfig(ABC):
    """One quantization method's configuration (vLLM's interface).

    Subclasses are registered by name through the ``pagedlm_register_quantization_methods`` hook and
    built with :meth:`from_config` from the checkpoint's ``quantization_config`` dict.
    """

    #: False for a method whose unclaimed layers are still correct (GGUF: dequantized at load); the
    #: loader then does not require a model class to hand ``quant_config`` to its linear layers
    requires_quantized_layers: bool = True

    #: True for a method that also gives token embeddings / LM heads a method (GGUF); the others are
    #: never asked for those layers (their get_quant_method assumes linear layers)
    quantizes_embeddings: bool = False

    #: True when the checkpoint quantizes the LM head like its linear layers (GPTQ's and AWQ's
    #: ``lm_head: true``, a compressed-tensors group that targets ``lm_head``): the head then gets
    #: this method's linear method, sharded over the vocabulary (vLLM's ``lm_head_quantized``)
    lm_head_quantized: bool = False

    #: fused parameter -> the checkpoint modules stacked in it (an ignore list names the latter)
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The method's registered name (``quant_method`` in config.json)."""

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        """The lowest GPU compute capability (major * 10 + minor) the method's kernels run on."""
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        """Files beside config.json that may hold the config (``quantize_config.json`` for GPTQ)."""
        return []

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Parse a checkpoint's ``quantization_config``; raise ``ValueError`` naming what is not supported."""

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None) -> str | None:
        """Claim a checkpoint whose ``quant_method`` names another method (None: no claim)."""
        return None

    @classmethod
    def get_dummy_config(cls) -> dict[str, Any]:
        """The ``quantization_config`` to assume for ``load_format="dummy"`` when the checkpoint has
        none (benchmarks of published shapes with random weights of this method's layout)."""
        return {}

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method of the layer at module path ``prefix``; None leaves it unquantized."""

    def get_cache_scale(self, name: str) -> str | None:
        """The attention-layer name of a checkpoint's KV-cache scale tensor, or None."""
        return None

    def describe(self) -> str:
        return self.get_name()

    @staticmethod
    def get_from_keys(config: dict[str, Any], keys: Iterable[str]) -> Any:
        for key in keys:
            if key in config:
                return config[key]
        raise ValueError(f"quantization_config has none of the keys {list(keys)}")

    @staticmethod
    def get_from_keys_or(config: dict[str, Any], keys: Iterable[str], default: Any) -> Any:
        for key in keys:
            if key in config:
                return config[key]
        return default


def shard_names(prefix: str, mapping: dict[str, list[str]]) -> list[str]:
    """The checkpoint module names a layer's ``prefix`` stands for: ``...qkv_proj`` ->
    ``[...q_proj, ...k_proj, ...v_proj]``; an unfused layer is itself."""
    head, _, last = prefix.rpartition(".")
    parts = mapping.get(last)
    if not parts:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def matches_module_name(name: str, pattern: str) -> bool:
    """Whether an ignore/target entry names module ``name``: ``"re:REGEX"`` (``re.match``, as
    compressed-tensors does), a glob, an exact name, or a suffix of the name at a dot boundary."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)
