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


def image_fetch_timeout_s() -> float:
    """``VLLM_IMAGE_FETCH_TIMEOUT`` (vLLM's name): seconds an http(s) image URL may take (default 5)."""
    return float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", 5))


def max_image_fetch_bytes() -> int:
    """``PAGEDLM_MAX_IMAGE_FETCH_BYTES``: the largest image an http(s) URL may return (default 20 MiB)."""
    return int(os.environ.get("PAGEDLM_MAX_IMAGE_FETCH_BYTES", 20 * 2**20))


#: vLLM's (pre-``ProfilerConfig``) profiler variables, which pagedlm honours: name -> field
_VLLM_PROFILER_VARS = {
    "VLLM_TORCH_PROFILER_DIR": "torch_profiler_dir",
    "VLLM_TORCH_PROFILER_WITH_STACK": "torch_profiler_with_stack",
    "VLLM_TORCH_PROFILER_WITH_FLOPS": "torch_profiler_with_flops",
    "VLLM_TORCH_PROFILER_USE_GZIP": "torch_profiler_use_gzip",
    "VLLM_TORCH_PROFILER_DUMP_CUDA_TIME_TOTAL": "torch_profiler_dump_cuda_time_total",
    "VLLM_TORCH_PROFILER_RECORD_SHAPES": "torch_profiler_record_shapes",
    "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY": "torch_profiler_with_memory",
    "VLLM_PROFILER_DELAY_ITERS": "delay_iterations",
    "VLLM_PROFILER_MAX_ITERS": "max_iterations",
}


def vllm_profiler_config() -> dict[str, object] | None:
    """``VLLM_TORCH_PROFILER_DIR`` (and its companions above), as older vLLM read them: the
    fields of a torch ``ProfilerConfig``, or None when the directory is not set."""
    directory = os.environ.get("VLLM_TORCH_PROFILER_DIR")
    if not directory:
        return None
    fields: dict[str, object] = {"profiler": "torch"}
    for name, field_name in _VLLM_PROFILER_VARS.items():
        value = os.environ.get(name)
        if value is None or value == "":
            continue
        if field_name == "torch_profiler_dir":
            fields[field_name] = value
        elif field_name.endswith("_iterations"):
            fields[field_name] = int(value)
        else:
            fields[field_name] = value.strip().lower() not in ("0", "false", "no", "off")
    return fields


def allow_runtime_lora_updating() -> bool:
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (vLLM's name) or ``PAGEDLM_ALLOW_RUNTIME_LORA_UPDATING``:
    the server's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are open."""
    value = os.environ.get("PAGEDLM_ALLOW_RUNTIME_LORA_UPDATING") or os.environ.get(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


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
    honoured = set(_VLLM_PROFILER_VARS) | {"VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_IMAGE_FETCH_TIMEOUT"}
    for name in sorted(k for k in os.environ if k.startswith("VLLM_") and k not in _warned_vllm | honoured):
        _warned_vllm.add(name)
        equivalent = _VLLM_EQUIVALENTS.get(name)
        hint = f"; pagedlm's equivalent is {equivalent}" if equivalent else ""
        logger.warning("the vLLM environment variable %s is not read by pagedlm%s", name, hint)
