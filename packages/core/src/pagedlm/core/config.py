"""Engine configuration: one ``VllmConfig`` made of small per-concern configs.

Every field has a default, so ``VllmConfig()`` builds (with no model) for unit tests. Validation
raises ``ValueError`` naming the parameter, the value and what is allowed.

``VllmConfig.finalize()`` runs once, in the front end (``LLMEngine``, ``AsyncLLM``), before any
engine process starts: it resolves the platform-dependent fields, runs the platform's and the
plugins' checks, and freezes the config. Every process then reads the same final values; setting
a field of a frozen config raises ``dataclasses.FrozenInstanceError``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pagedlm.core.config_base import _STR_TO_DTYPE, _dtype_name, _Freezable
from pagedlm.core.feature_configs import CompilationConfig, LoRAConfig, ProfilerConfig, StructuredOutputsConfig

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
#: ``kv_cache_dtype`` values: the model dtype, or float8 e4m3 with per-tensor scales
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The tensor dtype of a KV cache configured as ``cache_dtype``."""
    return model_dtype if cache_dtype == "auto" else torch.float8_e4m3fn


@dataclass
class ModelConfig(_Freezable):
    """What model to run and how to read it.

    ``model`` is a local directory holding an HF ``config.json`` (plus weights and tokenizer
    unless ``load_format="dummy"`` / ``skip_tokenizer_init``), or a ``.gguf`` file (or a
    directory holding exactly one and no config.json), whose metadata supplies the config and
    the tokenizer. ``hf_config`` may be passed directly instead (tests). ``dtype`` is resolved to a ``torch.dtype`` by
    :meth:`VllmConfig.finalize` once the platform is known.
    """

    model: str | None = None
    tokenizer: str | None = None
    hf_config: Any = None
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    max_model_len: int | None = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    served_model_name: str | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    #: vLLM's ``hf_overrides``: fields set on the loaded HF config (a nested dict updates a
    #: sub-config such as ``text_config``), or a callable ``config -> config``
    hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = None
    #: a registered quantization method (``"fp8"``, ``"compressed-tensors"``, ``"gptq"``, ``"awq"``);
    #: None: the checkpoint's ``quantization_config``, if any (docs/quantization.md)
    quantization: str | None = None
    #: vLLM's custom logits processors: ``LogitsProcessor`` subclasses or ``"module:Class"``
    #: names (``pagedlm.core.v1.sample.logits_processor``); every worker builds one of each
    logits_processors: list[Any] | None = None
    #: accept ``{"prompt_embeds": tensor}`` prompts (vLLM's ``enable_prompt_embeds``)
    enable_prompt_embeds: bool = False
    #: multimodal models (docs/multimodal.md, vLLM's names): most items per prompt by modality
    #: (default 999 each); the directory chat ``file://`` image URLs may read (default: none);
    #: the hosts http(s) image URLs may be fetched from (default: none, no fetching)
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    #: accept precomputed item embeddings in ``multi_modal_data`` (vLLM's ``enable_mm_embeds``):
    #: ``{"image": tensor [num_items, feature_size, hidden_size]}`` instead of images, and chat's
    #: ``image_embeds`` parts
    enable_mm_embeds: bool = False
    #: GiB of preprocessed images kept by content hash for prompts that repeat them (vLLM's
    #: ``mm_processor_cache_gb``; 0 turns it off)
    mm_processor_cache_gb: float = 4.0
    #: vLLM's ``runner``: "generate", "pooling" (embeddings: LLM.embed, /v1/embeddings) or "auto"
    #: (resolved here: "pooling" for ``task="embed"`` / ``convert="embed"`` or a checkpoint of a bare
    #: ``XModel`` body, else "generate")
    runner: str = "auto"
    #: vLLM's ``convert``: "embed" turns a generative checkpoint into an embedding model
    convert: str = "auto"
    #: vLLM's older spelling: "embed" is ``runner="pooling"``, "generate" ``runner="generate"``
    task: str = "auto"
    #: pooling overrides (layers/pooler.py's PoolerConfig or a dict); resolved with the
    #: checkpoint's sentence-transformers config into ``pooling_type`` / ``pooler_normalize``
    pooler_config: Any = None
    #: the work-mode's pooling (set from pooler_config and the checkpoint when runner="pooling")
    pooling_type: str | None = None
    pooler_normalize: bool = True
    #: vLLM's ``enable_sleep_mode``: allow ``sleep()`` / ``wake_up()`` (worker/sleep.py)
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        if self.logits_processors is not None:
            if isinstance(self.logits_processors, (str, type)) or not isinstance(self.logits_processors, (list, tuple)):
                raise ValueError(f"logits_processors={self.logits_processors!r} must be a list of LogitsProcessor "
                                 "classes or 'module:Class' names")
            self.logits_processors = list(self.logits_processors)
        if self.model is not None:
            self.model = os.path.expanduser(str(self.model))
            from pagedlm.core.model_loader.gguf_loader import find_gguf_file

            gguf_file = find_gguf_file(self.model)
            if gguf_file is not None:
                self._init_from_gguf(gguf_file)
            elif not os.path.isdir(self.model):
                raise ValueError(
                    f"model={self.model!r} is not a directory or a .gguf file; pass a local HF model "
                    "directory (config.json, *.safetensors, tokenizer.json) or a GGUF file. No model hub is "
                    "contacted."
                )
            elif not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(f"model={self.model!r} has no config.json (and no .gguf file)")
            else:
                if self.hf_config is None:
                    from pagedlm.core.model_loader.hf_config import load_hf_config

                    self.hf_config = load_hf_config(
                        self.model, trust_remote_code=self.trust_remote_code, revision=self.revision
                    )
                self.generation_config = {**_read_generation_config(self.model), **self.generation_config}
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.hf_config is not None and self.hf_overrides:
            self.hf_config = _apply_hf_overrides(self.hf_config, self.hf_overrides)
        if self.hf_config is not None:
            derived = self._derived_max_model_len()
            if self.max_model_len is None:
                self.max_model_len = derived
            elif self.max_model_len < 1:
                raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
            elif self.max_model_len > derived:
                raise ValueError(
                    f"max_model_len={self.max_model_len} exceeds the model's maximum context "
                    f"length {derived} (max_position_embeddings in config.json)"
                )
        self._resolve_runner()
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _STR_TO_DTYPE:
            raise ValueError(f"dtype={self.dtype!r} is not one of auto, float32, float16, bfloat16")

    def _resolve_runner(self) -> None:
        from pagedlm.core.layers.pooler import CONVERTS, RUNNERS, PoolerConfig, resolve_pooling

        for name, value, allowed in (("runner", self.runner, RUNNERS), ("convert", self.convert, CONVERTS),
                                     ("task", self.task, ("auto", "generate", "embed"))):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
        if self.runner == "auto":
            # a checkpoint of a bare body ("Qwen3Model", as sentence-transformers saves it) has no
            # LM head: it can only pool
            archs = list(getattr(self.hf_config, "architectures", None) or []) if self.hf_config is not None else []
            body_only = bool(archs) and all(a.endswith("Model") for a in archs)
            wants_pooling = self.task == "embed" or self.convert == "embed" or body_only
            self.runner = "pooling" if wants_pooling else "generate"
        if self.runner == "generate" and (self.task == "embed" or self.convert == "embed"):
            raise ValueError(f"runner='generate' contradicts task={self.task!r} / convert={self.convert!r}: "
                             "an embedding model needs runner='pooling'")
        if self.runner == "pooling":
            self.pooler_config = PoolerConfig.from_any(self.pooler_config)
            self.pooling_type, self.pooler_normalize = resolve_pooling(self.model, self.pooler_config)
        elif self.pooler_config is not None:
            raise ValueError("pooler_config needs runner='pooling' (an embedding model)")

    @property
    def is_matryoshka(self) -> bool:
        """Whether embeddings may be truncated to fewer ``dimensions`` (matryoshka representation)."""
        cfg = self.hf_config
        return bool(getattr(cfg, "is_matryoshka", False) or getattr(cfg, "matryoshka_dimensions", None))

    def _init_from_gguf(self, path: str) -> None:
        """Config, generation defaults and tokenizer source from a GGUF file's metadata."""
        from pagedlm.core.model_loader.gguf_loader import load_gguf_model_config

        self.model = path
        hf_config, generation_config = load_gguf_model_config(path)
        if self.hf_config is None:
            self.hf_config = hf_config
        self.generation_config = {**generation_config, **self.generation_config}

    @property
    def is_gguf(self) -> bool:
        """True when ``model`` is a GGUF file (weights load with ``load_format="gguf"``)."""
        return self.model is not None and os.path.isfile(self.model)

    # -- hyperparameters read from the HF config -------------------------------------------------
    def _require(self) -> Any:
        if self.hf_config is None:
            raise ValueError("ModelConfig has no model: pass model=DIR or hf_config=")
        return self.hf_config

    @property
    def text_config(self) -> Any:
        cfg = self._require()
        return getattr(cfg, "text_config", None) or cfg

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self._require(), "architectures", None) or [])

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_attention_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def num_key_value_heads(self) -> int:
        cfg = self.text_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def config_dtype(self) -> torch.dtype:
        cfg = self.text_config
        raw = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
        if isinstance(raw, torch.dtype):
            return raw
        return _STR_TO_DTYPE.get(str(raw).removeprefix("torch."), torch.float32)

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.generation_config.get("eos_token_id"), getattr(self.text_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        return ids

    @property
    def name(self) -> str:
        return self.served_model_name or (self.model or "pagedlm-model")

    def _derived_max_model_len(self) -> int:
        cfg = self.text_config
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return 2048

    def resolve_dtype(self, platform_default: torch.dtype, supported: tuple[torch.dtype, ...],
                      auto: Callable[[torch.dtype], torch.dtype] | None = None) -> torch.dtype:
        """``"auto"``: ``auto(checkpoint dtype)`` (the platform's choice) when given, else the
        checkpoint's dtype, or the platform default for fp32 checkpoints."""
        if isinstance(self.dtype, torch.dtype):
            dtype = self.dtype
        elif self.dtype == "auto" and auto is not None:
            dtype = auto(self.config_dtype)
        elif self.dtype == "auto":
            dtype = self.config_dtype if self.config_dtype != torch.float32 else platform_default
        else:
            dtype = _STR_TO_DTYPE[self.dtype]
        if dtype not in supported:
            allowed = ", ".join(_dtype_name(d) for d in supported)
            raise ValueError(f"dtype={_dtype_name(dtype)} is not supported on this platform; allowed: {allowed}")
        self.dtype = dtype
        return dtype


def _apply_hf_overrides(config: Any, overrides: dict[str, Any] | Callable[[Any], Any]) -> Any:
    if callable(overrides):
        return overrides(config)
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides={overrides!r} must be a dict of config fields or a callable")
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and current is not None and not isinstance(current, dict):
            _apply_hf_overrides(current, value)  # a sub-config (text_config, vision_config, ...)
        else:
            setattr(config, key, value)
    return config


def _read_generation_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


@dataclass
class CacheConfig(_Freezable):
    """The paged KV cache.

    ``num_gpu_blocks_override`` fixes the number of blocks on any device (the name is vLLM's).
    Otherwise the platform sizes the cache: ``gpu_memory_utilization`` of device memory on GPUs,
    ``kv_cache_memory_bytes`` (or ``PAGEDLM_CPU_KVCACHE_SPACE``, default 4 GiB) on the CPU.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    #: ``"auto"`` (the model dtype) or ``"fp8"`` / ``"fp8_e4m3"`` (float8_e4m3fn with a per-layer
    #: scale for keys and one for values); vLLM's ``kv_cache_dtype`` option
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.cache_dtype!r} is not supported; supported: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override={self.num_gpu_blocks_override} must be >= 1")


@dataclass
class ParallelConfig(_Freezable):
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None
    #: which data-parallel replica this engine core is (set by the DP client; picks devices)
    data_parallel_rank: int = 0
    #: MoE layers place whole experts on the ranks of the tensor-parallel group instead of
    #: slicing every expert (vLLM's name; layers/fused_moe/config.py)
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend={self.distributed_executor_backend!r} must be one of uni, mp, ray"
            )
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size x "
                f"pipeline_parallel_size = {self.world_size}; use 'mp' or 'ray'"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class SchedulerConfig(_Freezable):
    """Batching limits.

    ``max_num_batched_tokens`` is the per-step token budget shared by prefill chunks and decode
    tokens (default: 8192, at least ``max_model_len`` when chunked prefill is off).

    ``async_scheduling`` schedules step N+1 while the device runs step N; the token sampled in
    step N is fed to step N+1 on the device. ``None`` (default) turns it on where the platform
    gains from it (``Platform.supports_async_scheduling``) and one process runs the model.

    ``stream_interval`` (the front end's output processor reads it) sends a streamed request's
    output only once ``stream_interval`` new tokens have collected, on its first token and
    when it finishes; the outputs in between are merged, so nothing is lost.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048
    async_scheduling: bool | None = None
    #: a streamed request gets an output once at least this many new tokens collected (and on
    #: its first token, and when it finishes); vLLM's ``--stream-interval``
    stream_interval: int = 1
    #: the order of waiting (and preempted) requests: "fcfs" or "priority" (by each request's
    #: ``priority``, lower first, ties by arrival); vLLM's ``--scheduling-policy``
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        from pagedlm.core.sched.request_queue import SCHEDULING_POLICIES

        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) \
                or self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval!r} is invalid: must be an integer >= 1 "
                             "(the number of tokens a streamed output collects before it is sent)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")

    def finalize(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.enable_chunked_prefill else max(8192, max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={max_model_len} with chunked prefill off: a long prompt could never "
                "be scheduled; raise max_num_batched_tokens or enable chunked prefill"
            )


@dataclass
class LoadConfig(_Freezable):
    """How weights are read. ``"auto"`` reads safetensors and refuses pickle files; pass
    ``load_format="pt"`` to explicitly allow ``*.bin``/``*.pt`` checkpoints (read with
    ``torch.load(weights_only=True)``). ``"gguf"`` reads a ``.gguf`` file, dequantizing at load
    time; ``"auto"`` selects it for a GGUF model. ``"dummy"`` fills weights randomly (benchmarks)."""

    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} must be one of {', '.join(LOAD_FORMATS)}")


