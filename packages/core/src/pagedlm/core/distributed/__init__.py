"""Process groups for tensor and pipeline parallelism.

NOTE: with a single rank (the default) every collective is the identity, so layers written
against this module run unchanged in one process; multi-rank executors call
:func:`init_model_parallel` in each worker before the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    rank_in_group: int = 0
    world_size: int = 1
    group: object | None = None

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


_TP = GroupCoordinator()
_PP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(tensor)


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(tensor, dim)


def init_model_parallel(tp_rank: int, tp_size: int, tp_group: object | None,
                        pp_rank: int = 0, pp_size: int = 1, pp_group: object | None = None) -> None:
    global _TP, _PP
    _TP = GroupCoordinator(tp_rank, tp_size, tp_group)
    _PP = GroupCoordinator(pp_rank, pp_size, pp_group)
