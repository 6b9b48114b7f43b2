"""Platform selection: ``device="auto"`` picks the best available registered platform."""

from __future__ import annotations

import functools

from pagedlm.core.platforms.interface import HOST, Platform
from pagedlm.core.plugins import get_plugins, resolve_class_path

__all__ = ["HOST", "Platform", "available_platforms", "current_platform", "resolve_platform"]


def __getattr__(name: str) -> Platform:
    # ``current_platform`` (vLLM's name): the platform ``device="auto"`` picks, resolved on first use
    # so that importing this module loads no plugin
    if name == "current_platform":
        return resolve_platform("auto")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available_platforms() -> list[str]:
    """Registered platform names whose availability probe answers True, best first."""
    specs = sorted(get_plugins().platforms(), key=lambda s: -s.priority)
    return [s.name for s in specs if _probe(s.is_available)]


def _probe(is_available) -> bool:
    try:
        return bool(is_available())
    except Exception:  # noqa: BLE001 - a failing probe means "not available"
        return False


@functools.cache
def _instantiate(class_path: str) -> Platform:
    cls = resolve_class_path(class_path)
    return cls()


def resolve_platform(device: str = "auto") -> Platform:
    """The ``Platform`` for ``device`` (``"auto"``, ``"cpu"``, ``"cuda"``, ...)."""
    plugins = get_plugins()
    specs = sorted(plugins.platforms(), key=lambda s: -s.priority)
    if not specs:
        hint = ""
        if plugins.failures:
            hint = " Plugins that failed to load: " + "; ".join(f"{f.name}: {f.error}" for f in plugins.failures)
        raise RuntimeError(
            "no pagedlm platform is installed: pip install pagedlm-backend-cpu (or pagedlm-backend-cuda)." + hint
        )
    if device == "auto":
        for spec in specs:
            if _probe(spec.is_available):
                return _instantiate(spec.class_path)
        raise RuntimeError(f"no registered platform is available: {[s.name for s in specs]}")
    base = device.split(":", 1)[0]
    for spec in specs:
        if spec.name == base:
            if not _probe(spec.is_available):
                raise ValueError(f"device={device!r} is registered by plugin {spec.plugin!r} but not available here")
            return _instantiate(spec.class_path)
    names = ", ".join(["auto"] + [s.name for s in specs])
    raise ValueError(f"device={device!r} is not a registered platform; allowed: {names}")
