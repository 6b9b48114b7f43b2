"""Loading per-expert checkpoint tensors into :class:`FusedMoE`'s stacked parameters.

HF MoE checkpoints store every expert's projections as separate tensors
(``model.layers.0.mlp.experts.7.gate_proj.weight``). :class:`ExpertWeightLoader` takes those out of
a model's weight stream, hands each to its layer's ``weight_loader`` (which keeps this rank's
slice, or nothing for another rank's expert) and lets every other tensor through to the model's
ordinary loading::

    def load_weights(self, weights):
        experts = ExpertWeightLoader(self, FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", num_experts))
        return super().load_weights(experts.filter(weights)) | experts.loaded
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ExpertWeightLoader"]

_EXPERT_PART = re.compile(r"(?:^|\.)(experts\.\d+\.[A-Za-z0-9_]+\.)")


class ExpertWeightLoader:
    """Loads the expert tensors of a weight stream (module docstring).

    ``expert_params_mapping`` is :meth:`FusedMoE.make_expert_params_mapping`'s list. A stacked
    parameter counts as loaded (``loaded``) once every expert's shards of it have arrived, this
    rank's or not, so a checkpoint missing an expert is reported by the model loader.
    """

    def __init__(self, model: nn.Module, expert_params_mapping: Iterable[tuple[str, str, int, str]]) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        # Modules held by another pipeline stage: their tensors are skipped unread.
        self.missing_prefixes = tuple(
            f"{name}." for name, module in model.named_modules() if type(module).__name__ == "PPMissingLayer"
        )
        self.by_weight_name: dict[str, tuple[str, int, str]] = {}
        self.expected: dict[str, int] = {}
        for param_name, weight_name, expert_id, shard_id in expert_params_mapping:
            self.by_weight_name[weight_name] = (param_name, expert_id, shard_id)
            self.expected[param_name] = self.expected.get(param_name, 0) + 1
        self.received: dict[str, set[tuple[int, str]]] = {}
        self.loaded: set[str] = set()

    def filter(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Load the expert tensors of ``weights``; yield every other ``(name, tensor)`` unchanged."""
        for name, tensor in weights:
            match = _EXPERT_PART.search(name)
            entry = self.by_weight_name.get(match.group(1)) if match else None
            if match is None or entry is None:
                yield name, tensor
                continue
            self._load(name, tensor, match, entry)

    def _load(self, name: str, tensor: Any, match: re.Match[str], entry: tuple[str, int, str]) -> None:
        param_name, expert_id, shard_id = entry
        target = name[: match.start(1)] + param_name + name[match.end(1):]
        if self.missing_prefixes and target.startswith(self.missing_prefixes):
            return
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self.model).__name__} "
                             f"(looked for {target!r})")
        with torch.no_grad():
            param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=expert_id)  # type: ignore[attr-defined]
        got = self.received.setdefault(target, set())
        got.add((expert_id, shard_id))
        if len(got) == self.expected[param_name]:
            self.loaded.add(target)
