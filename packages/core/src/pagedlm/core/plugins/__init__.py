"""The pagedlm plugin system: a typed facade over a pluggy plugin manager.

Plugins are modules named by entry points in group ``pagedlm``. Loading is lazy (on the first
call that needs a registry), idempotent and safe in every process. Built-in packages
(pagedlm-backend-cpu, pagedlm-models-llama, ...) load through exactly the same path. How
registrations are ordered and how conflicts between plugins are settled: ``registrations.py``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from pagedlm.core import envs
from pagedlm.core.logger import init_logger
from pagedlm.core.plugins import hookspecs
from pagedlm.core.plugins.registrations import (
    Parser,
    PluginError,
    Registration,
    call_registration_hook,
    resolve_conflicts,
)

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig

logger = init_logger(__name__)

PROJECT_NAME = "pagedlm"
#: the name under which pagedlm-core's own hook implementations are registered
CORE_PLUGIN_NAME = "core"
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: The plugin contract's version, ``"major.minor"``. The major number goes up when a change can
#: break an existing plugin (a hook or a ``register`` argument removed or changed, an op
#: contract changed); the minor number when something is only added (a hook, an optional
#: ``register`` keyword, an op contract). A plugin checks the major number it was written for.
API_VERSION = "1.11"

__all__ = [
    "API_VERSION",
    "hookimpl",
    "OpSpec",
    "PlatformSpec",
    "PluginError",
    "PluginLoadFailure",
    "Plugins",
    "Registration",
    "get_plugins",
    "resolve_class_path",
]


@dataclass(frozen=True)
class PlatformSpec:
    name: str
    class_path: str
    is_available: Callable[[], bool]
    priority: int
    plugin: str


@dataclass(frozen=True)
class OpSpec:
    """One implementation of a layer op for one platform (``pagedlm_register_ops``)."""

    op_name: str
    platform: str
    function_path: str
    plugin: str


@dataclass(frozen=True)
class PluginLoadFailure:
    name: str
    distribution: str | None
    error: str


def resolve_class_path(class_path: str) -> Any:
    """Import ``"package.module:Attr"`` and return the attribute."""
    module_name, sep, attr = class_path.partition(":")
    if not sep or not attr:
        raise ValueError(f"class path {class_path!r} must look like 'package.module:Class'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r} ({class_path})") from e


class Plugins:
    """Typed access to every hook. Use :func:`get_plugins` for the process-wide instance."""

    def __init__(self, *, autoload: bool = True) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._autoload = autoload
        self._loaded = False
        self._lock = threading.RLock()
        self.failures: list[PluginLoadFailure] = []
        # plugin name -> distribution name, for messages
        self.distributions: dict[str, str | None] = {}
        # Core's own registrations (its built-in quantization methods) go through the same hooks,
        # always (autoload and the allow-list choose plugins, not core); plugin_names() omits it.
        from pagedlm.core.plugins import core_plugin

        self._pm.register(core_plugin, name=CORE_PLUGIN_NAME)
        self.distributions[CORE_PLUGIN_NAME] = "pagedlm-core"

    # -- loading ---------------------------------------------------------------------------
    def load(self) -> None:
        """Load every entry point in group ``pagedlm`` once (honouring the env allow-list)."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if not self._autoload or envs.disable_plugin_autoload():
                return
            allow = envs.plugins_allow_list()
            for ep in sorted(importlib.metadata.entry_points(group=PROJECT_NAME), key=lambda e: e.name):
                if allow is not None and ep.name not in allow:
                    continue
                if self._pm.has_plugin(ep.name):
                    continue
                dist = ep.dist.name if ep.dist is not None else None
                try:
                    module = ep.load()
                except Exception as e:  # noqa: BLE001 - any import error is reported, not raised
                    msg = f"{type(e).__name__}: {e}"
                    self.failures.append(PluginLoadFailure(ep.name, dist, msg))
                    logger.warning("pagedlm plugin %r (%s) failed to load: %s", ep.name, dist, msg)
                    continue
                self._pm.register(module, name=ep.name)
                self.distributions[ep.name] = dist

    def register(self, plugin: ModuleType | object, name: str | None = None) -> None:
        """Register a plugin object directly (tests, embedding applications)."""
        with self._lock:
            self._pm.register(plugin, name=name)
            self.distributions.setdefault(name or self._pm.get_name(plugin) or "?", None)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._pm.unregister(name=name)

    @property
    def hook(self) -> Any:
        self.load()
        return self._pm.hook

    def plugin_names(self) -> list[str]:
        self.load()
        return [name for name, _ in self._pm.list_name_plugin() if name != CORE_PLUGIN_NAME]

    # -- typed registries ---------------------------------------------------------------------
    def collect(self, hook_name: str, parse: Parser, what: str) -> dict[Hashable, Registration]:
        """Call registration hook ``hook_name`` of every plugin in pluggy's order and return the
        winning registration per key. ``parse(*args, **kwargs) -> (key, value)`` takes what a
        plugin passed to ``register`` (``override`` aside). Raises :class:`PluginError` when two
        plugins claim one key and neither overrides, naming both (what: the kind of key)."""
        self.load()
        registrations = call_registration_hook(self._pm, hook_name, parse)
        return resolve_conflicts(registrations, what, self._describe)

    def _describe(self, plugin: str) -> str:
        dist = self.distributions.get(plugin)
        return f"{plugin!r} ({dist})" if dist else repr(plugin)

    def models(self) -> dict[str, str]:
        """Architecture name -> ``"module:Class"``."""
        regs = self.collect("pagedlm_register_models", _model, "architecture")
        return {str(key): reg.value for key, reg in regs.items()}

    def multimodal_processors(self) -> dict[str, str]:
        """Architecture name -> ``"module:Class"`` of its multimodal input processor."""
        regs = self.collect("pagedlm_register_multimodal_processors", _model, "multimodal architecture")
        return {str(key): reg.value for key, reg in regs.items()}

    def attention_backends(self) -> dict[str, str]:
        """Attention backend name -> ``"module:Class"``."""
        regs = self.collect("pagedlm_register_attention_backends", _attention_backend, "attention backend")
        return {str(key): reg.value for key, reg in regs.items()}

    def platforms(self) -> list[PlatformSpec]:
        regs = self.collect("pagedlm_register_platforms", _platform, "platform")
        return [PlatformSpec(plugin=reg.plugin, **reg.value) for reg in regs.values()]

    def ops(self) -> list[OpSpec]:
        """Every layer-op implementation, one per ``(op_name, platform)``; the names are not
        checked here (that is :mod:`pagedlm.core.layers.custom_ops`'s business)."""
        regs = self.collect("pagedlm_register_ops", _op, "layer op (op name, platform)")
        return [OpSpec(*reg.key, function_path=reg.value, plugin=reg.plugin) for reg in regs.values()]

    def quantization_methods(self) -> dict[str, str]:
        """Quantization method name -> ``"module:Class"`` of its ``QuantizationConfig``."""
        regs = self.collect("pagedlm_register_quantization_methods", _quantization_method, "quantization method")
        return {str(key): reg.value for key, reg in regs.items()}

    def kv_connectors(self) -> dict[str, str]:
        """KV connector name -> ``"module:Class"`` (``pagedlm_register_kv_connectors``)."""
        regs = self.collect("pagedlm_register_kv_connectors", _named_class, "KV connector")
        return {str(key): reg.value for key, reg in regs.items()}

    def structured_output_backends(self) -> dict[str, str]:
        """Structured-output backend name -> ``"module:Class"``."""
        regs = self.collect("pagedlm_register_structured_output_backends", _named_class, "structured-output backend")
        return {str(key): reg.value for key, reg in regs.items()}

    def reasoning_parsers(self) -> dict[str, str]:
        """Reasoning parser name -> ``"module:Class"``."""
        regs = self.collect("pagedlm_register_reasoning_parsers", _named_class, "reasoning parser")
        return {str(key): reg.value for key, reg in regs.items()}

    def tool_parsers(self) -> dict[str, str]:
        """Tool-call parser name -> ``"module:Class"``."""
        regs = self.collect("pagedlm_register_tool_parsers", _named_class, "tool parser")
        return {str(key): reg.value for key, reg in regs.items()}

    def spec_proposers(self) -> dict[str, str]:
        """Speculative-decoding method name -> ``"module:Class"`` of its ``SpecProposer``."""
        regs = self.collect("pagedlm_register_spec_proposers", _named_class, "speculative decoding method")
        return {str(key): reg.value for key, reg in regs.items()}

    def add_cli_commands(self, subparsers: argparse._SubParsersAction) -> None:
        self.hook.pagedlm_add_cli_commands(subparsers=subparsers)

    def check_and_update_config(self, vllm_config: VllmConfig) -> None:
        self.hook.pagedlm_check_and_update_config(vllm_config=vllm_config)


