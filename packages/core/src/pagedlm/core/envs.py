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


#: vLLM environment variables whose effect pagedlm has under its own name, or has anyway
_VLLM_EQUIVALENTS = {
    "VLLM_LOGGING_LEVEL": "PAGEDLM_LOGGING_LEVEL",
    "VLLM_PLUGINS": "PAGEDLM_PLUGINS",
    "VLLM_CACHE_ROOT": "PAGEDLM_CACHE_ROOT",
    "VLLM_CPU_KVCACHE_SPACE": "PAGEDLM_CPU_KVCACHE_SPACE",
    "VLLM_API_KEY": "PAGEDLM_API_KEY",
}
_warned_vllm: set[str] = set()


def check_vllm_environment() -> None:
    """A ``VLLM_*`` variable a vLLM user set is never ignored silently: one warning per variable
    and process, naming pagedlm's equivalent where there is one. ``VLLM_BATCH_INVARIANT=1`` is
    refused: pagedlm has no batch-invariant kernels (greedy tokens do not depend on the batch in
    its CPU and CUDA parity tests, but logprobs differ in the last bits with the batch mix, and on
    CUDA the split-KV factor and GEMM tiling follow the batch size)."""
    from pagedlm.core.logger import init_logger

    if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        raise ValueError(
            "VLLM_BATCH_INVARIANT is set, but pagedlm has no batch-invariant mode: results may differ in the "
            "last bits with the batch mix (greedy tokens in its parity tests do not). Unset VLLM_BATCH_INVARIANT."
        )
    logger = init_logger(__name__)
    for name in sorted(k for k in os.environ if k.startswith("VLLM_") and k not in _warned_vllm):
        _warned_vllm.add(name)
        equivalent = _VLLM_EQUIVALENTS.get(name)
        hint = f"; pagedlm's equivalent is {equivalent}" if equivalent else ""
        logger.warning("the vLLM environment variable %s is not read by pagedlm%s", name, hint)
