"""Choose the attention backend class for a config (through the plugin registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedlm.core.attention.backend import AttentionBackend
from pagedlm.core.plugins import get_plugins, resolve_class_path

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig


def get_attn_backend_cls(vllm_config: VllmConfig) -> type[AttentionBackend]:
    from pagedlm.core.platforms import resolve_platform

    platform = resolve_platform(vllm_config.device_config.device)
    name = vllm_config.attention_backend
    if name is None:
        name = platform.get_attn_backend_name(vllm_config)
    registry = get_plugins().attention_backends()
    if name not in registry:
        raise ValueError(f"attention_backend={name!r} is not registered; registered: {sorted(registry)}")
    cls = _backend_class(registry[name])
    if cls.supported_devices is not None and platform.device_name not in cls.supported_devices:
        usable = sorted(other for other, path in registry.items() if _runs_on(path, platform.device_name))
        raise ValueError(
            f"attention_backend={name!r} does not run on device={platform.device_name!r} (it supports "
            f"{', '.join(cls.supported_devices)}); backends for {platform.device_name}: {usable}"
        )
    return cls


def _backend_class(class_path: str) -> type[AttentionBackend]:
    cls = resolve_class_path(class_path)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"{class_path} is not an AttentionBackend subclass")
    return cls


def _runs_on(class_path: str, device_name: str) -> bool:
    try:
        supported = _backend_class(class_path).supported_devices
    except (ImportError, TypeError):
        return False  # a backend whose module cannot load here runs nowhere here
    return supported is None or device_name in supported
