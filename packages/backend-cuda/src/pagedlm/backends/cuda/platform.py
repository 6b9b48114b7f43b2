"""The CUDA platform (skeleton: device handling and KV-cache sizing; no attention backend yet)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedlm.core.platforms import Platform

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig


class CudaPlatform(Platform):
    """NVIDIA GPUs through torch.cuda."""

    device_name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_dtype = torch.bfloat16
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    supports_graphs = True

    def get_attn_backend_name(self, vllm_config: VllmConfig) -> str:
        # The Triton paged-attention backend (DESIGN.md §6) is a later issue. Fail with a message
        # that says what to do instead of picking something silently slow.
        raise ValueError(
            "the CUDA attention backend is not built yet (pagedlm-backend-cuda has no kernels so "
            "far). Use device='cpu', or pass attention_backend='cpu_paged' to run the plain-torch "
            "reference backend (pagedlm-backend-cpu) on the GPU, which is correct but slow."
        )

    def set_device(self, local_rank: int) -> torch.device:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def kv_cache_memory_bytes(self, vllm_config: VllmConfig, device: torch.device) -> int:
        """Bytes for the KV cache: ``total * gpu_memory_utilization`` minus what is in use.

        Called after the weights are loaded and a profiling forward pass has run. "In use" is
        memory outside torch's allocator (other processes, the CUDA context, NCCL buffers) plus
        torch's allocation peak (weights + the profiling pass's activations, which every step of
        the same size needs again). Counting the peak rather than the current use makes the
        result independent of whether the runner emptied torch's cache after profiling.
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
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV cache on {device}: {outside_torch / 2**30:.2f} GiB used "
                f"outside torch plus a {torch_peak / 2**30:.2f} GiB torch peak exceed the "
                f"{allowed / 2**30:.2f} GiB allowed by gpu_memory_utilization="
                f"{cache_config.gpu_memory_utilization}; raise gpu_memory_utilization, lower "
                "max_num_batched_tokens, or use a smaller model"
            )
        return budget

    def memory_summary(self) -> str:
        if not torch.cuda.is_initialized():
            return ""
        free, total = torch.cuda.mem_get_info()
        return f"GPU memory: {(total - free) / 2**30:.2f} GiB used of {total / 2**30:.2f} GiB"
