"""Process groups for tensor and pipeline parallelism.

Rank layout (vLLM's): with ``tp`` ranks per stage and ``pp`` stages there are ``tp * pp`` ranks
and global rank ``r = pp_rank * tp + tp_rank``. The tensor-parallel group of stage ``s`` is
``[s * tp, (s + 1) * tp)``; the pipeline group of TP rank ``t`` is ``{t, t + tp, t + 2 tp, ...}``,
so stage ``s`` sends its activations from rank ``r`` to rank ``r + tp`` (same TP rank, next stage).
The output rank (the one whose sampled tokens the engine reads) is TP rank 0 of the last stage,
``(pp - 1) * tp``.

NOTE: with a single rank (the default) every collective is the identity, so layers written
against this module run unchanged in one process; multi-rank executors call
:func:`init_distributed_environment` and :func:`initialize_model_parallel` in each worker
before the model is built.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    rank_in_group: int = 0
    world_size: int = 1
    group: object | None = None
    #: global ranks of the group's members, in group order (``ranks[rank_in_group]`` is us)
    ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ranks:
            self.ranks = list(range(self.world_size))

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    # -- point to point between neighbouring pipeline stages ----------------------------------
    def send_to_next(self, tensor: torch.Tensor) -> None:
        dist.send(tensor.contiguous(), dst=self.ranks[self.rank_in_group + 1], group=self.group)

    def recv_from_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=self.ranks[self.rank_in_group - 1], group=self.group)
        return out


class IntermediateTensors(dict):
    """Activations handed from one pipeline stage to the next (``name -> [T, hidden]``).

    Llama-style models pass ``hidden_states`` and ``residual``; the keys are the model's to pick,
    in a fixed order (the receiver allocates buffers by the same names, see
    :func:`pp_tensor_names`).
    """


#: names of the tensors a non-last stage hands on, in send order (every model in tree uses these)
PP_TENSOR_NAMES = ("hidden_states", "residual")

_TP = GroupCoordinator()
_PP = GroupCoordinator()
_WORLD = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_world_group() -> GroupCoordinator:
    return _WORLD


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_pipeline_model_parallel_rank() -> int:
    return _PP.rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    return _PP.world_size


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(tensor)


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(tensor, dim)


def init_model_parallel(tp_rank: int, tp_size: int, tp_group: object | None,
                        pp_rank: int = 0, pp_size: int = 1, pp_group: object | None = None,
                        tp_ranks: list[int] | None = None, pp_ranks: list[int] | None = None) -> None:
    """Install already-created groups (tests, or :func:`initialize_model_parallel`)."""
    global _TP, _PP
    _TP = GroupCoordinator(tp_rank, tp_size, tp_group, list(tp_ranks or []))
    _PP = GroupCoordinator(pp_rank, pp_size, pp_group, list(pp_ranks or []))


# -- rank layout ------------------------------------------------------------------------------


def global_rank(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    return pp_rank * tp_size + tp_rank


def tp_group_ranks(tp_size: int, pp_size: int) -> Iterator[list[int]]:
    for stage in range(pp_size):
        yield [global_rank(stage, t, tp_size) for t in range(tp_size)]


def pp_group_ranks(tp_size: int, pp_size: int) -> Iterator[list[int]]:
    for t in range(tp_size):
        yield [global_rank(stage, t, tp_size) for stage in range(pp_size)]


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank whose sampled tokens are returned: TP rank 0 of the last pipeline stage."""
    return global_rank(pp_size - 1, 0, tp_size)


# -- set-up and tear-down ---------------------------------------------------------------------


def init_distributed_environment(*, world_size: int, rank: int, init_method: str, backend: str,
                                 timeout_s: float = 600.0) -> None:
    """Join the default process group (no-op for one rank or when already joined)."""
    global _WORLD
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _WORLD = GroupCoordinator(rank, world_size, dist.group.WORLD if world_size > 1 else None)


def initialize_model_parallel(tp_size: int, pp_size: int, backend: str | None = None) -> None:
    """Create the TP and PP groups of the layout above and install this rank's.

    Every rank must call this (``new_group`` is collective over the default group, in the same
    order everywhere).
    """
    world = tp_size * pp_size
    if world == 1:
        init_model_parallel(0, 1, None)
        return
    rank = dist.get_rank()
    if dist.get_world_size() != world:
        raise RuntimeError(f"process group has {dist.get_world_size()} ranks but tp x pp = {world}")
    tp_info = pp_info = None
    for ranks in tp_group_ranks(tp_size, pp_size):
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            tp_info = (ranks.index(rank), group, ranks)
    for ranks in pp_group_ranks(tp_size, pp_size):
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            pp_info = (ranks.index(rank), group, ranks)
    assert tp_info is not None and pp_info is not None
    init_model_parallel(tp_info[0], tp_size, tp_info[1], pp_info[0], pp_size, pp_info[1],
                        tp_ranks=tp_info[2], pp_ranks=pp_info[2])


def destroy_distributed_environment() -> None:
    global _WORLD
    init_model_parallel(0, 1, None)
    _WORLD = GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's clean-up between engines in one process: the process groups destroyed, garbage
    collected, the device's cached memory returned (and Ray shut down with ``shutdown_ray``)."""
    import gc

    from pagedlm.core.platforms import resolve_platform

    destroy_distributed_environment()
    if shutdown_ray:
        try:
            import ray
        except ImportError:
            pass
        else:
            ray.shutdown()
    gc.collect()
    resolve_platform("auto").empty_cache()


# -- pipeline forward -------------------------------------------------------------------------


def pp_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, *,
               hidden_size: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Run this stage's layers: receive activations from the previous stage, send them on.

    Returns the final hidden states on the last stage and ``None`` elsewhere. Every stage
    knows the step's token count from the (broadcast) scheduler output, so receive buffers are
    allocated without exchanging shapes first.
    """
    pp = _PP
    intermediate = None
    if not pp.is_first_rank:
        shape = (int(positions.shape[0]), hidden_size)
        intermediate = IntermediateTensors(
            {name: pp.recv_from_prev(shape, dtype, positions.device) for name in PP_TENSOR_NAMES}
        )
    out = model(input_ids, positions, intermediate_tensors=intermediate)
    if pp.is_last_rank:
        return out
    assert isinstance(out, IntermediateTensors), "a non-last pipeline stage must return IntermediateTensors"
    for name in PP_TENSOR_NAMES:
        pp.send_to_next(out[name])
    return None
