"""Resolving ``LLM(logits_processors=[...])`` and building the processors of one worker."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pagedlm.core.sample.logits_processor.interface import LogitsProcessor
from pagedlm.core.sample.logits_processor.state import LogitsProcessors

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig

def resolve_logits_processor_classes(specs: Sequence[Any] | None) -> list[type[LogitsProcessor]]:
    """The classes ``specs`` name, in order. A spec is a :class:`LogitsProcessor` subclass or its
    fully qualified name ``"package.module:Class"`` (``Outer.Inner`` after the colon works too).
    Raises ValueError naming the spec that is not one."""
    classes: list[type[LogitsProcessor]] = []
    for i, spec in enumerate(specs or ()):
        obj = spec
        if isinstance(spec, str):
            module_name, sep, qualname = spec.partition(":")
            if not sep or not module_name or not qualname:
                raise ValueError(f"logits_processors[{i}]={spec!r} must be 'package.module:Class' (or the class)")
            try:
                obj = importlib.import_module(module_name)
                for attr in qualname.split("."):
                    obj = getattr(obj, attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"logits_processors[{i}]={spec!r} cannot be loaded: {type(e).__name__}: {e}") from e
        if not (isinstance(obj, type) and issubclass(obj, LogitsProcessor)):
            raise ValueError(
                f"logits_processors[{i}]={spec!r} is not a subclass of "
                "pagedlm.core.v1.sample.logits_processor.LogitsProcessor (vLLM's V1 interface)"
            )
        classes.append(obj)
    return classes


def build_logitsprocs(vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> LogitsProcessors:
    """One instance of every configured processor for the worker on ``device``.

    NOTE: pagedlm's built-in processing (logit bias, min tokens, penalties, min-p) lives in the
    sampler itself; this holds the custom processors only (vLLM's ``build_logitsprocs`` adds its
    built-ins here too)."""
    classes = resolve_logits_processor_classes(vllm_config.model_config.logits_processors)
    return LogitsProcessors(cls(vllm_config, device, is_pin_memory) for cls in classes)
