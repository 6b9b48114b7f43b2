"""The ``gguf`` method: a GGUF file's quantized tensors kept in their blocks and computed on.

vLLM's names (``quantization="gguf"``, ``GGUFConfig``, ``GGUFLinearMethod``, ``GGUFEmbeddingMethod``).
Chosen by :func:`gguf_quant_config` when ``VllmConfig.finalize`` sees a ``.gguf`` model on a platform
that registers the ``gguf_mul_mat`` op (the CPU backend), or when the user passes
``quantization="gguf"`` (then core's torch reference runs where no kernel is registered: correct, but it
dequantizes a layer's weights on every forward). Elsewhere the loader dequantizes every tensor at load,
as before.

Which path each tensor takes:

- a linear layer whose checkpoint tensors are all of a :data:`KERNEL_TYPES` type keeps its bytes
  (one flat ``uint8`` parameter; a fused q/k/v or gate/up layer holds each shard's blocks back to back,
  so the shards may differ in type, e.g. Gemma 3's Q5_0 q/k with a Q8_0 v) and calls ``gguf_mul_mat``
  once per run of consecutive shards of one type; Q4_0 and Q5_0 blocks are rewritten as Q8_0 blocks
  of the same values after loading (:func:`repack_as_q8_0`: a faster kernel for more bytes);
- the token embedding (and the LM head tied to it) keeps its rows quantized: a lookup decodes only the
  gathered rows (``gguf_get_rows``) and the logits are one ``gguf_mul_mat``;
- every other tensor (norms, F16/BF16/F32 matrices, the types the kernels lack: Q2_K, Q3_K, MoE
  expert stacks) is dequantized at load, with one log line naming the quantized types concerned.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedlm.core.layers import custom_ops
from pagedlm.core.layers.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    set_param_attrs,
    shard_names,
)
from pagedlm.core.logger import init_logger
from pagedlm.core.model_loader.gguf_dequant import dequantize

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig
    from pagedlm.core.platforms import Platform

logger = init_logger(__name__)

__all__ = [
    "KERNEL_TYPES",
    "GGUFConfig",
    "GGUFEmbeddingMethod",
    "GGUFLinearMethod",
    "GGUFWeight",
    "gguf_get_rows_reference",
    "gguf_mul_mat_reference",
    "gguf_quant_config",
]

#: ggml type id -> (name, values per block, bytes per block): the types ``gguf_mul_mat`` and
#: ``gguf_get_rows`` implementations must handle (the op contracts)
KERNEL_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}
#: the float types: dequantized (cast) at load, never "quantized"
_FLOAT_TYPES = {0, 1, 30}


Q8_0 = 8
#: types whose blocks convert to Q8_0 blocks decoding to the same float32 values: the same float16
#: scale ``d`` and the signed integer ``q - 8`` / ``q - 16`` as an int8 (``d * q`` either way)
_REPACKED_AS_Q8_0 = frozenset({2, 6})  # Q4_0, Q5_0


def repack_as_q8_0(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """``[rows, row_bytes]`` Q4_0 or Q5_0 blocks -> ``[rows, K / 32 * 34]`` Q8_0 blocks, exactly.

    NOTE: why: the Q8_0 kernel decodes a block in about half the instructions (a widening load per
    8 values instead of nibble and bit unpacking), which makes single-request decode of these
    layers about 2-3x faster on AVX2; the cost is 34 instead of 18/22 bytes per 32 weights.
    """
    from pagedlm.core.model_loader.gguf_dequant import _fifth_bits, _nibbles

    rows = blocks.shape[0]
    b = blocks.reshape(-1, KERNEL_TYPES[qtype][2])
    if qtype == 2:
        q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
    else:
        q = (_nibbles(b[:, 6:22]) | (_fifth_bits(b, 2) << 4)).to(torch.int8) - 16
    return torch.cat((b[:, 0:2], q.view(torch.uint8)), dim=1).reshape(rows, -1)


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` values of kernel type ``qtype``."""
    _, values, size = KERNEL_TYPES[qtype]
    return k // values * size


def gguf_mul_mat_reference(x: torch.Tensor, qweight: torch.Tensor, qtype: int, out_features: int) -> torch.Tensor:
    """Core's torch reference of ``gguf_mul_mat``: dequantize the whole weight, then one float32 matmul."""
    w = dequantize(qweight.reshape(-1), qtype, (out_features, x.shape[-1]))
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def gguf_get_rows_reference(qweight: torch.Tensor, qtype: int, ids: torch.Tensor, embedding_dim: int) -> torch.Tensor:
    """Core's torch reference of ``gguf_get_rows``: dequantize only the gathered rows."""
    rows = qweight[ids.reshape(-1)]
    return dequantize(rows.reshape(-1), qtype, (rows.shape[0], embedding_dim)).reshape(*ids.shape, embedding_dim)


