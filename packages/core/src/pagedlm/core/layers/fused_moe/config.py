"""Where a :class:`~pagedlm.core.layers.fused_moe.FusedMoE` layer's experts live across ranks.

Two placements over the tensor-parallel group of ``tp`` ranks (vLLM's, for one data-parallel
replica):

- **tensor parallel** (the default): every rank holds every expert, each sliced along its
  intermediate dimension: rank ``r`` keeps rows ``[r * I/tp, (r+1) * I/tp)`` of each expert's gate
  and up projections and the same columns of its down projection. Every rank computes every
  routed token on its slices; the partial outputs are summed across the group.
- **expert parallel** (``enable_expert_parallel=True``): whole experts are split across the
  ranks: rank ``r`` holds experts ``[start_r, start_r + n_r)``, ``E // tp`` each, the first
  ``E % tp`` ranks one more. Every rank sees every token (hidden states are replicated in the TP
  group), computes only the (token, expert) pairs of its experts and writes zeros for the others;
  the same all-reduce sums them. ``expert_map[global id] = local id or -1`` tells the ops which
  experts are local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FusedMoEParallelConfig", "determine_expert_map"]


@dataclass(frozen=True)
class FusedMoEParallelConfig:
    """How one MoE layer is split: ``tp_size``/``tp_rank`` slice each expert's intermediate
    dimension, ``ep_size``/``ep_rank`` split the experts. One of the two sizes is always 1."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def use_ep(self) -> bool:
        return self.ep_size > 1

    @staticmethod
    def make(tp_size: int, tp_rank: int, enable_expert_parallel: bool) -> FusedMoEParallelConfig:
        """The placement over a tensor-parallel group of ``tp_size`` ranks (this one ``tp_rank``)."""
        if enable_expert_parallel and tp_size > 1:
            return FusedMoEParallelConfig(1, 0, tp_size, tp_rank)
        return FusedMoEParallelConfig(tp_size, tp_rank, 1, 0)


def local_expert_range(ep_size: int, ep_rank: int, global_num_experts: int) -> tuple[int, int]:
    """``(first global expert id, number of experts)`` on rank ``ep_rank``: a contiguous block,
    ``E // ep_size`` each and the first ``E % ep_size`` ranks one more."""
    if global_num_experts < ep_size:
        raise ValueError(
            f"expert parallelism over {ep_size} ranks needs at least {ep_size} experts; the model has "
            f"{global_num_experts}"
        )
    base, extra = divmod(global_num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return start, base + (1 if ep_rank < extra else 0)


def determine_expert_map(ep_size: int, ep_rank: int, global_num_experts: int) -> tuple[int, torch.Tensor | None]:
    """``(local_num_experts, expert_map)``: ``expert_map [E] int32`` holds each global expert's
    index on this rank, or -1 where it lives on another rank; None without expert parallelism."""
    if ep_size == 1:
        return global_num_experts, None
    start, count = local_expert_range(ep_size, ep_rank, global_num_experts)
    expert_map = torch.full((global_num_experts,), -1, dtype=torch.int32)
    expert_map[start : start + count] = torch.arange(count, dtype=torch.int32)
    return count, expert_map
