"""Session-wide fixtures and markers shared by every test folder.

Checkpoints are built once per session (about a second each) and must be treated as read-only:
tests that need a variant build their own with ``tiny_checkpoint_factory``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# No hub is reachable here: fail at once instead of waiting on network timeouts if some code path
# tries to resolve a model name remotely.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated here so the markers exist when pytest runs with
    # another rootdir/ini (e.g. a plugin's test suite reusing this conftest).
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped when torch.cuda.is_available() is False")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        # xdist workers share the cores: torch's default (every core per process) would run N x
        # cores threads, and CPU references (HF on the CPU) then crawl while waiting for each other.
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the CPU platform then keeps it too
        if torch.cuda.is_available():
            _share_the_gpu()


#: each xdist worker's engines' KV cache on a shared GPU (see _share_the_gpu)
GPU_KV_BYTES_PER_WORKER = 2 << 30


def _share_the_gpu() -> None:
    """Under xdist the workers' engines share one GPU, and an engine sizes its KV cache from what
    the others leave (``CudaPlatform.kv_cache_memory_bytes``: 0.9 of the card minus every
    process's use), so the first takes most of the card and the next fail with "no memory left
    for the KV cache" (12 workers on an 80 GB H100, 2026-12-06). There each engine that does not
    size its cache itself gets :data:`GPU_KV_BYTES_PER_WORKER`; a serial run (``-n 0``) keeps
    the real accounting."""
    try:
        from pagedlm.backends.cuda.platform import CudaPlatform
    except ImportError:
        return
    measured = CudaPlatform.kv_cache_memory_bytes

    def shared(self, vllm_config, device):
        if vllm_config.cache_config.kv_cache_memory_bytes is not None:
            return measured(self, vllm_config, device)
        return GPU_KV_BYTES_PER_WORKER

    CudaPlatform.kv_cache_memory_bytes = shared


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Under xdist, hand each test's freed GPU memory back to the driver when it ends: torch's
    caching allocator otherwise keeps it for this worker, and the other workers' engines and
    kernel launches then run out of memory on a card they share (6 tests failed so with 8 workers
    on an 80 GB H100, 2026-12-07; one at a time the same tests pass)."""
    yield
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= 1:
        return
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("cuda") for item in items):
        return  # avoid importing torch (seconds) when nothing needs the answer
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``factory(arch, **make_tiny_checkpoint_kwargs) -> dir``; each distinct variant is built once."""
    from pagedlm.core.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny-checkpoints")
    built: dict[tuple[str, tuple[tuple[str, Any], ...]], str] = {}

    def factory(arch: str, **kwargs: Any) -> str:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in built:
            suffix = "-".join(f"{k}={v}" for k, v in key[1])
            out = Path(root) / (f"{arch}-{suffix}" if suffix else arch)
            built[key] = make_tiny_checkpoint(out, arch, **kwargs)  # type: ignore[arg-type]
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_checkpoints(tiny_checkpoint_factory: Callable[..., str]) -> dict[str, str]:
    """arch -> directory of a tiny random checkpoint, for every arch of ``ARCHITECTURES``."""
    from pagedlm.core.testing import ARCHITECTURES

    return {arch: tiny_checkpoint_factory(arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint_factory: Callable[..., str]) -> str:
    """Directory of the tiny Llama checkpoint (the default model of most engine tests).

    The same directory as ``tiny_checkpoints["llama"]``, without building the other three.
    """
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random LLaVA-1.5 checkpoint (CLIP + Llama, processor and tokenizer)."""
    from pagedlm.core.testing.multimodal import make_tiny_llava_checkpoint

    return make_tiny_llava_checkpoint(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def hf_llava(tiny_llava: str) -> Any:
    """(HF transformers' model in float32 on the CPU, its processor) of ``tiny_llava``."""
    from pagedlm.core.testing.multimodal import load_hf_vlm

    return load_hf_vlm(tiny_llava)


@pytest.fixture(scope="session")
def tiny_gemma3_vision(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory of a tiny random Gemma 3 vision checkpoint (SigLIP + Gemma 3, processor, tokenizer)."""
    from pagedlm.core.testing.multimodal import make_tiny_gemma3_vision_checkpoint

    return make_tiny_gemma3_vision_checkpoint(tmp_path_factory.mktemp("tiny-gemma3-vision"))


@pytest.fixture(scope="session")
def tiny_st_qwen3(tiny_checkpoint_factory: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3 saved as a sentence-transformers embedding model (mean pooling, Normalize)."""
    from pagedlm.core.testing.sentence_transformers import make_sentence_transformers_checkpoint

    base = tiny_checkpoint_factory("qwen3")
    return make_sentence_transformers_checkpoint(base, str(tmp_path_factory.mktemp("st-qwen3")), pooling="mean")
