"""Mixture-of-experts: the ``FusedMoE`` layer, its routing, expert placement and weight loading.

- :class:`FusedMoE` (``layer.py``): stacked expert weights ``w13_weight [E, 2I, H]`` and
  ``w2_weight [E, H, I]``, the per-expert weight loader, TP slicing of each expert's intermediate
  dimension or whole experts per rank (expert parallelism), the ``fused_experts`` op;
- :func:`fused_topk` (``routing.py``): softmax top-k routing, with or without renormalisation;
- :func:`fused_experts`, :func:`moe_align_block_size` (``reference.py``): core's torch op (sorted
  by expert, grouped matmuls) and the block-aligned layout fused kernels use;
- :class:`FusedMoEParallelConfig`, :func:`determine_expert_map` (``config.py``): expert placement;
- :class:`ExpertWeightLoader` (``weights.py``): per-expert checkpoint tensors into the layers.
"""

from pagedlm.core.layers.fused_moe.config import FusedMoEParallelConfig, determine_expert_map
from pagedlm.core.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase, UnquantizedFusedMoEMethod
from pagedlm.core.layers.fused_moe.reference import fused_experts, moe_align_block_size
from pagedlm.core.layers.fused_moe.routing import fused_topk
from pagedlm.core.layers.fused_moe.weights import ExpertWeightLoader

__all__ = [
    "ExpertWeightLoader",
    "FusedMoE",
    "FusedMoEMethodBase",
    "FusedMoEParallelConfig",
    "UnquantizedFusedMoEMethod",
    "determine_expert_map",
    "fused_experts",
    "fused_topk",
    "moe_align_block_size",
]
