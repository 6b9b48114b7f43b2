"""The CUDA platform: NVIDIA GPUs through torch.cuda, Triton kernels, CUDA graphs.

- dtype: bfloat16 unless the model or the user asks otherwise.
- attention: ``triton`` (pagedlm.backends.cuda.triton_attn). ``flash_attn`` only when asked for
  by name (``attention_backend="flash_attn"``, block size a multiple of 256): it has never run on
  this project's GPUs (no flash-attn there), so it is not picked automatically.
- model runner: :class:`pagedlm.backends.cuda.model_runner.CudaModelRunner` (persistent input
  buffers, CUDA-graph decode unless ``enforce_eager``, a profiling run before KV sizing).
- KV cache: ``gpu_memory_utilization`` of the device's memory minus everything else in use
  after the weights are loaded and the profiling forward ran.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from pagedlm.core.logger import init_logger
from pagedlm.core.platforms import Platform

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig

logger = init_logger(__name__)

GiB = 1 << 30


def flash_attn_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


class CudaPlatform(Platform):
    """NVIDIA GPUs through torch.cuda."""

    device_name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_dtype = torch.bfloat16
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    supports_graphs = True
    supports_async_scheduling = True
    ray_device_key = "GPU"
    visible_devices_env_var = "CUDA_VISIBLE_DEVICES"
    profiler_activity = "CUDA"

    def get_attn_backend_name(self, vllm_config: VllmConfig) -> str:
        return "triton"

    def get_model_runner_cls(self, vllm_config: VllmConfig) -> str:
        return "pagedlm.backends.cuda.model_runner:CudaModelRunner"

    def default_max_num_batched_tokens(self, usage_context: str) -> int | None:
        """16384 for offline batches on GPUs of 70 GiB or more (A100s excepted), the choice vLLM
        makes for the same devices: half the prefill steps of the 8192 default, each with room
        to spare on such a GPU. The server keeps 8192 (shorter steps, smoother streams)."""
        if usage_context != "llm" or not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        if props.total_memory >= 70 * GiB and "a100" not in props.name.lower():
            return 16384
        return None

    def check_and_update_config(self, vllm_config: VllmConfig) -> None:
        if vllm_config.attention_backend != "flash_attn":
            return
        # (its block-size rule is the backend's own declaration, checked when the runner starts)
        if not flash_attn_importable():
            raise ValueError("attention_backend='flash_attn' needs the flash_attn package (pip install flash-attn)")

    def init_device_runtime(self) -> None:
        # the driver's and runtime's start in a fresh process: 1-4 s measured on the H200 machine
        torch.cuda.init()

    def set_device(self, local_rank: int) -> torch.device:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def is_pin_memory_available(self) -> bool:
        return True

    def record_event(self, timing: bool = False) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=timing)
        event.record()
        return event

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    @contextlib.contextmanager
    def use_stream(self, stream: torch.cuda.Stream, device: torch.device) -> Iterator[None]:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    def get_device_capability(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def get_device_description(self) -> dict[str, object]:
        if not torch.cuda.is_available():
            return {}
        return {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count()}

    def allocated_memory_bytes(self, device: torch.device) -> int:
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def copy_bandwidth_bytes_per_s(self, device: torch.device, num_bytes: int = 2 << 30,
                                   repeats: int = 20) -> float | None:
        """A ``num_bytes / 2`` device-to-device copy (bytes read + written = ``num_bytes``) of
        random bytes, median of ``repeats`` copies timed with events after one untimed."""
        with torch.cuda.device(device):
            src = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device).random_()
            dst = torch.empty_like(src)
            dst.copy_(src)
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000.0)
            del src, dst
        return num_bytes / sorted(times)[len(times) // 2]

    def kv_cache_memory_bytes(self, vllm_config: VllmConfig, device: torch.device) -> int:
        """Bytes for the KV cache: ``total * gpu_memory_utilization`` minus what is in use.

        Called after the weights are loaded and the runner's profiling forward pass has run, with
        the peak statistics reset just before that pass (:meth:`reset_peak_memory_stats`).
        "In use" is memory outside torch's allocator (other processes, the CUDA context, NCCL
        buffers) plus torch's allocation peak (weights + the profiling pass's activations, which
        every step of the same size needs again). Counting the peak rather than the current use
        makes the result independent of whether the runner emptied torch's cache after profiling.
        ``cache_config.kv_cache_memory_bytes`` overrides the computation when set.
        """
        cache_config = vllm_config.cache_config
        if cache_config.kv_cache_memory_bytes is not None:
            return int(cache_config.kv_cache_memory_bytes)
        free, total = torch.cuda.mem_get_info(device)
        outside_torch = max((total - free) - torch.cuda.memory_reserved(device), 0)
        torch_peak = torch.cuda.max_memory_allocated(device)
        allowed = int(total * cache_config.gpu_memory_utilization)
        budget = allowed - outside_torch - torch_peak
        logger.info(
            "GPU memory on %s: %.2f GiB total, %.2f GiB allowed (gpu_memory_utilization=%.2f), %.2f GiB peak of "
            "weights + activations, %.2f GiB outside torch -> %.2f GiB for the KV cache",
            device, total / GiB, allowed / GiB, cache_config.gpu_memory_utilization, torch_peak / GiB,
            outside_torch / GiB, max(budget, 0) / GiB,
        )
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV cache on {device}: {outside_torch / GiB:.2f} GiB used "
                f"outside torch plus a {torch_peak / GiB:.2f} GiB torch peak (weights + the profiling "
                f"forward of max_num_batched_tokens) exceed the {allowed / GiB:.2f} GiB allowed by "
                f"gpu_memory_utilization={cache_config.gpu_memory_utilization}; raise "
                "gpu_memory_utilization, lower max_num_batched_tokens, or use a smaller model"
            )
        return budget

    def memory_summary(self) -> str:
        if not torch.cuda.is_initialized():
            return ""
        free, total = torch.cuda.mem_get_info()
        return f"GPU memory: {(total - free) / GiB:.2f} GiB used of {total / GiB:.2f} GiB"
