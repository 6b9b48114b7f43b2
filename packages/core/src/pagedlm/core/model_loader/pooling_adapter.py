"""Base-model checkpoints for pooling models: what sentence-transformers (and ``AutoModel``) save.

Such a checkpoint names a body class (``architectures: ["Qwen3Model"]``) and stores the body's
weights without the ``model.`` prefix and without an LM head. A pooling model
(``runner="pooling"``) runs it with the family's ``XForCausalLM`` class: the weights are renamed
into its ``model.`` body and the head, which pooling never reads, may stay unloaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def _base_model_architectures(model_config: Any) -> list[str]:
    return [a for a in model_config.architectures if a.endswith("Model") and not a.endswith("ForCausalLM")]


def model_architectures(model_config: Any) -> list[str]:
    """The architectures to look up: for a pooling model, each base ``XModel`` also as ``XForCausalLM``."""
    archs = list(model_config.architectures)
    if model_config.runner == "pooling":
        archs += [a.removesuffix("Model") + "ForCausalLM" for a in _base_model_architectures(model_config)]
    return archs


def is_base_model_checkpoint(model_config: Any) -> bool:
    return model_config.runner == "pooling" and bool(_base_model_architectures(model_config))


def prefix_body_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Body weights (``layers.0...``, ``embed_tokens.weight``, ``norm.weight``) as ``model.*``."""
    for name, tensor in weights:
        yield (name if name.startswith(("model.", "lm_head.")) else f"model.{name}"), tensor


def mark_head_optional(model: torch.nn.Module) -> None:
    """The LM head of a pooling model need not come from the checkpoint (pooling never reads it)."""
    head = getattr(model, "lm_head", None)
    if head is not None:
        for param in head.parameters():
            param.optional_in_checkpoint = True  # type: ignore[attr-defined]
