"""Choose the attention backend class for a config (through the plugin registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedlm.core.attention.backend import AttentionBackend
from pagedlm.core.plugins import get_plugins, resolve_class_path

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig


def get_attn_backend_cls(vllm_config: VllmConfig) -> type[AttentionBackend]:
    from pagedlm.core.platforms import resolve_platform

    name = vllm_config.attention_backend
    if name is None:
        name = resolve_platform(vllm_config.device_config.device).get_attn_backend_name(vllm_config)
    registry = get_plugins().attention_backends()
    if name not in registry:
        raise ValueError(f"attention_backend={name!r} is not registered; registered: {sorted(registry)}")
    cls = resolve_class_path(registry[name])
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"{registry[name]} is not an AttentionBackend subclass")
    return cls
