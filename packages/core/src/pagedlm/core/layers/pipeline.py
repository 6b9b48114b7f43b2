"""Building only this pipeline stage's part of a model.

With ``pp`` stages, decoder layer ``i`` lives on stage ``s`` when ``i`` is in
``pp_layer_range(num_layers, s, pp)``; the embedding lives on the first stage and the final norm
and LM head on the last. Modules a stage does not own are :class:`PPMissingLayer` placeholders:
they hold no parameters (so the loader skips their checkpoint tensors and no memory is spent)
and keep module names and indices identical on every stage (``model.layers.7`` is still layer 7).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pagedlm.core.distributed import get_pp_group

__all__ = ["PPMissingLayer", "is_pp_missing", "make_layers", "pp_layer_range"]


class PPMissingLayer(nn.Identity):
    """Stands in for a module that lives on another pipeline stage."""


def is_pp_missing(module: nn.Module) -> bool:
    return isinstance(module, PPMissingLayer)


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the layers of stage ``pp_rank``: an even split, the first stages
    taking one extra layer each when ``num_layers`` does not divide."""
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers; every stage "
            "needs at least one layer"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """``(start, end, layers)``: ``build(i)`` for this stage's layers, placeholders elsewhere."""
    pp = get_pp_group()
    start, end = pp_layer_range(num_layers, pp.rank_in_group, pp.world_size)
    layers = nn.ModuleList(build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers))
    return start, end, layers
