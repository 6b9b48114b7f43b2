"""Build a KV connector half from ``vllm_config.kv_transfer_config`` (the registry's class)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagedlm.core.distributed.kv_transfer.base import KVCacheInfo, KVConnectorBase_V1, KVConnectorRole
from pagedlm.core.logger import init_logger

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig

logger = init_logger(__name__)


def get_connector_class(vllm_config: VllmConfig) -> type[KVConnectorBase_V1]:
    """The class ``kv_transfer_config`` names: a registered connector, or (vLLM's
    ``kv_connector_module_path``) class ``kv_connector`` of that module."""
    from pagedlm.core.plugins import get_plugins, resolve_class_path

    cfg = vllm_config.kv_transfer_config
    assert cfg is not None and cfg.kv_connector
    if cfg.kv_connector_module_path:
        module = importlib.import_module(cfg.kv_connector_module_path)
        cls = getattr(module, cfg.kv_connector, None)
        if cls is None:
            raise ValueError(f"kv_transfer_config.kv_connector={cfg.kv_connector!r}: module "
                             f"{cfg.kv_connector_module_path!r} has no such class")
    else:
        registry = get_plugins().kv_connectors()
        if cfg.kv_connector not in registry:
            raise ValueError(f"kv_transfer_config.kv_connector={cfg.kv_connector!r} is not a registered KV connector; "
                             f"registered: {', '.join(sorted(registry))} (plugins add more through "
                             "pagedlm_register_kv_connectors)")
        cls = resolve_class_path(registry[cfg.kv_connector])
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ValueError(f"kv_transfer_config.kv_connector={cfg.kv_connector!r} is {cls!r}, not a "
                         "KVConnectorBase_V1 subclass")
    return cls


def create_kv_connector(vllm_config: VllmConfig, role: KVConnectorRole,
                        kv_cache_config: KVCacheInfo) -> KVConnectorBase_V1 | None:
    """The connector half of ``role``, or None without a ``kv_transfer_config``."""
    if vllm_config.kv_transfer_config is None:
        return None
    cls = get_connector_class(vllm_config)
    connector = cls(vllm_config, role, kv_cache_config)
    logger.info("KV connector %s (%s, %s)", cls.__name__, vllm_config.kv_transfer_config.kv_role, role.name.lower())
    return connector


def check_kv_transfer_config(vllm_config: VllmConfig) -> None:
    """Refuse what the connectors do not support yet (called by ``VllmConfig.finalize``)."""
    cfg = vllm_config.kv_transfer_config
    if cfg is None:
        return
    get_connector_class(vllm_config)  # an unknown name fails in the front end, not in a worker
    pc = vllm_config.parallel_config
    if pc.world_size > 1:
        raise ValueError(f"kv_transfer_config works with one rank per engine for now; got tensor_parallel_size="
                         f"{pc.tensor_parallel_size}, pipeline_parallel_size={pc.pipeline_parallel_size}")
    if not vllm_config.cache_config.enable_prefix_caching:
        raise ValueError("kv_transfer_config needs enable_prefix_caching=True (connectors find and name KV blocks "
                         "by their prefix-cache hashes)")