@dataclass
class GGUFWeight:
    """One checkpoint tensor as the GGUF file stores it, yielded by the GGUF weights iterator for the
    tensors a :class:`GGUFConfig` keeps quantized. ``data [rows, row_bytes] uint8`` (may view the file)."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]  # (rows, values per row), torch order


def _load_bytes(name: str, dst: torch.Tensor, loaded: Any, qtype: int, shape: tuple[int, int]) -> None:
    if not isinstance(loaded, GGUFWeight):
        raise ValueError(f"{name}: expected the GGUF file's quantized tensor, got {type(loaded).__name__}")
    if loaded.ggml_type != qtype or tuple(loaded.shape) != shape:
        raise ValueError(f"{name}: the file holds type {loaded.ggml_type} shape {tuple(loaded.shape)}, the layer "
                         f"was built for type {qtype} shape {shape}")
    dst.reshape(-1).copy_(loaded.data.reshape(-1))


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer computing on the file's blocks: ``weight [total bytes] uint8`` holding each stacked
    shard's rows back to back; after loading, ``layer.gguf_segments`` lists ``(qtype, qweight [N_s,
    row_bytes] view, N_s)`` per run of consecutive same-type shards."""

    def __init__(self, tensor_names: list[str], qtypes: list[int]) -> None:
        self.tensor_names = tensor_names
        self.qtypes = qtypes
        self.op = custom_ops.bound_op("gguf_mul_mat") or gguf_mul_mat_reference

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        k = input_size_per_partition
        shard_ids = [sid for sid, _ in layer._logical_shards()]
        shards, offset = [], 0
        for sid, n, qtype in zip(shard_ids, output_partition_sizes, self.qtypes, strict=True):
            size = n * row_bytes(qtype, k)
            shards.append((sid, offset, size, n, qtype))
            offset += size
        layer.gguf_shards = shards
        weight = nn.Parameter(torch.empty(offset, dtype=torch.uint8), requires_grad=False)

        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            for (sid, start, size, n, qtype), name in zip(shards, self.tensor_names, strict=True):
                if sid == shard_id:
                    _load_bytes(name, param.data[start:start + size], loaded, qtype, (n, k))
                    return
            raise ValueError(f"{layer.prefix}: no shard {shard_id!r} (shards: {[s[0] for s in shards]})")

        set_param_attrs(weight, {**extra_weight_attrs, "weight_loader": load})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack Q4_0/Q5_0 shards as Q8_0 (:func:`repack_as_q8_0`), then group consecutive shards of
        one type into segments (one op call each)."""
        k = layer.input_size_per_partition
        parts, shards, offset = [], [], 0
        for sid, start, size, n, qtype in layer.gguf_shards:
            blocks = layer.weight.data[start:start + size].view(n, row_bytes(qtype, k))
            if qtype in _REPACKED_AS_Q8_0:
                blocks, qtype = repack_as_q8_0(blocks, qtype), Q8_0
            parts.append(blocks.reshape(-1))
            shards.append((sid, offset, blocks.numel(), n, qtype))
            offset += blocks.numel()
        if any(s[4] != old[4] for s, old in zip(shards, layer.gguf_shards, strict=True)):
            layer.weight = nn.Parameter(torch.cat(parts), requires_grad=False)
            layer.gguf_shards = shards
        segments: list[list[Any]] = []
        for _, start, size, n, qtype in layer.gguf_shards:
            if segments and segments[-1][0] == qtype:
                segments[-1][2] += n
                segments[-1][4] += size
            else:
                segments.append([qtype, None, n, start, size])
        layer.gguf_segments = [
            (qtype, layer.weight.data[start:start + size].view(n, row_bytes(qtype, k)), n)
            for qtype, _, n, start, size in segments
        ]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        outs = [self.op(x2, qweight, qtype, n) for qtype, qweight, n in layer.gguf_segments]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """The token embedding (``VocabParallelEmbedding``) kept quantized: ``weight [V, row_bytes] uint8``;
    :meth:`embedding` decodes the looked-up rows, :meth:`apply` is the (tied) LM head's matmul."""

    def __init__(self, tensor_name: str, qtype: int) -> None:
        self.tensor_name = tensor_name
        self.qtype = qtype
        self.get_rows = custom_ops.bound_op("gguf_get_rows") or gguf_get_rows_reference
        self.mul_mat = custom_ops.bound_op("gguf_mul_mat") or gguf_mul_mat_reference

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,  # type: ignore[override]
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        weight = nn.Parameter(torch.empty(num_embeddings, row_bytes(self.qtype, embedding_dim), dtype=torch.uint8),
                              requires_grad=False)
        shape = (num_embeddings, embedding_dim)

        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            _load_bytes(self.tensor_name, param.data, loaded, self.qtype, shape)

        set_param_attrs(weight, {**extra_weight_attrs, "weight_loader": load})
        layer.register_parameter("weight", weight)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [...] -> [..., embedding_dim]`` in the layer's dtype."""
        return self.get_rows(layer.weight, self.qtype, input_ids, layer.embedding_dim).to(layer.params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The tied LM head: ``x [T, embedding_dim] -> [T, num_embeddings]`` in x's dtype."""
        return self.mul_mat(x, layer.weight, self.qtype, layer.weight.shape[0])


class GGUFConfig(QuantizationConfig):
    """The ``gguf`` method for one GGUF file: which tensors have which ggml type.

    ``quantized_tensors`` collects the checkpoint names of the tensors the built model keeps
    quantized (filled as layers ask for their methods); the GGUF weights iterator yields those as
    :class:`GGUFWeight` and dequantizes the rest.
    """

    requires_quantized_layers = False  # a layer it does not claim loads dequantized, as without it
    quantizes_embeddings = True

    def __init__(self, tensor_types: dict[str, tuple[int, str]], path: str = "") -> None:
        self.tensor_types = tensor_types  # HF name -> (ggml type id, ggml type name)
        self.path = path
        self.quantized_tensors: set[str] = set()
        dequantized = Counter(name for t, name in tensor_types.values()
                              if t not in KERNEL_TYPES and t not in _FLOAT_TYPES)
        if dequantized:
            logger.info("%s: GGUF tensors of type %s are dequantized at load (the GGUF kernels compute on %s)",
                        path, ", ".join(f"{n} ({c})" for n, c in sorted(dequantized.items())),
                        ", ".join(v[0] for v in KERNEL_TYPES.values()))

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        raise ValueError('quantization="gguf" reads a GGUF file: pass model=FILE.gguf')

    @classmethod
    def from_gguf_file(cls, path: str) -> GGUFConfig:
        """Read the file's header (not its data) for the HF name and type of every tensor."""
        from pagedlm.core.model_loader.gguf_config import get_arch, hf_tensor_name
        from pagedlm.core.model_loader.gguf_reader import read_gguf

        types: dict[str, tuple[int, str]] = {}
        with read_gguf(path) as gguf:
            arch = get_arch(gguf)
            for info in gguf.tensors:
                name = hf_tensor_name(arch, info.name)
                if name is not None and len(info.shape) == 2:
                    types[name] = (info.ggml_type, info.type_name)
        return cls(types, path)

    def _kernel_type(self, name: str) -> int | None:
        qtype = self.tensor_types.get(name, (None, ""))[0]
        return qtype if qtype in KERNEL_TYPES else None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from pagedlm.core.layers.linear import LinearBase
        from pagedlm.core.layers.vocab_embedding import VocabParallelEmbedding

        if getattr(layer, "tp_size", 1) > 1:
            return None  # NOTE: gguf_quant_config only picks this method for one rank
        if isinstance(layer, LinearBase):
            names = [f"{n}.weight" for n in shard_names(prefix, self.packed_modules_mapping)]
            qtypes = [self._kernel_type(n) for n in names]
            if any(t is None for t in qtypes) or len(names) != len(layer._logical_shards()):
                return None
            self.quantized_tensors.update(names)
            return GGUFLinearMethod(names, qtypes)  # type: ignore[arg-type]
        if isinstance(layer, VocabParallelEmbedding):
            name = f"{prefix}.weight"
            qtype = self._kernel_type(name)
            if qtype is None:
                return None
            self.quantized_tensors.add(name)
            return GGUFEmbeddingMethod(name, qtype)
        return None

    def describe(self) -> str:
        return f"gguf ({len(self.quantized_tensors)} tensors kept quantized)"


def gguf_quant_config(vllm_config: VllmConfig, platform: Platform) -> GGUFConfig | None:
    """The GGUF model's method once the platform is known: :class:`GGUFConfig` when the user asked for
    ``quantization="gguf"`` or the platform registers ``gguf_mul_mat``, on a single rank; None keeps
    dequantize-at-load (e.g. CUDA, whose dense kernels are fast)."""
    mc = vllm_config.model_config
    asked = bool(mc.quantization) and str(mc.quantization).lower() == "gguf"
    if vllm_config.parallel_config.world_size > 1:
        if asked:
            raise ValueError('quantization="gguf" keeps GGUF tensors quantized on one rank only; the file is '
                             "dequantized at load with tensor or pipeline parallelism (leave quantization unset)")
        return None
    if not asked and "gguf_mul_mat" not in custom_ops.registered_ops(platform.device_name):
        return None
    config = GGUFConfig.from_gguf_file(mc.model)
    if not any(qtype in KERNEL_TYPES for qtype, _ in config.tensor_types.values()):
        return None  # a float file (F32/F16/BF16) or only dequantized types: nothing to keep quantized
    return config
