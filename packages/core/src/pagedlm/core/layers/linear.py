"""Tensor-parallel linear layers.

Weights follow ``torch.nn.Linear``'s layout, ``[output_size, input_size]``. With ``tp`` ranks:

- :class:`ColumnParallelLinear` splits the *output* dimension: rank ``r`` holds rows
  ``[r * out/tp, (r+1) * out/tp)`` and produces that slice of the output.
- :class:`RowParallelLinear` splits the *input* dimension: rank ``r`` holds columns
  ``[r * in/tp, (r+1) * in/tp)``, produces a partial sum, and the ranks all-reduce.
- :class:`MergedColumnParallelLinear` and :class:`QKVParallelLinear` are column-parallel layers
  whose output is several checkpoint tensors stacked (gate/up, q/k/v); each rank stacks *its*
  slice of each, so ``[q_r | k_r | v_r]`` is contiguous on rank ``r``.

Every parameter has ``param.weight_loader(param, loaded_weight, shard_id=None)`` taking the
full checkpoint tensor (or, for merged layers, one of the stacked tensors named by
``shard_id``) and copying this rank's slice into place.

Quantization: a layer built with ``quant_config`` asks it for its quantize method by ``prefix``
(the module path, e.g. ``model.layers.0.mlp.gate_up_proj``); the method creates the parameters
as the checkpoint stores them (with their TP sharding described by parameter attributes, see
:class:`LinearBase`) and computes the forward (``quant_method.apply``). A layer whose method takes
pre-quantized FP8 activations (:func:`takes_fp8_activations`) passes a
:class:`~pagedlm.core.layers.quantization.utils.QuantizedActivation` input to it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedlm.core.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedlm.core.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedLinearMethod,
)
from pagedlm.core.layers.quantization.utils import QuantizedActivation
from pagedlm.core.model_loader.weight_utils import set_weight_attrs

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "divide",
    "load_param_shard",
    "maybe_prefix",
    "set_attention_heads",
    "takes_fp8_activations",
]


def set_attention_heads(module: nn.Module, config: Any) -> None:
    """Set an attention module's head counts from an HF config, for this tensor-parallel rank:
    ``total_num_heads``, ``total_num_kv_heads``, ``head_dim`` (the config's, or hidden / heads),
    and the rank's ``num_heads``, ``num_kv_heads``, ``q_size``, ``kv_size``."""
    tp_size = get_tensor_model_parallel_world_size()
    module.total_num_heads = config.num_attention_heads
    module.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or module.total_num_heads
    module.head_dim = getattr(config, "head_dim", None) or config.hidden_size // module.total_num_heads
    module.num_heads = module.total_num_heads // tp_size
    # NOTE: with more ranks than KV heads each rank keeps one (replicated) KV head.
    module.num_kv_heads = max(1, module.total_num_kv_heads // tp_size)
    module.q_size = module.num_heads * module.head_dim
    module.kv_size = module.num_kv_heads * module.head_dim


def maybe_prefix(prefix: str, name: str) -> str:
    """Join module-path parts: ``maybe_prefix("", "model") == "model"``,
    ``maybe_prefix("model", "norm") == "model.norm"``."""
    return f"{prefix}.{name}" if prefix else name


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def _factor(param: torch.Tensor, dim: int) -> int:
    """How many logical features one element of ``param`` holds along ``dim`` (packed int32 words)."""
    return int(getattr(param, "packed_factor", 1)) if getattr(param, "packed_dim", None) == dim else 1


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, this rank's parameter expects "
            f"{tuple(param.shape)}"
        )


def load_param_shard(param: nn.Parameter, loaded_weight: torch.Tensor, *, name: str, offset: int, size: int,
                     start: int, index: int = 0, input_rank: int | None = None) -> None:
    """Copy output features ``[start, start + size)`` of checkpoint tensor ``loaded_weight`` into
    output features ``[offset, offset + size)`` of ``param`` (stacked tensor ``index`` for a
    ``shard_scalar``), as ``param``'s attributes describe (:class:`LinearBase`); ``input_rank``
    takes that rank's slice of the input dimension (row-parallel layers)."""
    dst, src = param.data, loaded_weight
    out_dim = getattr(param, "output_dim", None)
    if out_dim is not None:
        f = _factor(param, out_dim)
        if offset % f or size % f or start % f:
            raise ValueError(f"{name}: {size} output features at {start} do not split into whole packed "
                             f"elements of {f}; use a smaller tensor-parallel size")
        dst = dst.narrow(out_dim, offset // f, size // f)
        if start or size // f != loaded_weight.shape[out_dim]:
            # Plain slicing along rows, so a lazy safetensors slice reads only these rows.
            src = (src[start // f : (start + size) // f] if out_dim == 0
                   else src.narrow(out_dim, start // f, size // f))
    elif getattr(param, "shard_scalar", False):
        dst = dst.narrow(0, index, 1)
        src = src.reshape(1)
    in_dim = getattr(param, "input_dim", None)
    if input_rank is not None and in_dim is not None:
        n = dst.shape[in_dim]
        src = src.narrow(in_dim, input_rank * n, n)
    load_shard = getattr(param, "load_shard", None)
    if load_shard is not None:
        load_shard(dst, src, loaded_weight, offset, size)
        return
    _check_shape(dst, src, name)
    dst.copy_(src)


class LinearBase(nn.Module):
    """Common constructor and weight loading of the linear layers.

    The layer's parameters come from its quantize method (``quant_config.get_quant_method(self,
    prefix)``; :class:`UnquantizedLinearMethod` without one): ``weight [out_per_rank,
    in_per_rank]`` in full precision, or whatever the format stores (packed int32 words, scales,
    zero points). Each parameter says how it is sharded through attributes the one weight loader
    below reads: ``output_dim`` / ``input_dim`` (which dimension indexes output / input features,
    None: neither), ``packed_dim`` and ``packed_factor`` (that dimension holds ``packed_factor``
    features per element), ``shard_scalar`` (one value per stacked checkpoint tensor, e.g. a
    per-tensor scale of q, k and v) and optionally ``load_shard(dst, src, full, offset, size)``
    (a method's own copy, e.g. quantizing as the weight loads).

    Subclasses set ``self.output_size_per_partition`` / ``self.input_size_per_partition`` and
    ``self.output_partition_sizes`` before calling :meth:`_create_params`, and describe their
    output shards with :meth:`_output_shard`.
    """

    #: whether this layer shards the input dimension (row-parallel)
    shards_input = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        # NOTE: read once at construction; the executor initialises the TP group before
        # building the model, and a layer's shard never changes afterwards.
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = input_size
        self.output_size_per_partition = output_size
        self.output_partition_sizes = [output_size]
        self.has_bias = bias
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()

    def _create_params(self, bias_size: int) -> None:
        # Values are garbage until a weight loader (or dummy init) fills them.
        self.quant_method.create_weights(
            self, self.input_size_per_partition, self.output_partition_sizes, self.input_size, self.output_size,
            self.params_dtype, weight_loader=self.weight_loader,
        )
        if self.has_bias:
            self.bias = nn.Parameter(torch.empty(bias_size, dtype=self.params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader, "output_dim": 0})
        else:
            self.register_parameter("bias", None)

    # -- weight loading ----------------------------------------------------------------------
    def _logical_shards(self) -> list[tuple[Any, int]]:
        """``(shard_id, full size)`` of the checkpoint tensors stacked in the output (one: ``None``)."""
        return [(None, self.output_size)]

    def _output_shard(self, shard_id: Any) -> tuple[int, int, int, int]:
        """``(offset in this rank's output, size, start in the checkpoint tensor, shard index)`` in
        output features, for checkpoint tensor ``shard_id``."""
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: {type(self).__name__} takes no shard_id (got {shard_id!r})")
        return 0, self.output_size_per_partition, 0, 0

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's part of checkpoint tensor ``loaded_weight`` (whole, or the stacked tensor
        ``shard_id``) into ``param``, as ``param``'s attributes describe (class docstring)."""
        shards = self._logical_shards()
        if shard_id is None and len(shards) > 1:
            # A checkpoint that stores the fused tensor: split it and load each part.
            out_dim = getattr(param, "output_dim", None)
            offset = 0
            for sid, size in shards:
                if out_dim is None:
                    self.weight_loader(param, loaded_weight, sid)
                    continue
                f = _factor(param, out_dim)
                self.weight_loader(param, loaded_weight.narrow(out_dim, offset // f, size // f), sid)
                offset += size
            return
        offset, size, start, index = self._output_shard(shard_id)
        name = self.prefix if shard_id is None else f"{self.prefix}[{shard_id}]"
        load_param_shard(param, loaded_weight, name=name, offset=offset, size=size, start=start, index=index,
                         input_rank=self.tp_rank if self.shards_input else None)

    def extra_repr(self) -> str:
        method = "" if not self.quant_method.quantized else f", quant={type(self.quant_method).__name__}"
        return (
            f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
            f"bias={self.has_bias}, tp_size={self.tp_size}{method}"
        )


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole. ``x [T, in] -> [T, out]``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(input_size, output_size, bias, params_dtype, prefix, quant_config)
        self._create_params(output_size)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks.

    ``x [T, in] -> [T, out / tp]``, or ``[T, out]`` with ``gather_output=True`` (all-gather).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        # NOTE: the quant method is chosen in LinearBase.__init__, which needs only the prefix; the
        # partition sizes are set before it creates the weights.
        super().__init__(input_size, output_size, bias, params_dtype, prefix, quant_config)
        self.gather_output = gather_output
        self.output_size_per_partition = self._output_size_per_partition()
        self.output_partition_sizes = self._output_partition_sizes()
        self._create_params(self.output_size_per_partition)

    def _output_size_per_partition(self) -> int:
        return divide(self.output_size, self.tp_size, f"{self.prefix or 'linear'} output_size")

    def _output_partition_sizes(self) -> list[int]:
        return [self.output_size_per_partition]

    def _output_shard(self, shard_id: Any) -> tuple[int, int, int, int]:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: ColumnParallelLinear takes no shard_id (got {shard_id!r})")
        size = self.output_size_per_partition
        return 0, size, self.tp_rank * size, 0

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked into one matmul (e.g. ``gate_up_proj``).

    ``output_sizes`` are the full (unsharded) sizes of the stacked tensors; shard ids are their
    indices (``0`` = gate, ``1`` = up). ``x [T, in] -> [T, sum(output_sizes) / tp]`` laid out
    as ``[shard0_r | shard1_r | ...]``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, gather_output, params_dtype, prefix,
                         quant_config)

    def _output_size_per_partition(self) -> int:
        for i, size in enumerate(self.output_sizes):
            divide(size, self.tp_size, f"{self.prefix or 'linear'} output_sizes[{i}]")
        return sum(self.output_sizes) // self.tp_size

    def _output_partition_sizes(self) -> list[int]:
        return [size // self.tp_size for size in self.output_sizes]

    def _logical_shards(self) -> list[tuple[Any, int]]:
        return list(enumerate(self.output_sizes))

    def _output_shard(self, shard_id: Any) -> tuple[int, int, int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: shard_id must be 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return offset, size, self.tp_rank * size, shard_id


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection, split across ranks by attention head.

    Rank ``r`` holds query heads ``[r * H/tp, (r+1) * H/tp)``. When ``tp <= Hkv`` it holds KV
    heads ``[r * Hkv/tp, ...)``; when ``tp > Hkv`` each KV head is replicated on ``tp / Hkv``
    consecutive ranks and rank ``r`` holds KV head ``r // (tp / Hkv)`` alone.

    ``x [T, hidden] -> [T, (H_r + 2 * Hkv_r) * head_size]`` laid out ``[q_r | k_r | v_r]``.
    Shard ids are ``"q"``, ``"k"``, ``"v"``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        output_size = (self.total_num_heads + 2 * self.total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias, False, params_dtype, prefix, quant_config)

    def _output_size_per_partition(self) -> int:
        tp = self.tp_size
        self.num_heads = divide(self.total_num_heads, tp, f"{self.prefix or 'qkv'} num_attention_heads")
        if tp >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp, self.total_num_kv_heads, "tensor_parallel_size / num_kv_heads")
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp, f"{self.prefix or 'qkv'} num_key_value_heads")
            self.num_kv_head_replicas = 1
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_size

    def _output_partition_sizes(self) -> list[int]:
        kv = self.num_kv_heads * self.head_size
        return [self.num_heads * self.head_size, kv, kv]

    def _logical_shards(self) -> list[tuple[Any, int]]:
        kv = self.total_num_kv_heads * self.head_size
        return [("q", self.total_num_heads * self.head_size), ("k", kv), ("v", kv)]

    def _output_shard(self, shard_id: Any) -> tuple[int, int, int, int]:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id == "q":
            return 0, q_size, self.tp_rank * q_size, 0
        # NOTE: replicated KV heads: ranks r*rep .. r*rep+rep-1 all read KV head r.
        kv_start = (self.tp_rank // self.num_kv_head_replicas) * kv_size
        if shard_id == "k":
            return q_size, kv_size, kv_start, 1
        if shard_id == "v":
            return q_size + kv_size, kv_size, kv_start, 2
        raise ValueError(f"{self.prefix}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; partial outputs are all-reduced.

    ``x [T, in / tp]`` (``input_is_parallel=True``, the output of a column-parallel layer) or
    ``x [T, in]`` (this rank's slice is taken) ``-> [T, out]``. The bias is held whole on
    every rank and added once, after the reduction.
    """

    shards_input = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(input_size, output_size, bias, params_dtype, prefix, quant_config)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, f"{prefix or 'linear'} input_size")
        self._create_params(output_size)

    def _output_shard(self, shard_id: Any) -> tuple[int, int, int, int]:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: RowParallelLinear takes no shard_id (got {shard_id!r})")
        return 0, self.output_size, 0, 0

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            # NOTE: never a QuantizedActivation (takes_fp8_activations says no to this layer)
            assert isinstance(x, torch.Tensor)
            size = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * size, size)
        if self.tp_size == 1:
            # Fusing the bias into the matmul matches nn.Linear exactly.
            return self.quant_method.apply(self, x, self.bias)
        out = self.quant_method.apply(self, x, None)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        # NOTE: without the reduction the caller sums partial outputs itself, so adding the
        # bias here would count it tp times; it is then the caller's to add.
        if self.bias is not None and self.reduce_results:
            out = out + self.bias
        return out


def takes_fp8_activations(module: nn.Module) -> bool:
    """Whether ``module(x)`` may be given ``x`` as a :class:`QuantizedActivation` (``[T, K]``): a
    linear layer of this module (not wrapped, e.g. by LoRA, whose update needs the tensor) whose
    quant method accepts it, and that slices no input itself (a row-parallel layer fed the
    whole input)."""
    if not isinstance(module, LinearBase) or not getattr(module.quant_method, "accepts_fp8_activations", False):
        return False
    return not (isinstance(module, RowParallelLinear) and not module.input_is_parallel and module.tp_size > 1)
