"""The linear methods every format converts to: integer weight-only (``wna16_gemm``) and 8-bit
weights with 8-bit activations (``fp8_scaled_mm``, ``int8_scaled_mm``; ``fp8_quantized_mm`` for
an input its producer already quantized, a :class:`~.utils.QuantizedActivation`).

A format's method subclasses one of them: it registers the parameters its checkpoints store
(``create_weights``) and says how to read them back as plain integers and scales
(``_unpack_checkpoint``); the base class stores the kernel layout after loading and runs the op.
Each op is bound when the layer is built (``custom_ops.bound_op``: a platform's kernel), else
core's torch reference in :mod:`.utils` runs.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.core.layers import custom_ops
from pagedlm.core.layers.quantization.base_config import LinearMethodBase, set_param_attrs
from pagedlm.core.layers.quantization.utils import (
    FP8_DTYPE,
    QuantizedActivation,
    fp8_block_scaled_mm_ref,
    fp8_quantized_mm_ref,
    fp8_scaled_mm_ref,
    int8_scaled_mm_ref,
    int8_weight_only_gemm_ref,
    pack_rows,
    wna16_gemm_ref,
)

__all__ = ["Fp8BlockLinearMethod", "W8A8LinearMethod", "WNA16LinearMethod", "block_size_of", "dummy_positive",
           "new_param", "online_quantized_weight", "replace_params", "same_for_every_shard"]

WNA16_BITS = (4, 8)


def new_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, **attrs: Any) -> nn.Parameter:
    """Register an empty parameter on ``layer`` with loader attributes (``weight_loader`` included)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_param_attrs(param, attrs)
    layer.register_parameter(name, param)
    return param


def replace_params(layer: nn.Module, drop: list[str], new: dict[str, torch.Tensor | None]) -> None:
    """Remove the checkpoint-layout parameters ``drop`` and register the kernel-layout tensors
    ``new`` (None values are set as plain attributes)."""
    for name in drop:
        if name in layer._parameters:
            del layer._parameters[name]
    for name, tensor in new.items():
        if tensor is None:
            setattr(layer, name, None)
        else:
            layer.register_parameter(name, nn.Parameter(tensor.contiguous(), requires_grad=False))


def same_for_every_shard(param: torch.Tensor, what: str) -> None:
    """Give ``param`` (an input-side tensor of a fused layer, e.g. act-order ``g_idx``) a loader that
    refuses stacked checkpoint tensors that disagree (q/k/v share their input, so they must agree)."""
    seen = {"n": 0}

    def load_shard(dst: torch.Tensor, src: torch.Tensor, full: torch.Tensor, offset: int, size: int) -> None:
        src = src.to(dst.device, dst.dtype)
        if seen["n"] and not torch.equal(dst, src):
            raise ValueError(f"{what}: the checkpoint tensors fused into this layer have different values; "
                             "pagedlm needs one for the fused layer")
        dst.copy_(src)
        seen["n"] += 1

    param.load_shard = load_shard  # type: ignore[attr-defined]


def online_quantized_weight(layer: nn.Module, n: int, k: int, dtype: torch.dtype,
                            quantize: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                            **extra_weight_attrs: Any) -> None:
    """Register ``weight [n, k]`` in ``dtype`` and ``weight_scale [n]`` float32, both written while
    the checkpoint's full-precision tensors load (online quantization: no full-precision copy):
    ``quantize(src, full) -> (values, scale)`` gets this rank's slice of one checkpoint tensor
    (on the weight's device) and the whole tensor; ``scale`` is one value or one per row of src."""
    scale = new_param(layer, "weight_scale", (n,), torch.float32, optional_in_checkpoint=True,
                      dummy_init=_dummy_online_scale)
    scale.data.fill_(1.0)

    def load_shard(dst: torch.Tensor, src: torch.Tensor, full: torch.Tensor, offset: int, size: int) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"{layer.prefix}: checkpoint tensor has shape {tuple(src.shape)}, this rank's "
                             f"parameter expects {tuple(dst.shape)}")
        values, s = quantize(src.to(dst.device), full)
        dst.copy_(values)
        scale.data[offset : offset + size] = s.to(scale.device)

    new_param(layer, "weight", (n, k), dtype, output_dim=0, input_dim=1, **extra_weight_attrs)
    layer.weight.load_shard = load_shard  # type: ignore[attr-defined]


def _dummy_online_scale(param: torch.Tensor, gen: torch.Generator) -> None:
    param.data.fill_(1e-3)


def dummy_positive(param: torch.Tensor, gen: torch.Generator) -> None:
    """``dummy_init`` of a scale: uniform in [1e-4, 2e-3], so dummy layers give finite, varied outputs."""
    values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    param.data.copy_(values.uniform_(1e-4, 2e-3, generator=gen))


