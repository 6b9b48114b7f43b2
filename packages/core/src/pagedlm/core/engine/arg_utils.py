"""``EngineArgs``: the flat list of engine options shared by ``LLM(...)`` and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from pagedlm.core import envs
from pagedlm.core.config import (
    CacheConfig,
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    ProfilerConfig,
    SchedulerConfig,
    VllmConfig,
)

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
    "hf_overrides": "JSON object of HF config fields to override (nested objects update sub-configs)",
    "disable_log_stats": "collect no request statistics (LLM.get_metrics needs them; LLM() defaults to off)",
    "tokenizer_mode": "vLLM's option: 'auto' or 'hf' (both the fast HF tokenizer; other modes are refused)",
    "quantization": "quantization method: fp8 (quantizes a bf16/fp16 checkpoint as it loads), "
    "compressed-tensors, gptq, awq, or a plugin's; default: the checkpoint's quantization_config",
    "kv_cache_dtype": "auto (the model dtype) or fp8 (float8_e4m3 with per-layer scales)",
    "config_format": "vLLM's option: 'auto' or 'hf' (config.json, or a GGUF file's metadata)",
    "logits_processors": "custom logits processors, 'package.module:Class' names of vLLM-style "
    "LogitsProcessor subclasses (pagedlm.core.v1.sample.logits_processor)",
    "enable_sleep_mode": "allow sleep()/wake_up() (the server's /sleep, /wake_up, /is_sleeping): free the device "
    "memory of weights and KV cache between uses",
    "runner": "generate, pooling (an embedding model: LLM.embed, /v1/embeddings) or auto",
    "convert": "embed: run a generative checkpoint as an embedding model (runner pooling); auto or none",
    "task": "vLLM's older option: embed (= --runner pooling) or generate",
    "pooler_config": 'JSON object of vLLM\'s PoolerConfig, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
    "(default: the checkpoint's sentence-transformers config, else LAST and normalize)",
    "enable_prompt_embeds": "accept {'prompt_embeds': tensor} prompts (embeddings instead of token ids)",
    "profiler_config": 'JSON object of vLLM\'s ProfilerConfig, e.g. \'{"profiler": "torch", "torch_profiler_dir": '
    '"./traces"}\' (start_profile/stop_profile; default: from VLLM_TORCH_PROFILER_DIR when set)',
}

#: the values of vLLM's options that mean what pagedlm does anyway
_ACCEPTED = {"tokenizer_mode": ("auto", "hf"), "config_format": ("auto", "hf")}


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
    disable_log_stats: bool = False
    hf_overrides: dict[str, Any] | None = None
    tokenizer_mode: str = "auto"
    config_format: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    logits_processors: list[Any] | None = None
    enable_prompt_embeds: bool = False
    enable_sleep_mode: bool = False
    runner: str = "auto"
    convert: str = "auto"
    task: str = "auto"
    pooler_config: dict[str, Any] | None = None
    profiler_config: dict[str, Any] | ProfilerConfig | None = None
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
        return VllmConfig(
            profiler_config=ProfilerConfig.from_any(profiler),
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
            additional_config=dict(self.additional_config),
        )

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
            hint = hints[f.name]
            base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
            if base is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                   help=_HELP.get(f.name))
            elif typing.get_origin(base) is list:  # one or more values: --flag A B
                group.add_argument(flag, nargs="+", default=f.default, help=_HELP.get(f.name), dest=f.name)
            else:
                parse = json.loads if typing.get_origin(base) is dict else base  # JSON objects on the CLI
                group.add_argument(flag, type=parse, default=f.default, help=_HELP.get(f.name),
                                   dest=f.name)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{name: getattr(args, name) for name in cls.names() if hasattr(args, name)})


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the engine options of ``AsyncLLM`` (``AsyncLLM.from_engine_args``): the same
    options as :class:`EngineArgs`."""
