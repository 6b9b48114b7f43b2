"""LoRA around the tensor-parallel linear layers, without merging weights.

Each adapted layer keeps its base layer and, per *slice* of its output (one for a plain layer;
q/k/v of ``qkv_proj``, gate/up of ``gate_up_proj``), stacked device buffers with one entry per
slot: ``lora_a [max_loras, num_slices, max_lora_rank, in_per_rank]`` (every slice's A, so one
shrink serves them all) and per slice ``lora_b[i] [max_loras, out_slice_per_rank,
max_lora_rank]``; ranks below the maximum are zero-padded. Sharding follows
the base layer: a column-parallel layer holds A whole and the rows of B for its output shard
(``LinearBase._output_shard``: replicated KV heads included); a row-parallel layer holds the
columns of A for its input shard and B whole, and adds its partial update before the
all-reduce, so the reduction sums the update too.

The update of a step is ``y[t] += (x[t] @ A[s]^T) @ B[s]^T * scale[s]`` for each token ``t`` of a
request whose adapter sits in slot ``s`` (:class:`~pagedlm.core.lora.punica.LoRAStepState`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedlm.core.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from pagedlm.core.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear

__all__ = ["LinearWithLoRA", "LoRASlice", "adaptable_layers", "target_table"]


@dataclass(frozen=True)
class LoRASlice:
    """One adapted sub-module of a layer: its HF module path, where its output lies in this
    rank's output (``offset``, ``size``), which rows of the full B it holds (``start``), and its
    full ``(in, out)`` sizes."""

    module: str
    offset: int
    size: int
    start: int
    full_in: int
    full_out: int


def _slices(layer: LinearBase, stacked: dict[str, list[tuple[str, Any]]]) -> list[LoRASlice]:
    parent, _, name = layer.prefix.rpartition(".")
    join = (lambda n: f"{parent}.{n}") if parent else (lambda n: n)
    if isinstance(layer, RowParallelLinear):
        return [LoRASlice(join(name), 0, layer.output_size, 0, layer.input_size, layer.output_size)]
    sizes = dict(layer._logical_shards())
    parts = stacked.get(name) or [(name, None)]
    out = []
    for sub, shard_id in parts:
        offset, size, start, _ = layer._output_shard(shard_id)
        out.append(LoRASlice(join(sub), offset, size, start, layer.input_size, sizes[shard_id]))
    return out


def adaptable_layers(model: nn.Module) -> list[tuple[str, LinearBase, list[LoRASlice]]]:
    """``(module name, layer, slices)`` of every column- or row-parallel linear layer of
    ``model`` (replicated layers, the embeddings and the LM head are not adapted). Packed layers
    are split by the model's ``stacked_params`` (``(packed, checkpoint name, shard id)``)."""
    stacked: dict[str, list[tuple[str, Any]]] = {}
    for packed, sub, shard_id in getattr(model, "stacked_params", ()):
        stacked.setdefault(packed, []).append((sub, shard_id))
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.prefix:
            found.append((name, module, _slices(module, stacked)))
    return found


def target_table(model: nn.Module) -> dict[str, list[int]]:
    """HF module path -> ``[in, out]`` full sizes of every adaptable sub-module of ``model``."""
    return {s.module: [s.full_in, s.full_out] for _, _, slices in adaptable_layers(model) for s in slices}


class LinearWithLoRA(nn.Module):
    """``base_layer`` plus the LoRA update of the step's adapters (see the module docstring)."""

    def __init__(self, base_layer: LinearBase, slices: list[LoRASlice], state: Any) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.slices = slices
        self.state = state  # LoRAStepState, shared by every adapted layer of the model
        self.row_parallel = isinstance(base_layer, RowParallelLinear)
        weight = next(base_layer.parameters())
        num, rank, dtype = state.max_loras, state.max_lora_rank, state.dtype
        size_in = base_layer.input_size_per_partition
        self.register_buffer("lora_a", torch.zeros(num, len(slices), rank, size_in, dtype=dtype,
                                                   device=weight.device), persistent=False)
        self.lora_b = [torch.zeros(num, s.size, rank, dtype=dtype, device=weight.device) for s in slices]
        for i, b in enumerate(self.lora_b):
            self.register_buffer(f"lora_b_{i}", b, persistent=False)

    def shard(self, i: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of slice ``i``'s full ``A [r, in]`` and ``B [out, r]``."""
        base, s = self.base_layer, self.slices[i]
        if self.row_parallel:
            n = base.input_size_per_partition
            return a[:, base.tp_rank * n : (base.tp_rank + 1) * n], b
        return a, b[s.start : s.start + s.size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if not self.row_parallel:
            out = base.quant_method.apply(base, x, base.bias)
            self.state.add_lora(out, x, self)
            if base.gather_output and base.tp_size > 1:
                out = tensor_model_parallel_all_gather(out, dim=-1)
            return out
        if not base.input_is_parallel and base.tp_size > 1:
            size = base.input_size_per_partition
            x = x.narrow(-1, base.tp_rank * size, size)
        if base.tp_size == 1:
            out = base.quant_method.apply(base, x, base.bias)
            self.state.add_lora(out, x, self)
            return out
        out = base.quant_method.apply(base, x, None)
        # NOTE: a partial update on each rank (A's input shard); the all-reduce sums it.
        self.state.add_lora(out, x, self)
        if base.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        if base.bias is not None and base.reduce_results:
            out = out + base.bias
        return out

    def extra_repr(self) -> str:
        return f"slices={[s.module.rsplit('.', 1)[-1] for s in self.slices]}"
