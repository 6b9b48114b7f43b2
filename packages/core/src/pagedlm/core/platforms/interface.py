"""The ``Platform`` interface that hardware backends implement.

NOTE: every device-specific service core needs goes through the selected platform: events,
pinned memory, capability, the visible-devices variable, the Ray resource key, thread settings,
memory probing and the KV-cache budget. Core never tests a device-type string; a new kind of
hardware is a new ``Platform`` subclass in its own package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig

#: host memory: where results come back to from every platform (not a platform itself)
HOST = torch.device("cpu")


class Platform:
    """One kind of device. Subclasses live in backend packages and are registered through
    ``pagedlm_register_platforms``; core only ever sees them through this interface."""

    #: the name users pass as ``device=``
    device_name: str = "cpu"
    #: the torch device type tensors are placed on
    device_type: str = "cpu"
    #: torch.distributed backend for multi-rank runs
    dist_backend: str = "gloo"
    default_dtype: torch.dtype = torch.float32
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    #: whether decode steps may be replayed through device graphs
    supports_graphs: bool = False
    #: whether the engine schedules step N+1 while step N runs by default (``async_scheduling``):
    #: a gain only where the model runs asynchronously to the host, as on GPUs
    supports_async_scheduling: bool = False
    #: the Ray resource one worker of this platform reserves (``"GPU"``, ``"CPU"``, a custom one)
    ray_device_key: str = "CPU"
    #: the environment variable that restricts which devices a process sees; None: no such thing
    visible_devices_env_var: str | None = None
    #: the ``torch.profiler.ProfilerActivity`` member of this device's kernels; None: host only
    profiler_activity: str | None = None

    def auto_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The model dtype for ``dtype="auto"``: the checkpoint's, or the platform default for
        float32 checkpoints."""
        return checkpoint_dtype if checkpoint_dtype != torch.float32 else self.default_dtype

    def get_attn_backend_name(self, vllm_config: VllmConfig) -> str:
        """Name of the attention backend to use (a key of the attention-backend registry)."""
        raise NotImplementedError

    def get_model_runner_cls(self, vllm_config: VllmConfig) -> str:
        """``"module:Class"`` of the model runner workers build on this platform (a subclass of
        ``pagedlm.core.worker.model_runner.ModelRunner``, constructed as ``Cls(vllm_config, device)``)."""
        return "pagedlm.core.worker.model_runner:ModelRunner"

    def default_max_num_batched_tokens(self, usage_context: str) -> int | None:
        """The per-step token budget when the user sets none, for ``usage_context`` ``"llm"``
        (offline) or ``"server"``; None keeps the engine's default (8192)."""
        return None

    def check_and_update_config(self, vllm_config: VllmConfig) -> None:
        """Validate or adjust the config for this platform (block size, dtype, graphs)."""

    def kv_cache_memory_bytes(self, vllm_config: VllmConfig, device: torch.device) -> int:
        """Bytes available for the KV cache on ``device`` after the model is loaded and profiled."""
        raise NotImplementedError

    def copy_bandwidth_bytes_per_s(self, device: torch.device) -> float | None:
        """Bytes per second of a large copy within ``device``'s memory, counting bytes read plus
        bytes written (the bandwidth ceiling benchmarks compare with), measured when called;
        None where the platform does not measure it."""
        return None

    def kv_cache_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zero-filled tensor for one KV-cache slot (allocated once, at start-up)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def configure_threads(self, ranks_on_host: int) -> None:
        """Set the host threads of one of ``ranks_on_host`` worker processes sharing a machine
        (no-op by default: device platforms leave torch's host threads alone)."""

    def is_pin_memory_available(self) -> bool:
        """Whether host buffers for asynchronous copies to this device should be page-locked."""
        return False

    def record_event(self, timing: bool = False) -> Any | None:
        """An event recorded now on the current stream (it has ``synchronize()``; with
        ``timing``, ``elapsed_time(later_event)`` in ms), or None when work on this device
        completes before the call returns (the CPU)."""
        return None

    def new_stream(self, device: torch.device) -> Any | None:
        """A stream of its own on ``device`` for work beside the engine's (KV transfers), or
        None where device work runs in call order (the CPU)."""
        return None

    @contextlib.contextmanager
    def use_stream(self, stream: Any, device: torch.device) -> Iterator[None]:
        """Within: ``device``'s work goes to ``stream`` (from :meth:`new_stream`)."""
        yield

    def get_device_capability(self, device: torch.device) -> tuple[int, int] | None:
        """``(major, minor)`` of the device's compute capability, or None where there is none."""
        return None

    def get_device_description(self) -> dict[str, Any]:
        """What benchmark results record about this platform's devices (name, count)."""
        return {}

    def allocated_memory_bytes(self, device: torch.device) -> int | None:
        """Bytes the framework's allocator holds for tensors on ``device`` now; None if unknown."""
        return None

    def init_device_runtime(self) -> None:
        """Initialise the device runtime of this process now (the engine calls it on a thread
        while the model config loads, so the two overlap). A no-op where nothing is slow."""

    def set_device(self, local_rank: int) -> torch.device:
        """Select the device of a local rank and return it."""
        return torch.device(self.device_type)

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on the CPU)."""

    def empty_cache(self) -> None:
        """Return cached allocator memory to the device (no-op on the CPU)."""

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start the allocator's peak-memory count afresh (before the profiling run), so what the
        process allocated and freed earlier (another model, a notebook's work) is not counted as
        this engine's peak (no-op on the CPU)."""

    def memory_summary(self) -> str:
        return ""