class WNA16LinearMethod(LinearMethodBase):
    """``bits``-bit integer weights, activations in the model dtype (W4A16, W8A16).

    ``group_size=-1`` is one scale per output channel. After loading the layer holds
    ``w_qweight``, ``w_scales``, ``w_zeros`` (None when symmetric) and ``w_g_idx`` (None without
    act-order) in the ``wna16_gemm`` layout (:mod:`.utils`).
    """

    op_name = "wna16_gemm"

    def __init__(self, *, bits: int, group_size: int, symmetric: bool, act_order: bool = False) -> None:
        if bits not in WNA16_BITS:
            raise ValueError(f"{bits}-bit integer weights are not supported; supported: {list(WNA16_BITS)}")
        if group_size != -1 and group_size < 1:
            raise ValueError(f"group_size={group_size} must be -1 (per channel) or positive")
        self.bits = bits
        self.pack_factor = 32 // bits
        self.group_size = group_size
        self.symmetric = symmetric
        self.act_order = act_order
        self.op = custom_ops.bound_op(self.op_name) or wna16_gemm_ref
        # a platform's own layout of qweight for its wna16_gemm (API 1.11)
        self.repack = custom_ops.bound_op("wna16_repack")

    def _groups(self, layer: nn.Module, input_size_per_partition: int, input_size: int) -> tuple[int, bool]:
        """(scale rows of this rank, whether scales are split across ranks along the input)."""
        k = input_size_per_partition
        if k % self.pack_factor:
            raise ValueError(f"{layer.prefix}: input size per rank {k} is not a multiple of {self.pack_factor} "
                             f"({self.bits}-bit values per int32 word)")
        if self.group_size == -1:
            return 1, False
        # NOTE: with act-order the groups are scattered over the input rows, so a row-parallel rank
        # keeps every group's scales and indexes them through its slice of g_idx (as vLLM does).
        sharded = k != input_size
        if self.act_order and sharded:
            return -(-input_size // self.group_size), False
        if k % self.group_size:
            raise ValueError(f"{layer.prefix}: input size per rank {k} is not a multiple of group_size="
                             f"{self.group_size}; use a tensor-parallel size that keeps whole groups")
        return k // self.group_size, sharded

    @abstractmethod
    def _unpack_checkpoint(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                             torch.Tensor | None, list[str]]:
        """``(q [K_r, N_r] unsigned ints, scales [G_r, N_r], zeros [G_r, N_r] | None, g_idx [K_r] | None,
        names of the checkpoint parameters to drop)``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scales, zeros, g_idx, drop = self._unpack_checkpoint(layer)
        if self.symmetric:
            zeros = None
        # per channel: one group of all K_r rows; with g_idx the op reads groups from it instead
        layer.w_group_size = q.shape[0] if self.group_size == -1 else self.group_size
        qweight = pack_rows(q, self.bits)
        scales = scales.to(layer.params_dtype)
        zeros = None if zeros is None else zeros.to(torch.int32)
        g_idx = None if g_idx is None else g_idx.to(torch.int32)
        if self.repack is not None:
            qweight = self.repack(qweight, scales, zeros, g_idx, self.bits, layer.w_group_size)
        replace_params(layer, drop, {"w_qweight": qweight, "w_scales": scales, "w_zeros": zeros, "w_g_idx": g_idx})

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        out = self.op(x.reshape(-1, shape[-1]), layer.w_qweight, layer.w_scales, layer.w_zeros, layer.w_g_idx,
                      self.bits, layer.w_group_size)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])


class W8A8LinearMethod(LinearMethodBase):
    """8-bit weights ``[N_r, K_r]`` (float8_e4m3fn or int8) with a scale per output channel, and
    8-bit activations: dynamic per token (``static_input=False``) or one static scale; or no
    activation quantization at all (``act_quant=False``: the weight is dequantized in the forward).

    After loading the layer holds ``weight``, ``weight_scale [N_r] float32`` and ``input_scale``
    (``[1]`` float32, or None when dynamic).

    FP8 with dynamic per-token activations also takes ``x`` as a :class:`QuantizedActivation`
    (:attr:`accepts_fp8_activations`): the input its producer quantized in its own pass, which
    ``fp8_quantized_mm`` multiplies with the same result ``fp8_scaled_mm`` gives the tensor.
    """

    def __init__(self, *, kind: str, per_channel: bool, static_input: bool, act_quant: bool = True) -> None:
        if kind not in ("fp8", "int8"):
            raise ValueError(f"kind={kind!r} must be fp8 or int8")
        self.kind = kind
        self.per_channel = per_channel
        self.static_input = static_input and act_quant
        self.act_quant = act_quant
        self.weight_dtype = FP8_DTYPE if kind == "fp8" else torch.int8
        name = "fp8_scaled_mm" if kind == "fp8" else "int8_scaled_mm"
        bound = custom_ops.bound_op(name)
        self.op = bound or (fp8_scaled_mm_ref if kind == "fp8" else int8_scaled_mm_ref)
        quantized = custom_ops.bound_op("fp8_quantized_mm")
        self.quantized_op = quantized or fp8_quantized_mm_ref
        #: whether apply takes a QuantizedActivation: FP8 dynamic per token, with fp8_quantized_mm
        #: and fp8_scaled_mm both the platform's or both torch (so the products are the same)
        self.accepts_fp8_activations = (kind == "fp8" and self.act_quant and not self.static_input
                                        and (bound is None) == (quantized is None))
        #: int8 weights without activation quantization (W8A16)
        self.weight_only_op = ((custom_ops.bound_op("int8_weight_only_gemm") or int8_weight_only_gemm_ref)
                               if kind == "int8" and not act_quant else None)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        n = sum(output_partition_sizes)
        shards = len(output_partition_sizes)
        new_param(layer, "weight", (n, input_size_per_partition), self.weight_dtype, output_dim=0, input_dim=1,
                  **extra_weight_attrs)
        if self.per_channel:
            new_param(layer, "weight_scale", (n, 1), torch.float32, output_dim=0, dummy_init=dummy_positive,
                      **extra_weight_attrs)
        else:
            new_param(layer, "weight_scale", (shards,), torch.float32, shard_scalar=True,
                      dummy_init=dummy_positive, **extra_weight_attrs)
        if self.static_input:
            new_param(layer, "input_scale", (shards,), torch.float32, shard_scalar=True,
                      dummy_init=dummy_positive, **extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight_scale.data.float()
        if not self.per_channel:
            sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
            scale = torch.repeat_interleave(scale, sizes)
        input_scale = None
        if self.static_input:
            # NOTE: stacked q/k/v (gate/up) each came with their own input scale; the fused matmul
            # takes the largest, so no activation is clipped (vLLM does the same).
            input_scale = layer.input_scale.data.float().amax().reshape(1)
        replace_params(layer, ["weight_scale", "input_scale"],
                       {"weight_scale": scale.reshape(-1), "input_scale": input_scale})

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedActivation,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            assert self.accepts_fp8_activations, f"{type(self).__name__}: no pre-quantized input here"
            return self.quantized_op(x.x_q, x.scale, layer.weight, layer.weight_scale, bias, x.dtype)
        if self.weight_only_op is not None:
            out = self.weight_only_op(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale, bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if not self.act_quant:
            w = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype).unsqueeze(1)
            return F.linear(x, w, bias)
        return self.op(x, layer.weight, layer.weight_scale, layer.input_scale, bias)


def block_size_of(value: Any, what: str) -> tuple[int, int]:
    """``[block_n, block_k]`` from a checkpoint config, or a ``ValueError`` naming ``what``."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(b, int) and b > 0
                                                                         for b in value)):
        raise ValueError(f"{what}={value!r} is not supported; supported: two positive ints [block_n, block_k], "
                         "e.g. [128, 128]")
    return value[0], value[1]


