"""Context shared by the model runner and the layers during construction and forward.

During model construction, :func:`set_current_vllm_config` makes the config and the selected
attention backend visible to :class:`pagedlm.core.attention.Attention` layers (so model code
never names a backend). During a forward pass, :func:`set_forward_context` publishes the step's
attention metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedlm.core.attention.backend import AttentionBackend
    from pagedlm.core.config import VllmConfig


@dataclass
class BuildContext:
    vllm_config: VllmConfig
    attn_backend: type[AttentionBackend]
    #: layer prefix -> Attention module, filled as layers are constructed
    attention_layers: dict[str, Any] = field(default_factory=dict)


@dataclass
class ForwardContext:
    #: the backend metadata of this step: a list indexed by KV-cache group id (each layer reads
    #: its group's), or one object every layer shares (a single group; start-up passes; tests)
    attn_metadata: Any


_build_context: BuildContext | None = None
_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_current_vllm_config(vllm_config: VllmConfig, attn_backend: type[AttentionBackend]) -> Iterator[BuildContext]:
    global _build_context
    previous = _build_context
    _build_context = BuildContext(vllm_config, attn_backend)
    try:
        yield _build_context
    finally:
        _build_context = previous


def get_build_context() -> BuildContext:
    if _build_context is None:
        raise RuntimeError(
            "model layers must be constructed inside set_current_vllm_config(); "
            "build models through the model runner or pagedlm.core.testing helpers"
        )
    return _build_context


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("attention called outside set_forward_context()")
    return _forward_context
