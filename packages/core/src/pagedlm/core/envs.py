"""Every environment variable pagedlm reads, in one place.

NOTE: nothing else in core calls ``os.environ`` for pagedlm settings; read them here so that the
full list stays discoverable (docs/configuration.md mirrors this module). A backend's own settings
(``PAGEDLM_CPU_KVCACHE_SPACE``) live in that backend's platform module.
"""

from __future__ import annotations

import os


def plugins_allow_list() -> list[str] | None:
    """``PAGEDLM_PLUGINS``: comma-separated entry-point names to load; unset means all."""
    value = os.environ.get("PAGEDLM_PLUGINS")
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def disable_plugin_autoload() -> bool:
    """``PAGEDLM_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points (only registered objects)."""
    return os.environ.get("PAGEDLM_DISABLE_PLUGIN_AUTOLOAD", "0").lower() in ("1", "true", "yes")


def cache_root() -> str:
    """``PAGEDLM_CACHE_ROOT``: where pagedlm keeps generated files (default ~/.cache/pagedlm)."""
    return os.environ.get(
        "PAGEDLM_CACHE_ROOT",
        os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pagedlm"),
    )


def logging_level() -> str:
    """``PAGEDLM_LOGGING_LEVEL``: level of the ``pagedlm`` logger (default INFO)."""
    return os.environ.get("PAGEDLM_LOGGING_LEVEL", "INFO").upper()


def bench_hf_timeout_s() -> float:
    """``PAGEDLM_BENCH_HF_TIMEOUT``: seconds ``pagedlm bench --compare hf`` lets HF run (default 3600)."""
    return float(os.environ.get("PAGEDLM_BENCH_HF_TIMEOUT", 3600))
