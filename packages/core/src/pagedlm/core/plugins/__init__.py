"""The pagedlm plugin system: a typed facade over a pluggy plugin manager.

Plugins are modules named by entry points in group ``pagedlm``. Loading is lazy (on the first
call that needs a registry), idempotent and safe in every process. Built-in packages
(pagedlm-backend-cpu, pagedlm-models-llama, ...) load through exactly the same path.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from pagedlm.core import envs
from pagedlm.core.logger import init_logger
from pagedlm.core.plugins import hookspecs

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig

logger = init_logger(__name__)

PROJECT_NAME = "pagedlm"
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = [
    "hookimpl",
    "PlatformSpec",
    "PluginError",
    "PluginLoadFailure",
    "Plugins",
    "get_plugins",
    "resolve_class_path",
]


class PluginError(RuntimeError):
    """A plugin could not provide what was asked of it."""


@dataclass(frozen=True)
class PlatformSpec:
    name: str
    class_path: str
    is_available: Callable[[], bool]
    priority: int
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
        return [name for name, _ in self._pm.list_name_plugin()]

    # -- typed registries ---------------------------------------------------------------------
    def _collect(self, hook_name: str, make: Callable[[str, tuple, dict], Any]) -> list[Any]:
        """Call a registration hook per plugin, so each registration knows its plugin."""
        self.load()
        out: list[Any] = []
        for name, plugin in self._pm.list_name_plugin():
            impl = getattr(plugin, hook_name, None)
            if impl is None:
                continue

            def register(*args: Any, _name: str = name, **kwargs: Any) -> None:
                out.append(make(_name, args, kwargs))

            try:
                impl(register=register)
            except Exception as e:
                raise PluginError(f"plugin {name!r} failed in {hook_name}: {type(e).__name__}: {e}") from e
        return out

    def models(self) -> dict[str, str]:
        """Architecture name -> ``"module:Class"``; the first plugin registering a name wins."""
        pairs = self._collect("pagedlm_register_models", lambda _p, a, k: _two(a, k, "architecture", "class_path"))
        registry: dict[str, str] = {}
        for arch, path in pairs:
            registry.setdefault(arch, path)
        return registry

    def attention_backends(self) -> dict[str, str]:
        pairs = self._collect("pagedlm_register_attention_backends", lambda _p, a, k: _two(a, k, "name", "class_path"))
        registry: dict[str, str] = {}
        for name, path in pairs:
            registry.setdefault(name, path)
        return registry

    def platforms(self) -> list[PlatformSpec]:
        def make(plugin: str, args: tuple, kwargs: dict) -> PlatformSpec:
            names = ("name", "class_path", "is_available", "priority")
            values = dict(zip(names, args))
            values.update(kwargs)
            missing = [n for n in names[:3] if n not in values]
            if missing:
                raise TypeError(f"register() missing {missing}")
            return PlatformSpec(plugin=plugin, priority=int(values.get("priority", 0)),
                                **{n: values[n] for n in names[:3]})

        return self._collect("pagedlm_register_platforms", make)

    def add_cli_commands(self, subparsers: argparse._SubParsersAction) -> None:
        self.hook.pagedlm_add_cli_commands(subparsers=subparsers)

    def check_and_update_config(self, vllm_config: VllmConfig) -> None:
        self.hook.pagedlm_check_and_update_config(vllm_config=vllm_config)


def _two(args: tuple, kwargs: dict, first: str, second: str) -> tuple[str, str]:
    values = dict(zip((first, second), args))
    values.update(kwargs)
    if first not in values or second not in values:
        raise TypeError(f"register() takes ({first}, {second}); got args={args} kwargs={kwargs}")
    return str(values[first]), str(values[second])


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