# -- register() signatures of the registration hooks (override=False is taken off before) -------


def _model(architecture: str, class_path: str) -> tuple[str, str]:
    return str(architecture), str(class_path)


def _attention_backend(name: str, class_path: str) -> tuple[str, str]:
    return str(name), str(class_path)


def _platform(name: str, class_path: str, is_available: Callable[[], bool],
              priority: int = 0) -> tuple[str, dict[str, Any]]:
    return str(name), {"name": str(name), "class_path": str(class_path), "is_available": is_available,
                       "priority": int(priority)}


def _quantization_method(name: str, class_path: str) -> tuple[str, str]:
    return str(name), str(class_path)


def _named_class(name: str, class_path: str) -> tuple[str, str]:
    return str(name), str(class_path)


def _op(op_name: str, platform_name: str, function_path: str) -> tuple[tuple[str, str], str]:
    return (str(op_name), str(platform_name)), str(function_path)


_plugins: Plugins | None = None
_plugins_lock = threading.Lock()


def get_plugins() -> Plugins:
    """The process-wide plugin facade (created on first use; entry points load lazily)."""
    global _plugins
    with _plugins_lock:
        if _plugins is None:
            _plugins = Plugins()
        return _plugins


def reset_plugins() -> None:
    """Forget the process-wide facade (tests that install or allow-list plugins)."""
    global _plugins
    with _plugins_lock:
        _plugins = None