class Fp8BlockLinearMethod(LinearMethodBase):
    """Block-wise FP8 (DeepSeek-V3's and Qwen3-FP8's ``weight_block_size``, compressed-tensors'
    ``block`` strategy): float8_e4m3fn ``weight [N_r, K_r]`` with one float32 scale per
    ``[block_n, block_k]`` block, stored as ``scale_name`` (``weight_scale_inv`` or
    ``weight_scale``: the factor to multiply by, whatever its name), and activations quantized
    dynamically per token and group of ``block_k`` (op ``fp8_block_scaled_mm``).

    NOTE: blocks never straddle tensor-parallel ranks or the checkpoint tensors fused into one
    layer (q/k/v, gate/up): every such part is a whole number of blocks, else a ``ValueError``.
    After loading the layer holds ``weight`` and ``weight_scale [N_r / block_n, K_r / block_k]``.
    """

    op_name = "fp8_block_scaled_mm"

    def __init__(self, *, block_n: int, block_k: int, scale_name: str) -> None:
        self.block_n = block_n
        self.block_k = block_k
        self.scale_name = scale_name
        self.op = custom_ops.bound_op(self.op_name) or fp8_block_scaled_mm_ref

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        k = input_size_per_partition
        parts = [size for size in output_partition_sizes if size % self.block_n] + ([k] if k % self.block_k else [])
        if parts:
            raise ValueError(f"{layer.prefix}: output parts {output_partition_sizes} and input {k} per rank must be "
                             f"whole blocks of [{self.block_n}, {self.block_k}] (block-wise FP8); use a "
                             "tensor-parallel size that keeps them whole")
        n = sum(output_partition_sizes)
        new_param(layer, "weight", (n, k), FP8_DTYPE, output_dim=0, input_dim=1, **extra_weight_attrs)
        new_param(layer, self.scale_name, (n // self.block_n, k // self.block_k), torch.float32, output_dim=0,
                  input_dim=1, packed_dim=0, packed_factor=self.block_n, dummy_init=dummy_positive,
                  **extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = getattr(layer, self.scale_name).data.float()
        replace_params(layer, [self.scale_name], {"weight_scale": scale})

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.op(x, layer.weight, layer.weight_scale, self.block_n, self.block_k, bias)
