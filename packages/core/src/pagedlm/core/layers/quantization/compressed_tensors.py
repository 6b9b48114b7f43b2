"""compressed-tensors checkpoints (what llm-compressor writes), read as stored on disk.

``config.json``'s ``quantization_config`` holds ``config_groups`` (each: ``targets``, ``weights``,
``input_activations``, optionally its own ``format``), a global ``format`` and an ``ignore`` list.
Supported, per group:

- ``pack-quantized``: int4 / int8 weights packed 32 // bits to an int32 along the input
  (``weight_packed [N, K // pack]``), ``weight_scale [N, K // G]`` (or ``[N, 1]`` per channel),
  asymmetric ``weight_zero_point [N // pack, K // G]`` packed along the output, optional
  ``weight_g_idx [K]`` (``actorder: group``): W4A16 / W8A16, group-wise or per channel.
- ``float-quantized``: float8_e4m3 ``weight [N, K]`` with a per-channel or per-tensor scale and
  FP8 activations, dynamic per token or a static per-tensor ``input_scale`` (W8A8 FP8), or none.
- ``float-quantized`` with the ``block`` strategy (the ``FP8_BLOCK`` preset): ``weight [N, K]``
  with ``weight_scale [N / bn, K / bk]`` for ``block_structure [bn, bk]`` and dynamic FP8
  activations per token and group of ``bk`` (:class:`~.schemes.Fp8BlockLinearMethod`).
- ``int-quantized`` / ``naive-quantized``: int8 ``weight [N, K]``, per-channel or per-tensor scale,
  int8 activations dynamic per token or static per tensor (W8A8 INT8), or none (W8A16).

A ``pack-quantized`` group whose targets name ``Embedding`` (or the embedding module) keeps the
token embedding table packed too (:class:`CompressedTensorsEmbeddingMethod`; compressed-tensors
compresses ``nn.Embedding`` modules like linear ones). vLLM loads no such file; here the table
stays at 4 / 8 bits and a lookup dequantizes only the rows it reads.

``FusedMoE`` experts (``experts.N.gate_proj`` / Mixtral's ``experts.N.w1`` ...) take the scheme of
their group: ``pack-quantized`` (no act-order) or ``float-quantized`` FP8 with dynamic per-token
activations (:mod:`.moe_methods`); other schemes for experts are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedlm.core.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
    matches_module_name,
    shard_names,
)
from pagedlm.core.layers.quantization.schemes import (
    Fp8BlockLinearMethod,
    W8A8LinearMethod,
    WNA16LinearMethod,
    block_size_of,
    dummy_positive,
    new_param,
    same_for_every_shard,
)
from pagedlm.core.layers.quantization.utils import unpack_cols, unpack_rows

__all__ = ["CompressedTensorsConfig", "CompressedTensorsEmbeddingMethod", "CompressedTensorsWNA16"]

FORMATS = ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("block", "channel", "group", "tensor")


class CompressedTensorsWNA16(WNA16LinearMethod):
    """``pack-quantized`` integer weights (W4A16 / W8A16), converted to the ``wna16_gemm`` layout."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        groups, sharded = self._groups(layer, k, input_size)
        pack = self.pack_factor
        new_param(layer, "weight_packed", (n, k // pack), torch.int32, output_dim=0, input_dim=1, packed_dim=1,
                  packed_factor=pack, **extra_weight_attrs)
        scale_in = 1 if sharded else None
        new_param(layer, "weight_scale", (n, groups), params_dtype, output_dim=0, input_dim=scale_in,
                  **extra_weight_attrs)
        new_param(layer, "weight_shape", (2,), torch.int64, dummy_init=_shape_init(output_size, input_size),
                  **extra_weight_attrs)
        if not self.symmetric:
            if n % pack:
                raise ValueError(f"{layer.prefix}: {n} output features per rank are not a multiple of {pack} "
                                 "(zero points are packed along the output)")
            new_param(layer, "weight_zero_point", (n // pack, groups), torch.int32, output_dim=0, input_dim=scale_in,
                      packed_dim=0, packed_factor=pack, **extra_weight_attrs)
        if self.act_order:
            g_idx = new_param(layer, "weight_g_idx", (k,), torch.int32, input_dim=0,
                              dummy_init=_g_idx_init(self.group_size), **extra_weight_attrs)
            same_for_every_shard(g_idx, f"{layer.prefix}.weight_g_idx")

    def _unpack_checkpoint(self, layer: nn.Module):
        n, k = layer.weight_packed.shape[0], layer.input_size_per_partition
        q = unpack_cols(layer.weight_packed.data, self.bits, k).t()  # [K_r, N_r] unsigned
        scales = layer.weight_scale.data.t()
        zeros = None
        if not self.symmetric:
            zeros = unpack_rows(layer.weight_zero_point.data, self.bits, n).t()
        g_idx = layer.weight_g_idx.data if self.act_order else None
        return q, scales, zeros, g_idx, ["weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                                         "weight_g_idx"]


class CompressedTensorsW8A16Int(WNA16LinearMethod):
    """``naive-quantized`` / ``int-quantized`` int8 weights with no activation quantization."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        groups, sharded = self._groups(layer, k, input_size)
        new_param(layer, "weight", (n, k), torch.int8, output_dim=0, input_dim=1, **extra_weight_attrs)
        new_param(layer, "weight_scale", (n, groups), params_dtype, output_dim=0, input_dim=1 if sharded else None,
                  **extra_weight_attrs)

    def _unpack_checkpoint(self, layer: nn.Module):
        q = (layer.weight.data.to(torch.int32) + 128).t()
        return q, layer.weight_scale.data.t(), None, None, ["weight", "weight_scale"]


class CompressedTensorsEmbeddingMethod(QuantizeMethodBase):
    """A ``pack-quantized`` token embedding, looked up in its packed layout: ``weight_packed [V_r,
    dim // pack]`` int32 (packed along the hidden dimension), ``weight_scale [V_r, dim // G]``
    and, asymmetric, ``weight_zero_point`` (packed along the vocabulary on disk, unpacked at load
    to ``[V_r, dim // G]``); the rows of this rank's vocabulary range. A lookup dequantizes only
    the rows it reads: ``(q - z) * scale`` with ``z = 2**(bits - 1)`` when symmetric."""

    #: the packed table has no logits path, so a tied LM head cannot share it
    computes_logits = False

    def __init__(self, *, bits: int, group_size: int, symmetric: bool) -> None:
        self.bits = bits
        self.pack_factor = 32 // bits
        self.group_size = group_size
        self.symmetric = symmetric

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,  # type: ignore[override]
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        group = embedding_dim if self.group_size == -1 else self.group_size
        if embedding_dim % self.pack_factor or embedding_dim % group:
            raise ValueError(f"{layer.prefix}: embedding size {embedding_dim} is not a multiple of the packed word "
                             f"({self.pack_factor} values) and of group_size {group}")
        groups = embedding_dim // group
        rows = layer.weight_loader  # this rank's vocabulary rows of a [V, ...] checkpoint tensor
        new_param(layer, "weight_packed", (num_embeddings, embedding_dim // self.pack_factor), torch.int32,
                  weight_loader=rows)
        new_param(layer, "weight_scale", (num_embeddings, groups), params_dtype, weight_loader=rows,
                  dummy_init=dummy_positive)
        shape = (layer.num_embeddings, embedding_dim)
        new_param(layer, "weight_shape", (2,), torch.int64, weight_loader=_shape_loader(layer.prefix, shape),
                  dummy_init=_shape_init(*shape))
        if not self.symmetric:
            new_param(layer, "weight_zero_point", (num_embeddings, groups), torch.int32,
                      weight_loader=self._zero_point_loader(layer), dummy_init=_int_range_init(self.bits))

    def _zero_point_loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            layer.weight_loader(param, unpack_rows(loaded.to(torch.int32), self.bits, layer.num_embeddings))
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        del layer._parameters["weight_shape"]  # checked by its loader; nothing reads it after

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [...]`` (this rank's rows) ``-> [..., embedding_dim]`` in the layer's dtype."""
        flat = input_ids.reshape(-1)
        scales = layer.weight_scale.index_select(0, flat)  # [T, groups]
        q = unpack_cols(layer.weight_packed.index_select(0, flat), self.bits)  # [T, dim] unsigned
        q = q.view(flat.shape[0], scales.shape[1], -1)
        zero = (layer.weight_zero_point.index_select(0, flat).unsqueeze(-1) if not self.symmetric
                else 1 << (self.bits - 1))
        rows = (q - zero).to(scales.dtype) * scales.unsqueeze(-1)
        return rows.reshape(*input_ids.shape, -1).to(layer.params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise TypeError(f"{layer.prefix}: a packed embedding table computes no logits (computes_logits)")


def _shape_loader(prefix: str, shape: tuple[int, int]):
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if tuple(int(v) for v in loaded.reshape(-1).tolist()) != shape:
            raise ValueError(f"{prefix}: checkpoint weight_shape {loaded.tolist()}, the model's table is {list(shape)}")
        param.data.copy_(loaded)
    return load


def _int_range_init(bits: int):
    def init(param: torch.Tensor, gen: torch.Generator) -> None:
        param.data.copy_(torch.randint(0, 1 << bits, param.shape, generator=gen, device=param.device,
                                       dtype=torch.int32))
    return init


def _shape_init(out: int, inp: int):
    def init(param: torch.Tensor, gen: torch.Generator) -> None:
        param.data.copy_(torch.tensor([out, inp]))
    return init


def _g_idx_init(group_size: int):
    def init(param: torch.Tensor, gen: torch.Generator) -> None:
        param.data.copy_(torch.arange(param.shape[0], device=param.device) // group_size)
    return init


class CompressedTensorsConfig(QuantizationConfig):
    """The ``compressed-tensors`` method (module docstring)."""

    def __init__(self, config_groups: dict[str, dict[str, Any]], ignore: list[str], global_format: str | None,
                 kv_cache_scheme: dict[str, Any] | None = None) -> None:
        self.config_groups = config_groups
        self.ignore = list(ignore)
        self.global_format = global_format
        self.kv_cache_scheme = kv_cache_scheme
        #: set when a model's embedding takes a packed method (describe() reports it)
        self.embedding_quantized = False
        for name, group in config_groups.items():
            self._check_group(name, group)
        # NOTE: a group targeting "Linear" covers the head too unless the ignore list holds it
        # (llm-compressor's presets do); then the head is quantized like the other layers
        self.lm_head_quantized = self._group_of("lm_head") is not None
        # NOTE: compressed-tensors quantizes the nn.Embedding modules its targets name (the class
        # name "Embedding", or a module-name pattern), as it does linear layers
        self.quantizes_embeddings = any(t != "Linear" for g in config_groups.values() for t in g.get("targets") or [])

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        groups = config.get("config_groups")
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups; a checkpoint written by "
                             "llm-compressor / compressed-tensors has them")
        if config.get("sparsity_config"):
            raise ValueError("compressed-tensors sparsity (sparsity_config) is not supported; supported formats: "
                             f"{', '.join(FORMATS)}")
        return cls(dict(groups), list(config.get("ignore") or []), config.get("format"),
                   config.get("kv_cache_scheme"))

    @classmethod
    def get_dummy_config(cls) -> dict[str, Any]:
        """W4A16: symmetric int4 weights in groups of 128 (what llm-compressor's W4A16 preset writes)."""
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}

    # -- parsing and checking --------------------------------------------------------------------
    def _format(self, group: dict[str, Any]) -> str:
        return str(group.get("format") or self.global_format or "dense")

    def _check_group(self, name: str, group: dict[str, Any]) -> None:
        fmt = self._format(group)
        if fmt not in FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} (config_groups.{name}) is not supported; "
                             f"supported: {', '.join(FORMATS)}")
        weights = group.get("weights") or {}
        bits, kind = weights.get("num_bits"), weights.get("type", "int")
        strategy = weights.get("strategy")
        if strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} (config_groups.{name}) is not "
                             f"supported; supported: {', '.join(WEIGHT_STRATEGIES)}")
        if fmt == "pack-quantized":
            if kind != "int" or bits not in (4, 8):
                raise ValueError(f"compressed-tensors pack-quantized {kind}{bits} weights (config_groups.{name}) are "
                                 "not supported; supported: int4, int8")
            if strategy == "group" and not weights.get("group_size"):
                raise ValueError(f"config_groups.{name}: strategy 'group' needs a group_size")
            if strategy == "tensor":
                raise ValueError(f"config_groups.{name}: pack-quantized per-tensor weights are not supported; "
                                 "supported strategies: channel, group")
            if group.get("input_activations"):
                raise ValueError(f"config_groups.{name}: activation quantization with packed int weights is not "
                                 "supported; supported: W4A16, W8A16")
            return
        if strategy == "block":
            self._check_block_group(name, fmt, weights, group.get("input_activations"))
            return
        if bits != 8 or kind not in ("float", "int") or (fmt == "float-quantized") != (kind == "float"):
            raise ValueError(f"compressed-tensors {fmt} {kind}{bits} weights (config_groups.{name}) are not supported; "
                             "supported: float8 (float-quantized), int8 (int-quantized, naive-quantized)")
        if strategy == "group":
            raise ValueError(f"config_groups.{name}: group-wise 8-bit {kind} weights are not supported; supported "
                             "strategies: channel, tensor")
        if not weights.get("symmetric", True):
            raise ValueError(f"config_groups.{name}: asymmetric 8-bit weights are not supported (symmetric only)")
        acts = group.get("input_activations")
        if acts:
            if acts.get("num_bits") != 8 or acts.get("type", "int") != kind:
                raise ValueError(f"config_groups.{name}: {acts.get('type')}{acts.get('num_bits')} activations with "
                                 f"{kind}8 weights are not supported; supported: {kind}8")
            if not acts.get("symmetric", True):
                raise ValueError(f"config_groups.{name}: asymmetric activations are not supported (symmetric only)")
            dynamic, act_strategy = acts.get("dynamic"), acts.get("strategy")
            if not ((dynamic and act_strategy == "token") or (not dynamic and act_strategy == "tensor")):
                raise ValueError(f"config_groups.{name}: {'dynamic' if dynamic else 'static'} {act_strategy} "
                                 "activation scales are not supported; supported: dynamic per token, static per tensor")

    @staticmethod
    def _check_block_group(name: str, fmt: str, weights: dict[str, Any], acts: dict[str, Any] | None) -> None:
        if fmt != "float-quantized" or weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"config_groups.{name}: block-wise {fmt} {weights.get('type')}{weights.get('num_bits')} "
                             "weights are not supported; supported: float8 (float-quantized)")
        block = block_size_of(weights.get("block_structure"), f"config_groups.{name}: block_structure")
        ok = (acts is not None and acts.get("type") == "float" and acts.get("num_bits") == 8 and acts.get("dynamic")
              and acts.get("strategy") == "group" and acts.get("group_size") == block[1])
        if not ok:
            raise ValueError(f"config_groups.{name}: block-wise FP8 weights need dynamic float8 activations per "
                             f"group of {block[1]} (the FP8_BLOCK preset); got input_activations={acts!r}")

    def _group_of(self, name: str, module_type: str = "Linear") -> tuple[str, dict[str, Any]] | None:
        """The config group whose targets match module ``name`` of class ``module_type`` (a target
        naming the class matches every such module), or None when the module is ignored or matched
        by no group."""
        if any(matches_module_name(name, p) for p in self.ignore):
            return None
        for key, group in self.config_groups.items():
            for target in group.get("targets") or []:
                if target == module_type or (target not in ("Linear", "Embedding")
                                             and matches_module_name(name, target)):
                    return key, group
        return None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any:
        from pagedlm.core.layers.fused_moe.layer import FusedMoE
        from pagedlm.core.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

        if isinstance(layer, FusedMoE):
            return self._moe_method(prefix)
        if isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
            return self._embedding_method(prefix)
        found = {part: self._group_of(part) for part in shard_names(prefix, self.packed_modules_mapping)}
        keys = {None if g is None else g[0] for g in found.values()}
        if len(keys) > 1:
            raise ValueError(f"compressed-tensors: the modules fused into {prefix} ({', '.join(found)}) are quantized "
                             "differently (ignore list / config groups); pagedlm needs one scheme per fused layer")
        match = next(iter(found.values()))
        if match is None:
            return None
        return self._method(match[1])

    def _method(self, group: dict[str, Any]) -> QuantizeMethodBase:
        fmt, weights, acts = self._format(group), group["weights"], group.get("input_activations")
        strategy = weights.get("strategy")
        if fmt == "pack-quantized":
            group_size = int(weights["group_size"]) if strategy == "group" else -1
            return CompressedTensorsWNA16(bits=int(weights["num_bits"]), group_size=group_size,
                                          symmetric=bool(weights.get("symmetric", True)),
                                          act_order=weights.get("actorder") == "group")
        if strategy == "block":
            block_n, block_k = weights["block_structure"]
            return Fp8BlockLinearMethod(block_n=block_n, block_k=block_k, scale_name="weight_scale")
        kind = "fp8" if fmt == "float-quantized" else "int8"
        if acts is None and kind == "int8":
            return CompressedTensorsW8A16Int(bits=8, group_size=-1, symmetric=True)
        return W8A8LinearMethod(kind=kind, per_channel=strategy == "channel",
                                static_input=bool(acts) and not acts.get("dynamic"), act_quant=acts is not None)

    def _embedding_method(self, prefix: str) -> CompressedTensorsEmbeddingMethod | None:
        match = self._group_of(prefix, "Embedding")
        if match is None:
            return None
        name, group = match
        weights = group["weights"]
        if self._format(group) != "pack-quantized" or weights.get("actorder") == "group":
            raise ValueError(f"{prefix}: a {self._format(group)} embedding table (config_groups.{name}) is not "
                             "supported; supported for embeddings: pack-quantized int4/int8 without act-order")
        self.embedding_quantized = True
        return CompressedTensorsEmbeddingMethod(
            bits=int(weights["num_bits"]), symmetric=bool(weights.get("symmetric", True)),
            group_size=int(weights["group_size"]) if weights.get("strategy") == "group" else -1)

    def _moe_method(self, prefix: str) -> Any:
        """The experts' method: the group of their projections' module names (Qwen's
        ``experts.0.gate_proj``, Mixtral's ``experts.0.w1``; one scheme for all experts, as vLLM)."""
        from pagedlm.core.layers.quantization.moe_methods import CompressedTensorsWNA16MoEMethod, Fp8MoEMethod

        names = [f"{prefix}.0.{proj}" for proj in ("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")]
        match = next((m for m in map(self._group_of, names) if m is not None), None)
        if match is None:
            return None
        group = match[1]
        fmt, weights, acts = self._format(group), group["weights"], group.get("input_activations")
        strategy = weights.get("strategy")
        supported = ("supported for experts: pack-quantized int4/int8 (W4A16, W8A16) without act-order, "
                     "float-quantized FP8 with dynamic per-token activations")
        if fmt == "pack-quantized":
            if weights.get("actorder") == "group":
                raise ValueError(f"{prefix}: act-order (actorder: group) experts are not supported; {supported}")
            return CompressedTensorsWNA16MoEMethod(
                bits=int(weights["num_bits"]), group_size=int(weights["group_size"]) if strategy == "group" else -1,
                symmetric=bool(weights.get("symmetric", True)))
        if fmt == "float-quantized" and acts and acts.get("dynamic") and acts.get("strategy") == "token":
            return Fp8MoEMethod(online=False, per_channel=strategy == "channel")
        raise ValueError(f"{prefix}: compressed-tensors {fmt} experts with "
                         f"{'static' if acts and not acts.get('dynamic') else 'no' if not acts else 'these'} "
                         f"activation scales are not supported; {supported}")

    def get_cache_scale(self, name: str) -> str | None:
        """``...self_attn.k_proj.output_scale`` (a ``kv_cache_scheme`` checkpoint) -> ``...self_attn.attn.k_scale``."""
        for proj, scale in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
            suffix = f".{proj}.output_scale"
            if name.endswith(suffix):
                return name[: -len(suffix)] + f".attn.{scale}"
        return None

    def describe(self) -> str:
        schemes = sorted({f"{self._format(g)}:{g['weights'].get('type')}{g['weights'].get('num_bits')}"
                          for g in self.config_groups.values()})
        head = ", lm_head quantized" if self.lm_head_quantized else ""
        embedding = ", embedding quantized" if self.embedding_quantized else ""
        return f"compressed-tensors ({', '.join(schemes)}{head}{embedding})"
