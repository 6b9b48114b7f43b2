"""Vocabulary-parallel token embedding, LM head and logits.

With ``tp`` ranks the vocabulary ``V`` is padded to ``V_pad`` (a multiple of ``tp``) and rank
``r`` holds rows ``[r * V_pad/tp, (r+1) * V_pad/tp)`` of the ``[V_pad, hidden]`` table; rows
``>= V`` are zero padding and never produce logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.core.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedlm.core.layers.linear import load_param_shard
from pagedlm.core.layers.quantization.base_config import LinearMethodBase
from pagedlm.core.model_loader.weight_utils import set_weight_attrs

__all__ = ["LogitsProcessor", "ParallelLMHead", "VocabParallelEmbedding", "compute_logits"]


class VocabParallelEmbedding(nn.Module):
    """``input_ids [T] -> [T, embedding_dim]``; each rank looks up the ids in its vocab range
    and the ranks all-reduce (every id is owned by exactly one rank).

    ``quant_config``: a method it gives for ``prefix`` (``GGUFEmbeddingMethod``,
    ``CompressedTensorsEmbeddingMethod``) creates the table in its own layout and computes the
    lookup of this rank's rows (``embedding``) and, for a tied head, the logits (``apply``, where
    ``computes_logits``); without one the table is ``weight [V_r, embedding_dim]`` in full
    precision.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_config: Any = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        #: this rank's vocab range [vocab_start, vocab_end) in real (unpadded) ids
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.params_dtype = dtype
        self.quant_method = self._get_quant_method(quant_config, prefix)
        if isinstance(self.quant_method, LinearMethodBase):
            self._create_linear_weights()
            return
        if self.quant_method is not None:
            self.quant_method.create_weights(self, self.num_embeddings_per_partition, embedding_dim, dtype)
            return
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype), requires_grad=False
        )
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def _get_quant_method(self, quant_config: Any, prefix: str) -> Any:
        if quant_config is None or not quant_config.quantizes_embeddings:
            return None
        return quant_config.get_quant_method(self, prefix)

    def _create_linear_weights(self) -> None:
        """A head quantized like the linear layers: the method's parameters of a column-parallel
        ``[hidden -> V_pad]`` layer, this rank's ``V_r`` vocab rows as its output features."""
        self.input_size = self.input_size_per_partition = self.embedding_dim
        self.output_size = self.num_embeddings_padded
        self.output_size_per_partition = self.num_embeddings_per_partition
        self.output_partition_sizes = [self.num_embeddings_per_partition]
        self.quant_method.create_weights(self, self.embedding_dim, self.output_partition_sizes, self.embedding_dim,
                                         self.num_embeddings_padded, self.params_dtype,
                                         weight_loader=self._linear_weight_loader)
        for param in self.parameters():
            param.data.zero_()  # NOTE: padding rows keep zero scales, so padded logits are 0

    def _linear_weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """A quantized head's checkpoint tensor (all ``V`` rows along its output dimension): this
        rank's vocab rows."""
        out_dim = getattr(param, "output_dim", None)
        if out_dim is not None:
            packed = getattr(param, "packed_dim", None) == out_dim
            rows = loaded_weight.shape[out_dim] * (param.packed_factor if packed else 1)
            if rows != self.num_embeddings:
                raise ValueError(f"{self.prefix}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                                 f"{rows} vocabulary rows where the model has {self.num_embeddings}")
        load_param_shard(param, loaded_weight, name=self.prefix, offset=0, size=self.vocab_end - self.vocab_start,
                         start=self.vocab_start)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """``loaded_weight [V, hidden]``, the full checkpoint table; copies rows of this rank."""
        if loaded_weight.shape[0] != self.num_embeddings or loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"{self.prefix}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected "
                f"({self.num_embeddings}, {param.shape[1]})"
            )
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight.narrow(0, self.vocab_start, n))
        # NOTE: padding rows stay zero so padded logits are 0 before they are sliced off.
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = self._lookup(local_ids)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return tensor_model_parallel_all_reduce(out)

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``local_ids`` of this rank's table (a quantize method decodes them)."""
        if self.quant_method is not None:
            return self.quant_method.embedding(self, local_ids)
        return F.embedding(local_ids, self.weight)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, per_partition={self.num_embeddings_per_partition}, "
            f"embedding_dim={self.embedding_dim}, tp_size={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection ``hidden -> vocab``, sharded like :class:`VocabParallelEmbedding`.

    It is not called directly; :class:`LogitsProcessor` multiplies by its ``weight``, or runs the
    linear method of a checkpoint that quantizes the head (``quant_config.lm_head_quantized``).
    """

    def _get_quant_method(self, quant_config: Any, prefix: str) -> Any:
        if quant_config is not None and quant_config.lm_head_quantized:
            return quant_config.get_quant_method(self, prefix)
        return super()._get_quant_method(quant_config, prefix)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the embedding table (``tie_word_embeddings``): one Parameter, loaded once, and its
        quantize method (a quantized table computes the logits too)."""
        if isinstance(self.quant_method, LinearMethodBase):
            # NOTE: a checkpoint that quantizes the head stores it apart from the embedding (as
            # vLLM reads such files): nothing to share
            return self
        if not getattr(embedding.quant_method, "computes_logits", True):
            raise ValueError(f"{embedding.prefix}: this checkpoint keeps the embedding table packed, and a model "
                             "that ties its LM head to it (tie_word_embeddings) would need that table's logits, "
                             "which the packed layout has no kernel for; list the embedding in the quantization "
                             "config's ignore list")
        mine = (self.num_embeddings_per_partition, self.embedding_dim)
        theirs = (embedding.num_embeddings_per_partition, embedding.embedding_dim)
        if mine != theirs:
            raise ValueError(f"cannot tie lm_head {mine} to embedding {theirs}")
        self.weight = embedding.weight
        self.quant_method = embedding.quant_method
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - misuse guard
        raise RuntimeError("ParallelLMHead is applied through LogitsProcessor, not called directly")


