"""The configs of the engine's optional features (``VllmConfig``'s ``profiler_config``,
``lora_config``, ``structured_outputs_config``, ``compilation_config``), re-exported by
``pagedlm.core.config``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from pagedlm.core.config_base import _STR_TO_DTYPE, _Freezable


@dataclass
class ProfilerConfig(_Freezable):
    """vLLM's ``ProfilerConfig`` (``LLM(profiler_config=...)``, ``--profiler-config JSON``): what
    ``start_profile()`` / ``stop_profile()`` record. With ``profiler="torch"`` every worker writes
    a torch profiler trace (``<name>.<time>.pt.trace.json[.gz]``, for Perfetto or TensorBoard) to
    ``torch_profiler_dir`` when profiling stops."""

    #: "torch" (the torch profiler) or None (off); vLLM's "cuda" (nsys capture ranges) is refused
    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    #: also write each worker's table of ops by device (or CPU) time: ``profiler_out_<rank>.txt``
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    #: pagedlm's front ends record no trace of their own: accepted for vLLM's configs, no effect
    ignore_frontend: bool = False
    #: engine steps to skip after ``start_profile`` before recording
    delay_iterations: int = 0
    #: steps to record at most (0: until ``stop_profile``)
    max_iterations: int = 0

    def __post_init__(self) -> None:
        if self.profiler not in (None, "torch"):
            raise ValueError(f"profiler_config.profiler={self.profiler!r} is not supported; allowed: 'torch' or None"
                             " (vLLM's 'cuda' profiler is not implemented)")
        if self.torch_profiler_dir and self.profiler != "torch":
            raise ValueError("profiler_config.torch_profiler_dir needs profiler='torch'")
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("profiler_config.profiler='torch' needs torch_profiler_dir (where the traces go)")
        for name in ("delay_iterations", "max_iterations"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"profiler_config.{name}={getattr(self, name)!r} must be an integer >= 0")
        if self.torch_profiler_dir and "://" not in self.torch_profiler_dir:
            self.torch_profiler_dir = os.path.abspath(os.path.expanduser(self.torch_profiler_dir))

    @classmethod
    def from_any(cls, value: ProfilerConfig | dict[str, Any] | None) -> ProfilerConfig:
        """A config from a ``ProfilerConfig``, a dict of its fields (unknown ones refused by name) or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"profiler_config={value!r} must be a ProfilerConfig or a dict of its fields")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"profiler_config has unknown fields {unknown}; allowed: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**value)


@dataclass
class LoRAConfig(_Freezable):
    """Multi-LoRA serving (vLLM's ``LoRAConfig``; ``VllmConfig.lora_config``, None: LoRA off).

    ``max_loras`` adapters sit in device slots at once (the scheduler never runs more distinct
    adapters in one step); ``max_cpu_loras`` (default ``max_loras``) are kept in host memory, least
    recently used evicted; ``lora_dtype`` is the slots' dtype (``"auto"``: the model's).
    ``fully_sharded_loras`` is vLLM's option to shard A as well; it is refused (pagedlm shards
    like the base layers: B's output rows column-parallel, A's input columns row-parallel).
    """

    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None
    lora_dtype: str | torch.dtype = "auto"
    fully_sharded_loras: bool = False

    def __post_init__(self) -> None:
        for name in ("max_lora_rank", "max_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if self.fully_sharded_loras:
            raise ValueError("fully_sharded_loras=True is not supported: LoRA weights are sharded like their "
                             "base layers (drop the option)")
        if isinstance(self.lora_dtype, str) and self.lora_dtype != "auto" and self.lora_dtype not in _STR_TO_DTYPE:
            raise ValueError(f"lora_dtype={self.lora_dtype!r} must be 'auto' or one of {', '.join(_STR_TO_DTYPE)}")

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if isinstance(self.lora_dtype, torch.dtype):
            return self.lora_dtype
        return model_dtype if self.lora_dtype == "auto" else _STR_TO_DTYPE[self.lora_dtype]


@dataclass
class StructuredOutputsConfig(_Freezable):
    """Grammar-constrained decoding (vLLM's ``structured_outputs_config``).

    ``backend``: ``"auto"`` (xgrammar) or a name registered through
    ``pagedlm_register_structured_output_backends``. ``reasoning_parser`` (``--reasoning-parser``):
    with a reasoning model, the grammar applies only once its thinking has ended, unless
    ``enable_in_reasoning``. The ``disable_*`` knobs set the JSON grammar's defaults.
    """

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    @classmethod
    def from_any(cls, value: StructuredOutputsConfig | dict[str, Any] | None) -> StructuredOutputsConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config={value!r} must be a dict of StructuredOutputsConfig fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs_config has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**value)


