"""Architecture name -> model class, through the ``pagedlm_register_models`` hook."""

from __future__ import annotations

from pagedlm.core.plugins import get_plugins, resolve_class_path

__all__ = ["get_model_class", "registered_architectures"]


def registered_architectures() -> dict[str, str]:
    """HF architecture name -> ``"module:Class"`` for every loaded plugin."""
    return get_plugins().models()


def get_model_class(architectures: list[str]) -> type:
    """The class for the first of ``architectures`` (an HF ``config.architectures`` list) that a
    plugin registered. Imports only that class's module.

    Raises ``ValueError`` naming the registered architectures and installed model plugins when
    none matches.
    """
    plugins = get_plugins()
    registry = plugins.models()
    for arch in architectures:
        if arch in registry:
            cls = resolve_class_path(registry[arch])
            if not isinstance(cls, type):
                raise TypeError(f"{registry[arch]} (registered for {arch!r}) is not a class")
            return cls
    installed = sorted({d or name for name, d in plugins.distributions.items()})
    lines = [
        f"no pagedlm model is registered for architectures {list(architectures)} (from config.json).",
        f"Registered architectures: {', '.join(sorted(registry)) or '(none)'}.",
        f"Installed pagedlm plugins: {', '.join(installed) or '(none)'}.",
    ]
    if plugins.failures:
        failed = "; ".join(f"{f.name} ({f.distribution or '?'}): {f.error}" for f in plugins.failures)
        lines.append(f"Plugins that failed to load: {failed}.")
    lines.append("Hint: more architectures come in separate packages, e.g. `pip install pagedlm-models-<family>`.")
    raise ValueError(" ".join(lines))