def compute_logits(lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor, vocab_size: int | None = None,
                   scale: float = 1.0, soft_cap: float | None = None, float32: bool = True) -> torch.Tensor:
    """``hidden_states [N, hidden] -> logits [N, vocab_size]`` float32, gathered across TP ranks.

    The matmul runs in the model dtype (as HF's ``lm_head`` does) and the result is cast to
    float32; padding columns of the vocab are dropped. ``float32=False`` skips the cast when there
    is no scale or soft cap (the result is then a view in the model dtype, row stride free).
    """
    method = lm_head.quant_method
    logits = F.linear(hidden_states, lm_head.weight) if method is None else method.apply(lm_head, hidden_states)
    if lm_head.tp_size > 1:
        # NOTE: rank r's columns are vocab rows [r*V_pad/tp, ...), so concatenating in rank
        # order restores vocab order.
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
    logits = logits[..., : vocab_size or lm_head.num_embeddings]
    if not float32 and scale == 1.0 and soft_cap is None:
        return logits
    logits = logits.float()
    if scale != 1.0:
        logits = logits * scale
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    return logits


class LogitsProcessor(nn.Module):
    """Module wrapper around :func:`compute_logits`:
    ``forward(lm_head, hidden_states [N, hidden]) -> [N, vocab_size]`` float32, or in the model
    dtype when ``float32_output`` is off and there is no scale or soft cap."""

    def __init__(self, vocab_size: int, scale: float = 1.0, soft_cap: float | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = scale
        self.soft_cap = soft_cap
        #: NOTE: a model runner turns this off when everything downstream casts for itself (the
        #: sampler does: argmax and Gumbel-max pick the same ids on an exact upcast, logprobs
        #: and logits processing cast to float32), saving a [B, vocab] float32 copy per step.
        self.float32_output = True

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        return compute_logits(lm_head, hidden_states, self.vocab_size, self.scale, self.soft_cap,
                              float32=self.float32_output)
