"""``EngineArgs``: the flat list of engine options shared by ``LLM(...)`` and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import typing
from dataclasses import dataclass, field
from typing import Any

from pagedlm.core import envs
from pagedlm.core.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    ProfilerConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    VllmConfig,
)
from pagedlm.core.distributed.kv_transfer.config import KVTransferConfig
from pagedlm.core.platforms import resolve_platform
from pagedlm.core.spec_decode.config import SpeculativeConfig

_HELP = {
    "model": "local HF model directory (config.json, *.safetensors, tokenizer.json) or a .gguf file; "
    "default: the default model when installed (pagedlm-models-gemma[default-model])",
    "tokenizer": "tokenizer directory (default: the model directory)",
    "dtype": "auto, float32, bfloat16 or float16 (auto: the checkpoint's dtype, or the platform default)",
    "device": "auto or a registered platform name (cpu, cuda, ...)",
    "seed": "random seed for weights of dummy models and for unseeded sampling",
    "max_model_len": "context length (prompt + output); default: from config.json",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "num_gpu_blocks_override": "fix the number of KV-cache blocks (on any device)",
    "gpu_memory_utilization": "fraction of GPU memory pagedlm may use",
    "kv_cache_memory_bytes": "bytes for the KV cache (overrides the platform's sizing)",
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "token budget per step (prefill chunks + decodes)",
    "enable_chunked_prefill": "split long prompts across steps",
    "async_scheduling": "schedule step N+1 while the device runs step N (default: on where the platform "
    "gains from it, e.g. CUDA, with one process)",
    "stream_interval": "streamed outputs carry at least this many new tokens (the first token and the last "
    "output are sent at once); larger values cost less host time per token (vLLM's --stream-interval)",
    "scheduling_policy": "fcfs (first come, first served) or priority (by each request's priority, lower "
    "first, ties by arrival; preemption evicts the lowest priority first)",
    "tensor_parallel_size": "ranks per tensor-parallel group",
    "pipeline_parallel_size": "pipeline stages",
    "data_parallel_size": "engine replicas",
    "distributed_executor_backend": "uni, mp or ray",
    "enable_expert_parallel": "MoE models: place whole experts on the tensor-parallel ranks instead of "
    "slicing every expert across them",
    "load_format": "auto, safetensors, pt (allows pickle files) or dummy (random weights)",
    "skip_tokenizer_init": "run without a tokenizer (token-id prompts only)",
    "trust_remote_code": "let transformers run code from the model directory",
    "served_model_name": "model name reported in outputs and by the server",
    "attention_backend": "force an attention backend by its registered name",
    "enforce_eager": "never capture device graphs",
    "compilation_config": 'vLLM\'s CompilationConfig as a JSON object (alias -cc), e.g. \'{"cudagraph_mode": '
    '"FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}\' (cudagraph_mode NONE, FULL_DECODE_ONLY, FULL, '
    "FULL_AND_PIECEWISE or PIECEWISE; cudagraph_capture_sizes; max_cudagraph_capture_size), or vLLM's level 0-3 "
    "(accepted, no effect: pagedlm does not run torch.compile)",
    "hf_overrides": "JSON object of HF config fields to override (nested objects update sub-configs)",
    "disable_log_stats": "collect no request statistics (LLM.get_metrics needs them; LLM() defaults to off)",
    "tokenizer_mode": "vLLM's option: 'auto' or 'hf' (both the fast HF tokenizer; other modes are refused)",
    "quantization": "quantization method: fp8 (quantizes a bf16/fp16 checkpoint as it loads), "
    "compressed-tensors, gptq, awq, or a plugin's; default: the checkpoint's quantization_config",
    "kv_cache_dtype": "auto (the model dtype) or fp8 (float8_e4m3 with per-layer scales)",
    "config_format": "vLLM's option: 'auto' or 'hf' (config.json, or a GGUF file's metadata)",
    "logits_processors": "custom logits processors, 'package.module:Class' names of vLLM-style "
    "LogitsProcessor subclasses (pagedlm.core.v1.sample.logits_processor)",
    "limit_mm_per_prompt": 'multimodal models: JSON object of the most items per prompt by modality, e.g. '
    '\'{"image": 2}\' (default 999 each)',
    "allowed_local_media_path": "multimodal chat: the directory file:// image URLs may read (default: none)",
    "mm_processor_cache_gb": "multimodal models: GiB of preprocessed images kept by content hash, so prompts "
    "that repeat an image (multi-turn chats) skip its preprocessing; 0 turns the cache off",
    "enable_mm_embeds": "multimodal models: accept precomputed image embeddings instead of images: in "
    "multi_modal_data a tensor [num_items, feature_size, hidden_size]; in chat, image_embeds parts",
    "allowed_media_domains": "multimodal chat: hosts http(s) image URLs may be fetched from (default: none; "
    "fetch limits: VLLM_IMAGE_FETCH_TIMEOUT seconds, PAGEDLM_MAX_IMAGE_FETCH_BYTES)",
    "enable_sleep_mode": "allow sleep()/wake_up() (the server's /sleep, /wake_up, /is_sleeping): free the device "
    "memory of weights and KV cache between uses",
    "runner": "generate, pooling (an embedding model: LLM.embed, /v1/embeddings) or auto",
    "convert": "embed: run a generative checkpoint as an embedding model (runner pooling); auto or none",
    "task": "vLLM's older option: embed (= --runner pooling) or generate",
    "pooler_config": 'JSON object of vLLM\'s PoolerConfig, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
    "(default: the checkpoint's sentence-transformers config, else LAST and normalize)",
    "enable_prompt_embeds": "accept {'prompt_embeds': tensor} prompts (embeddings instead of token ids)",
    "kv_transfer_config": 'JSON object of vLLM\'s KVTransferConfig: \'{"kv_connector": NAME, "kv_role": '
    '"kv_producer"|"kv_consumer"|"kv_both", "kv_connector_extra_config": {...}}\' (docs/distributed.md)',
    "kv_offloading_size": "GiB of host memory for a KV offload tier under the prefix cache (vLLM's "
    "--kv-offloading-size; alias --kv-offload-gib): evicted blocks go there and come back on a hit",
    "kv_offloading_backend": "the offload tier's implementation: native (pagedlm's OffloadingConnector)",
    "profiler_config": 'JSON object of vLLM\'s ProfilerConfig, e.g. \'{"profiler": "torch", "torch_profiler_dir": '
    '"./traces"}\' (start_profile/stop_profile; default: from VLLM_TORCH_PROFILER_DIR when set)',
    "enable_lora": "serve LoRA adapters (LoRARequest per request; docs/lora.md)",
    "max_loras": "most LoRA adapters in one batch (device slots)",
    "max_lora_rank": "largest LoRA rank accepted",
    "max_cpu_loras": "LoRA adapters kept in host memory (default: max_loras)",
    "lora_dtype": "dtype of the LoRA weights on the device: auto (the model's), float16, bfloat16, float32",
    "fully_sharded_loras": "vLLM's option (not supported: refused)",
    "structured_outputs_config": 'JSON object of vLLM\'s StructuredOutputsConfig, e.g. \'{"backend": "xgrammar"}\' '
    "(backend: auto, xgrammar or a plugin's; disable_any_whitespace, disable_additional_properties)",
    "reasoning_parser": "split a reasoning model's thinking from its answer (deepseek_r1, qwen3, or a plugin's); "
    "structured outputs then apply after the thinking",
    "speculative_config": 'JSON object of vLLM\'s SpeculativeConfig, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": DIR, '
    '"num_speculative_tokens": 4}\' (docs/speculative.md)',
}

#: the values of vLLM's options that mean what pagedlm does anyway
_ACCEPTED = {"tokenizer_mode": ("auto", "hf"), "config_format": ("auto", "hf")}


def _init_device_runtime(device: str) -> None:
    try:
        resolve_platform(device).init_device_runtime()
    except Exception:  # noqa: BLE001 - the config's own platform resolution reports it
        pass


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None
    stream_interval: int = 1
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    served_model_name: str | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False
    compilation_config: dict[str, Any] | int | CompilationConfig | None = None
    disable_log_stats: bool = False
    hf_overrides: dict[str, Any] | None = None
    tokenizer_mode: str = "auto"
    config_format: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    logits_processors: list[Any] | None = None
    enable_prompt_embeds: bool = False
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str = ""
    enable_mm_embeds: bool = False
    mm_processor_cache_gb: float = 4.0
    allowed_media_domains: list[str] | None = None
    enable_sleep_mode: bool = False
    runner: str = "auto"
    convert: str = "auto"
    task: str = "auto"
    pooler_config: dict[str, Any] | None = None
    profiler_config: dict[str, Any] | ProfilerConfig | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    kv_transfer_config: dict[str, Any] | KVTransferConfig | None = None
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    structured_outputs_config: dict[str, Any] | StructuredOutputsConfig | None = None
    reasoning_parser: str = ""
    speculative_config: dict[str, Any] | None = None
    additional_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def create_vllm_config(self) -> VllmConfig:
        for name, allowed in _ACCEPTED.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported; allowed: {', '.join(allowed)}")
        envs.check_vllm_environment()
        profiler = self.profiler_config if self.profiler_config is not None else envs.vllm_profiler_config()
        # NOTE: the device runtime's start needs nothing from the model config: it overlaps with
        # the config's loading (transformers' import dominates that) and is joined before return.
        device_init = threading.Thread(target=_init_device_runtime, args=(self.device,),
                                       name="pagedlm-device-init", daemon=True)
        device_init.start()
        try:
            return self._create_vllm_config(profiler)
        finally:
            device_init.join()

    def _create_vllm_config(self, profiler: Any) -> VllmConfig:
        return VllmConfig(
            profiler_config=ProfilerConfig.from_any(profiler),
            structured_outputs_config=self._structured_outputs_config(),
            model_config=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                seed=self.seed,
                max_model_len=self.max_model_len,
                skip_tokenizer_init=self.skip_tokenizer_init,
                trust_remote_code=self.trust_remote_code,
                served_model_name=self.served_model_name,
                hf_overrides=self.hf_overrides,
                quantization=self.quantization,
                logits_processors=self.logits_processors,
                enable_prompt_embeds=self.enable_prompt_embeds,
                limit_mm_per_prompt=self.limit_mm_per_prompt,
                allowed_local_media_path=self.allowed_local_media_path,
                enable_mm_embeds=self.enable_mm_embeds,
                mm_processor_cache_gb=self.mm_processor_cache_gb,
                allowed_media_domains=self.allowed_media_domains,
                enable_sleep_mode=self.enable_sleep_mode,
                runner=self.runner,
                convert=self.convert,
                task=self.task,
                pooler_config=self.pooler_config,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                cache_dtype=self.kv_cache_dtype,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,  # type: ignore[arg-type]
                enable_expert_parallel=self.enable_expert_parallel,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=self.async_scheduling,
                stream_interval=self.stream_interval,
                policy=self.scheduling_policy,
            ),
            load_config=LoadConfig(load_format=self.load_format),
            device_config=DeviceConfig(device=self.device),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            compilation_config=CompilationConfig.from_any(self.compilation_config),
            lora_config=LoRAConfig(max_lora_rank=self.max_lora_rank, max_loras=self.max_loras,
                                   max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype,
                                   fully_sharded_loras=self.fully_sharded_loras) if self.enable_lora else None,
            additional_config=dict(self.additional_config),
            kv_transfer_config=self._kv_transfer_config(),
            speculative_config=SpeculativeConfig.from_any(self.speculative_config),
        )

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        """``kv_transfer_config``, or the OffloadingConnector that ``kv_offloading_size`` stands for."""
        config = KVTransferConfig.from_any(self.kv_transfer_config)
        size = self.kv_offloading_size
        if size is None:
            return config
        if isinstance(size, bool) or not isinstance(size, int | float) or size <= 0:
            raise ValueError(f"kv_offloading_size={size!r} is invalid: a positive number of GiB")
        if self.kv_offloading_backend != "native":
            raise ValueError(f"kv_offloading_backend={self.kv_offloading_backend!r} is not supported; allowed: native")
        if config is not None:
            raise ValueError("kv_offloading_size and kv_transfer_config both choose a KV connector; give one "
                             "(kv_transfer_config={'kv_connector': 'OffloadingConnector', 'kv_connector_extra_config': "
                             "{'cpu_bytes_to_use': N}} is what kv_offloading_size sets)")
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes_to_use": int(size * 2**30)})

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        config = StructuredOutputsConfig.from_any(self.structured_outputs_config)
        if self.reasoning_parser:
            if config.reasoning_parser and config.reasoning_parser != self.reasoning_parser:
                raise ValueError(f"reasoning_parser={self.reasoning_parser!r} and structured_outputs_config's "
                                 f"reasoning_parser={config.reasoning_parser!r} disagree; give one")
            config = dataclasses.replace(config, reasoning_parser=self.reasoning_parser)
        return config

    # -- command line -------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *,
                     skip: tuple[str, ...] = ("additional_config",)) -> argparse.ArgumentParser:
        """Add ``--model``, ``--max-model-len``, ... (one option per field) to ``parser``; returns
        ``parser`` (as vLLM's does, so ``parser = EngineArgs.add_cli_args(parser)`` works)."""
        group = parser.add_argument_group("engine options")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            flags = (flag, "-cc") if f.name == "compilation_config" else (flag,)
            hint = hints[f.name]
            base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
            if base is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                   help=_HELP.get(f.name))
            elif typing.get_origin(base) is list:  # one or more values: --flag A B
                group.add_argument(flag, nargs="+", default=f.default, help=_HELP.get(f.name), dest=f.name)
            else:
                parse = json.loads if typing.get_origin(base) is dict else base  # JSON objects on the CLI
                group.add_argument(*flags, type=parse, default=f.default, help=_HELP.get(f.name),
                                   dest=f.name)
        if "kv_offloading_size" not in skip:
            group.add_argument("--kv-offload-gib", type=float, dest="kv_offloading_size", default=None,
                               help="alias of --kv-offloading-size")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{name: getattr(args, name) for name in cls.names() if hasattr(args, name)})


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the engine options of ``AsyncLLM`` (``AsyncLLM.from_engine_args``): the same
    options as :class:`EngineArgs`."""