#: vLLM's ``cudagraph_mode`` names; pagedlm's device graphs are whole forwards, so the modes with
#: piecewise graphs capture whole-forward mixed-batch graphs instead
CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE", "PIECEWISE")


@dataclass
class CompilationConfig(_Freezable):
    """vLLM's ``CompilationConfig`` (``LLM(compilation_config=...)``, ``--compilation-config`` /
    ``-cc`` JSON), as far as pagedlm has it: which device graphs are captured.

    - ``cudagraph_mode``: None (the platform's default: on CUDA, decode and mixed-batch graphs),
      ``"NONE"`` (no graphs, as ``enforce_eager=True``), ``"FULL_DECODE_ONLY"`` (decode-only
      steps only), ``"FULL"``, ``"FULL_AND_PIECEWISE"`` or ``"PIECEWISE"`` (decode and mixed-batch
      graphs: pagedlm has no torch.compile pieces, every graph is a whole forward).
    - ``cudagraph_capture_sizes``: the decode batch sizes that get a graph (a step pads up to the
      next one; larger steps run eagerly), sizes above ``max_num_seqs`` dropped as vLLM does.
    - ``max_cudagraph_capture_size``: the largest decode batch, and mixed-step token count, with a
      graph (on the CPU platform it also caps ``PAGEDLM_CPU_GRAPH_MAX_BATCH``).
    - ``cudagraph_num_of_warmups``: eager runs of a forward before its graph is captured (default
      0, as vLLM's; the first graph of each kind always gets one).
    - ``level`` / ``mode`` (vLLM's torch.compile levels 0-3; an int ``compilation_config=3`` sets
      ``level``): accepted; pagedlm does not run torch.compile, so they change nothing.
    """

    level: int | None = None
    mode: int | None = None
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    cudagraph_num_of_warmups: int = 0

    def __post_init__(self) -> None:
        for name in ("level", "mode"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value not in (0, 1, 2, 3)):
                raise ValueError(f"compilation_config.{name}={value!r} must be one of 0, 1, 2, 3 (vLLM's "
                                 "torch.compile levels; pagedlm accepts them and does not compile)")
        if self.cudagraph_mode is not None and self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation_config.cudagraph_mode={self.cudagraph_mode!r} is not supported; allowed: "
                             f"{', '.join(CUDAGRAPH_MODES)}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if not isinstance(sizes, list | tuple) or not all(_positive_int(s) for s in sizes):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes={sizes!r} must be a list of integers "
                                 ">= 1")
            self.cudagraph_capture_sizes = sorted(set(sizes))
        top = self.max_cudagraph_capture_size
        if top is not None and not _positive_int(top):
            raise ValueError(f"compilation_config.max_cudagraph_capture_size={top!r} must be an integer >= 1")
        warmups = self.cudagraph_num_of_warmups
        if not (_positive_int(warmups) or warmups == 0) or isinstance(warmups, bool):
            raise ValueError(f"compilation_config.cudagraph_num_of_warmups={warmups!r} must be an integer >= 0")

    @classmethod
    def from_any(cls, value: CompilationConfig | dict[str, Any] | int | None) -> CompilationConfig:
        """A config from a ``CompilationConfig``, a dict of its fields (unknown ones refused by
        name), an int (vLLM's level) or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(level=value)
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config={value!r} must be a CompilationConfig, a dict of its fields or "
                             "an int (vLLM's level)")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"compilation_config has unknown fields {unknown}; allowed: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**value)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