@dataclass
class DeviceConfig(_Freezable):
    """``device="auto"`` picks the available platform with the highest priority."""

    device: str = "auto"


@dataclass
class VllmConfig(_Freezable):
    """The one engine-level configuration object (the name is vLLM's)."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    #: which device graphs are captured (vLLM's ``CompilationConfig``; ``cudagraph_mode="NONE"``
    #: sets ``enforce_eager``)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    attention_backend: str | None = None
    enforce_eager: bool = False
    #: the model's quantization method (``pagedlm.core.layers.quantization.QuantizationConfig``),
    #: built from ``model_config.quantization`` or the checkpoint; None: full precision
    quant_config: Any = None
    #: multi-LoRA serving (``LoRAConfig``); None: off
    lora_config: LoRAConfig | None = None
    #: speculative decoding (``pagedlm.core.spec_decode.SpeculativeConfig``); None: off
    speculative_config: Any = None
    #: who drives the engine: "llm" (offline batches: throughput) or "server" (online: latency);
    #: platforms pick defaults by it (``Platform.default_max_num_batched_tokens``)
    usage_context: str = "llm"
    # Extra knobs for third-party plugins, namespaced by plugin name.
    additional_config: dict[str, Any] = field(default_factory=dict)
    #: the KV connector (``pagedlm.core.distributed.kv_transfer.KVTransferConfig``), or None
    kv_transfer_config: Any = None

    def __post_init__(self) -> None:
        mc = self.model_config
        if self.quant_config is None and (mc.quantization is not None or mc.hf_config is not None):
            from pagedlm.core.layers.quantization import get_quant_config

            self.quant_config = get_quant_config(mc, dummy=self.load_config.load_format == "dummy")

    def finalize(self) -> None:
        """Resolve platform-dependent fields, let the platform and plugins check them, then freeze.

        NOTE: the front end calls it once, before any engine process starts; on a frozen
        (already final) config it does nothing.
        """
        if self.frozen:
            return
        from pagedlm.core.platforms import resolve_platform
        from pagedlm.core.plugins import get_plugins

        platform = resolve_platform(self.device_config.device)
        self.device_config.device = platform.device_name
        mc = self.model_config
        load_format = self.load_config.load_format
        if mc.is_gguf and load_format == "auto":
            self.load_config.load_format = "gguf"  # a GGUF file has one way to be read
        elif mc.is_gguf and load_format not in ("gguf", "dummy"):
            raise ValueError(f"load_format={load_format!r} cannot read the GGUF file {mc.model}; use auto or gguf")
        elif load_format == "gguf" and not mc.is_gguf:
            raise ValueError(f'load_format="gguf" needs model=FILE.gguf; got model={mc.model!r}')
        if mc.is_gguf and self.load_config.load_format == "gguf" and self.quant_config is None:
            from pagedlm.core.layers.quantization.gguf import gguf_quant_config

            self.quant_config = gguf_quant_config(self, platform)
        sc = self.scheduler_config
        if mc.runner == "pooling" and mc.pooling_type != "LAST" and self.cache_config.enable_prefix_caching:
            # NOTE: MEAN and CLS pooling read the hidden state of every prompt token; a prefix-cache
            # hit would skip computing them (LAST pooling always computes the last token).
            self.cache_config.enable_prefix_caching = False
        if sc.max_num_batched_tokens is None and sc.enable_chunked_prefill:
            sc.max_num_batched_tokens = platform.default_max_num_batched_tokens(self.usage_context)
        if mc.hf_config is not None:
            mc.resolve_dtype(platform.default_dtype, platform.supported_dtypes, platform.auto_dtype)
            self.scheduler_config.finalize(int(mc.max_model_len or 2048))
            if self.quant_config is not None:
                supported = self.quant_config.get_supported_act_dtypes()
                if mc.dtype not in supported:
                    raise ValueError(
                        f"quantization {self.quant_config.get_name()!r} does not run with "
                        f"dtype={_dtype_name(mc.dtype)}; supported: {', '.join(_dtype_name(d) for d in supported)}")
        else:
            self.scheduler_config.finalize(self.scheduler_config.max_model_len)
        if self.speculative_config is not None:
            from pagedlm.core.spec_decode.config import check_speculative_config

            check_speculative_config(self)
        self._resolve_async_scheduling(platform.supports_async_scheduling)
        if self.compilation_config.cudagraph_mode == "NONE":
            self.enforce_eager = True
        if self.kv_transfer_config is not None:
            from pagedlm.core.distributed.kv_transfer.factory import check_kv_transfer_config

            check_kv_transfer_config(self)
        platform.check_and_update_config(self)
        get_plugins().check_and_update_config(self)
        self.freeze()

    def freeze(self) -> None:
        """Make this config and its parts read-only (:meth:`finalize` ends with it)."""
        for f in dataclasses.fields(self):
            part = getattr(self, f.name)
            if isinstance(part, _Freezable):
                part.freeze()
        super().freeze()

    def for_data_parallel_rank(self, rank: int) -> VllmConfig:
        """The final config of data-parallel replica ``rank``: this one with its rank (which picks
        the replica's devices); the other parts are shared (they are frozen)."""
        assert self.frozen, "finalize() the config before deriving the replicas' configs"
        replica = dataclasses.replace(
            self, parallel_config=dataclasses.replace(self.parallel_config, data_parallel_rank=rank))
        replica.freeze()
        return replica

    def _resolve_async_scheduling(self, platform_default: bool) -> None:
        sc, pc = self.scheduler_config, self.parallel_config
        # NOTE: only the in-process executor keeps the sampled tokens on the device between steps;
        # the multi-process ones return them to the host every step (pipeline stages need them).
        one_process = pc.distributed_executor_backend == "uni" and pc.data_parallel_size == 1
        if sc.async_scheduling is None:
            sc.async_scheduling = platform_default and one_process
        elif sc.async_scheduling and not one_process:
            raise ValueError(
                f"async_scheduling=True needs the in-process executor (distributed_executor_backend='uni', one "
                f"rank, data_parallel_size=1); got distributed_executor_backend="
                f"{pc.distributed_executor_backend!r}, tensor_parallel_size={pc.tensor_parallel_size}, "
                f"pipeline_parallel_size={pc.pipeline_parallel_size}, data_parallel_size={pc.data_parallel_size}"
            )

    @property
    def max_model_len(self) -> int:
        return int(self.model_config.max_model_len or self.scheduler_config.max_model_len)
