"""The CPU platform: plain torch on host memory."""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedlm.core.logger import init_logger
from pagedlm.core.platforms import Platform
from pagedlm.core.utils.cores import usable_cores

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig

logger = init_logger(__name__)

GiB = 1 << 30
#: KV-cache size when neither the config nor PAGEDLM_CPU_KVCACHE_SPACE names one
DEFAULT_KV_CACHE_BYTES = 4 * GiB


class CpuPlatform(Platform):
    """Runs everything on the host with plain torch and the ``cpu_paged`` attention backend."""

    device_name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_dtype = torch.float32
    # float16 is listed because torch's CPU matmul/SDPA kernels accept it (checked on torch 2.x);
    # it is slow there, so float32 stays the default.
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supports_graphs = True  # CPU graphs (kernels/graph.py) for decode steps of a few requests

    def get_attn_backend_name(self, vllm_config: VllmConfig) -> str:
        return "cpu_paged"

    def auto_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """float32 unless the CPU computes the checkpoint's half dtype natively: bfloat16 with
        AVX512-BF16 or AMX, never float16 (torch's CPU float16 matmuls are slow everywhere).
        Measured: Qwen3-0.6B shapes in bfloat16 ran at 0.42 tok/s on a CPU without AVX-512."""
        if checkpoint_dtype == torch.bfloat16 and fast_bf16():
            return torch.bfloat16
        if checkpoint_dtype != torch.float32:
            logger.info("dtype=auto: float32 on this CPU, not the checkpoint's %s (%s)", str(checkpoint_dtype)[6:],
                        "no AVX512-BF16 or AMX" if checkpoint_dtype == torch.bfloat16 else "slow on CPUs")
        return torch.float32

    def set_device(self, local_rank: int) -> torch.device:
        if "OMP_NUM_THREADS" not in os.environ:  # the user's setting wins
            torch.set_num_threads(usable_cores())
        return torch.device("cpu")

    def configure_threads(self, ranks_on_host: int) -> None:
        # Ranks of one host share its cores; torch's default (all cores per process) would
        # oversubscribe them and make every collective wait on descheduled peers.
        torch.set_num_threads(max(1, usable_cores() // max(1, ranks_on_host)))

    def get_model_runner_cls(self, vllm_config: VllmConfig) -> str:
        # decode steps of a few requests replay CPU graphs (enforce_eager=True: never)
        return "pagedlm.backends.cpu.model_runner:CpuModelRunner"

    def kv_cache_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeroed by the kernel, page by page, when first touched (an anonymous mapping of fresh
        pages): start-up does not write gigabytes of zeros, and the process's resident memory grows
        with the blocks in use instead of the whole cache. Zeros either way, as ``torch.zeros``.

        NOTE: the mapping asks for transparent huge pages (``MADV_HUGEPAGE``; honoured where THP is
        ``madvise`` or ``always``): a decode step writes one slot per request and layer, each into
        a page of its own, and a first touch costs ~15 us in a VM (Gemma 3 270M at batch 32: ~7 ms
        a step); with 2 MB pages it happens once per 2 MB, so resident memory grows by 2 MB steps.
        """
        nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                region.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without THP: 4 kB pages
                pass
        raw = np.frombuffer(region, dtype=np.uint8)
        return torch.from_numpy(raw).view(dtype).view(shape)

    def kv_cache_memory_bytes(self, vllm_config: VllmConfig, device: torch.device) -> int:
        """Host bytes for the KV cache.

        ``cache_config.kv_cache_memory_bytes`` if set, else ``PAGEDLM_CPU_KVCACHE_SPACE`` GiB, else
        4 GiB; always capped at half the host memory available now, because the KV cache is
        allocated up front and swapping it out would make every step crawl.
        """
        requested = vllm_config.cache_config.kv_cache_memory_bytes
        source = "cache_config.kv_cache_memory_bytes"
        if requested is None:
            env_gib = kv_cache_space_gib()
            if env_gib is not None:
                requested, source = int(env_gib * GiB), "PAGEDLM_CPU_KVCACHE_SPACE"
            else:
                requested, source = DEFAULT_KV_CACHE_BYTES, "the default"
        if requested <= 0:
            raise ValueError(f"KV-cache size from {source} must be positive; got {requested} bytes")
        available = available_host_memory_bytes()
        cap = available // 2 if available is not None else requested
        if requested > cap:
            logger.warning(
                "KV cache of %.2f GiB (from %s) exceeds half of the available host memory; using %.2f GiB",
                requested / GiB, source, cap / GiB,
            )
            return cap
        logger.info("KV cache budget %.2f GiB on the CPU (from %s; set PAGEDLM_CPU_KVCACHE_SPACE=<GiB> or "
                    "kv_cache_memory_bytes to change it); its pages become resident as blocks are used",
                    requested / GiB, source)
        return requested

    def memory_summary(self) -> str:
        available = available_host_memory_bytes()
        if available is None:
            return "available host memory: unknown"
        return f"available host memory: {available / GiB:.2f} GiB"


def fast_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX-BF16 on x86, BF16 on Arm)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set()
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def kv_cache_space_gib() -> float | None:
    """``PAGEDLM_CPU_KVCACHE_SPACE``: GiB of host memory for the KV cache on this platform.

    NOTE: read here, not in ``pagedlm.core.envs``: it is this backend's setting (docs/configuration.md
    lists it with the backend's name).
    """
    value = os.environ.get("PAGEDLM_CPU_KVCACHE_SPACE")
    return float(value) if value else None


def gguf_int8_activations() -> bool:
    """``PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS`` (default ``1``): Q8_0/Q4_K/Q6_K GGUF weights multiply
    activations quantized to int8 per 32 values (decode steps of 1-4 rows: ``kernels/gguf_vnni.c``
    where the CPU has AVX-512 VNNI, else ``kernels/gguf_q8_act.c``; batches and prefill:
    ``kernels/gguf_amx.c`` where the CPU has AMX, else the exact path), as llama.cpp's and vLLM's
    GGUF decode kernels quantize activations to 8 bits. ``0``: the exact float32 path everywhere,
    token-identical to HF transformers on the dequantized weights (docs/quantization.md).
    """
    value = os.environ.get("PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS", "1").lower()
    if value not in ("0", "1", "true", "false", "yes", "no"):
        raise ValueError(f"PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS={value!r} must be 1 (int8 activations, the default) "
                         "or 0 (the exact float32 path)")
    return value in ("1", "true", "yes")


def cpu_graph_max_batch() -> int:
    """``PAGEDLM_CPU_GRAPH_MAX_BATCH`` (default 4): decode steps of up to this many requests replay
    a CPU graph (``model_runner.py``); 0 turns them off, as ``enforce_eager=True`` does."""
    value = os.environ.get("PAGEDLM_CPU_GRAPH_MAX_BATCH", "4")
    try:
        batch = int(value)
    except ValueError:
        batch = -1
    if batch < 0:
        raise ValueError(f"PAGEDLM_CPU_GRAPH_MAX_BATCH={value!r} must be a whole number >= 0 (0: no CPU graphs)")
    return batch


def available_host_memory_bytes() -> int | None:
    """Host memory that can be allocated now without swapping, or ``None`` if unknown.

    psutil when installed; otherwise ``MemAvailable`` from /proc/meminfo. A cgroup v2 limit
    (containers) is honoured too, because MemAvailable reports the whole host's memory.
    """
    available: int | None = None
    try:
        import psutil  # optional dependency

        available = int(psutil.virtual_memory().available)
    except ImportError:
        available = _meminfo_available()
    cgroup = _cgroup_available()
    if cgroup is not None:
        available = cgroup if available is None else min(available, cgroup)
    return available


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file reports kB
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        return max(int(limit) - current, 0)
    except (OSError, ValueError):
        return None
