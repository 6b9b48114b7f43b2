"""Resolving ``LLM(logits_processors=[...])`` and building the processors of one worker.

Installed packages can also add processors to every engine, as vLLM's plugins do: an entry point
in the group ``vllm.logits_processors`` (vLLM's) or ``pagedlm.logits_processors`` whose value is
a ``"module:Class"``. They come before the configured ones; a class named both ways runs once.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pagedlm.core.sample.logits_processor.interface import LogitsProcessor
from pagedlm.core.sample.logits_processor.state import LogitsProcessors

if TYPE_CHECKING:
    from pagedlm.core.config import ModelConfig, VllmConfig

#: entry-point groups whose processors every engine loads
ENTRY_POINT_GROUPS = ("vllm.logits_processors", "pagedlm.logits_processors")


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


@functools.cache
def _installed_entry_points() -> tuple[tuple[str, importlib.metadata.EntryPoint], ...]:
    # one scan of the installed distributions per process (the front end and every worker ask)
    return tuple((group, ep) for group in ENTRY_POINT_GROUPS
                 for ep in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name))


def installed_logits_processor_classes() -> list[type[LogitsProcessor]]:
    """The classes of the installed entry points of :data:`ENTRY_POINT_GROUPS`, by group then
    name. Raises ValueError naming an entry point that does not load or is not a processor."""
    classes: list[type[LogitsProcessor]] = []
    for group, ep in _installed_entry_points():
        try:
            obj = ep.load()
        except Exception as e:  # any failure of a third party's import
            raise ValueError(f"the {group} entry point {ep.name}={ep.value!r} cannot be loaded: "
                             f"{type(e).__name__}: {e}") from e
        if not (isinstance(obj, type) and issubclass(obj, LogitsProcessor)):
            raise ValueError(f"the {group} entry point {ep.name}={ep.value!r} is not a subclass of "
                             "pagedlm.core.v1.sample.logits_processor.LogitsProcessor")
        classes.append(obj)
    return classes


def configured_logits_processor_classes(model_config: ModelConfig) -> list[type[LogitsProcessor]]:
    """The installed processors, then ``model_config.logits_processors``, each class once."""
    classes = installed_logits_processor_classes() + resolve_logits_processor_classes(model_config.logits_processors)
    return list(dict.fromkeys(classes))


def build_logitsprocs(vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> LogitsProcessors:
    """One instance of every configured processor for the worker on ``device``.

    NOTE: pagedlm's built-in processing (logit bias, min tokens, penalties, min-p) lives in the
    sampler itself; this holds the custom processors only (vLLM's ``build_logitsprocs`` adds its
    built-ins here too)."""
    classes = configured_logits_processor_classes(vllm_config.model_config)
    return LogitsProcessors(cls(vllm_config, device, is_pin_memory) for cls in classes)
