"""LLMEngine: the synchronous engine (add_request / step / abort) the ``LLM`` class drives."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pagedlm.core.config import VllmConfig
from pagedlm.core.engine.arg_utils import EngineArgs
from pagedlm.core.engine.core_client import InprocClient
from pagedlm.core.engine.output_processor import OutputProcessor
from pagedlm.core.engine.processor import Processor, PromptType
from pagedlm.core.engine.tokenizer import get_tokenizer
from pagedlm.core.metrics.reader import Metric, MetricsCollector
from pagedlm.core.metrics.stats import EngineStatsSnapshot, IterationStats, RequestStatsTracker
from pagedlm.core.outputs import RequestOutput
from pagedlm.core.request import EngineCoreRequest
from pagedlm.core.sampling_params import SamplingParams


def output_prompt_ids(core_request: EngineCoreRequest) -> list[int] | None:
    """The prompt ids outputs report: None for a prompt given as embeddings, as vLLM's."""
    return None if core_request.prompt_embeds is not None else core_request.prompt_token_ids


def fan_out(core_request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The engine requests of one user request: itself for n == 1, else n children of n == 1.

    Child i is ``f"{i}_{request_id}"``; with a seed it samples with ``seed + i``, so a seeded
    request with n > 1 is reproducible and its choices still differ. (Shared with AsyncLLM.)
    """
    params = core_request.sampling_params
    if params.n == 1:
        return [core_request]
    children = []
    for i in range(params.n):
        child_params = params.clone()
        child_params.n = 1
        if params.seed is not None:
            child_params.seed = params.seed + i
        children.append(EngineCoreRequest(
            request_id=f"{i}_{core_request.request_id}", prompt_token_ids=core_request.prompt_token_ids,
            sampling_params=child_params, arrival_time=core_request.arrival_time,
            prompt_embeds=core_request.prompt_embeds, lora_request=core_request.lora_request,
            priority=core_request.priority,
        ))
    return children


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig, *, log_stats: bool = False) -> None:
        # NOTE: final before any engine process starts; every process reads this same config.
        vllm_config.finalize()
        self.vllm_config = vllm_config
        mc = vllm_config.model_config
        if mc.hf_config is None:
            raise ValueError("no model given: pass model=DIR (a local HF model directory)")
        self.tokenizer: Any | None = None
        if not mc.skip_tokenizer_init:
            assert mc.tokenizer is not None
            self.tokenizer = get_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code,
                                           revision=mc.revision, architectures=mc.architectures)
        if vllm_config.parallel_config.data_parallel_size > 1:
            from pagedlm.core.engine.dp_client import DPClient

            self.engine_core: InprocClient | DPClient = DPClient(vllm_config)
        else:
            self.engine_core = InprocClient(vllm_config)
        self.processor = Processor(vllm_config, self.tokenizer)
        self.output_processor = OutputProcessor(
            self.tokenizer, stream_interval=vllm_config.scheduler_config.stream_interval,
            pooler_normalize=mc.pooler_normalize)
        #: request statistics for get_metrics (per output of every step: off unless asked for)
        self._tracker = RequestStatsTracker() if log_stats else None
        self._collector = MetricsCollector(vllm_config.model_config.name, vllm_config.max_model_len)
        from pagedlm.core.lora.frontend import LoRARegistry

        #: the adapters checked against the model (LoRA: add_lora, lora_request=)
        self.lora_registry = LoRARegistry(vllm_config.lora_config)
        if vllm_config.lora_config is not None:
            self.lora_registry.set_targets(self.collective_rpc("lora_targets"))
        #: sleep mode: asleep (LLM.sleep) until every part is awake again
        self.sleeping = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_vllm_config(), log_stats=not engine_args.disable_log_stats)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics (vLLM's ``LLM.get_metrics``); needs ``disable_log_stats=False``."""
        if self._tracker is None:
            raise ValueError("metrics are not collected: pass disable_log_stats=False (LLM() defaults to True)")
        if isinstance(self.engine_core, InprocClient):  # replicas of data parallelism run elsewhere
            self._collector.record(EngineStatsSnapshot.from_engine_core(self.core), None)
        return self._collector.metrics()

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    arrival_time: float | None = None, add_special_tokens: bool = True,
                    lora_request: Any = None, priority: int = 0) -> None:
        """Validate and queue a request; raises ValueError for bad input (nothing is queued)."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        if self.lora_registry.needs_check(lora_request):
            self.add_lora(lora_request)
        core_request, text = self.processor.process(request_id, prompt, params, arrival_time=arrival_time,
                                                    add_special_tokens=add_special_tokens,
                                                    lora_request=lora_request, priority=priority)
        self.add_processed_request(core_request, text)

    def add_processed_request(self, core_request: EngineCoreRequest, text: str | None,
                              pooling_params: Any = None) -> None:
        """Queue a request that ``self.processor.process`` already validated (a pooling request
        with its ``PoolingParams``)."""
        if self.sleeping:
            raise ValueError("the engine is sleeping (LLM.sleep): call wake_up() before generating")
        request_id = core_request.request_id
        params = core_request.sampling_params
        children = fan_out(core_request)
        self.output_processor.add_request(
            request_id, text, output_prompt_ids(core_request), params,
            [c.request_id for c in children], [c.sampling_params for c in children], pooling_params=pooling_params,
        )
        if self._tracker is not None:
            self._tracker.add(request_id, [c.request_id for c in children], len(core_request.prompt_token_ids),
                              n=params.n, max_tokens=params.max_tokens)
        for child in children:
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))
        if self._tracker is not None:
            stats = IterationStats()
            for request_id in request_ids:
                self._tracker.finish(request_id, "abort", time.monotonic(), stats)
            self._collector.record(None, stats)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        request_outputs, to_abort = self.output_processor.process_outputs(outputs)
        self.engine_core.abort_requests(to_abort)
        if self._tracker is not None:
            now, stats = time.monotonic(), IterationStats()
            self._tracker.on_outputs(outputs, now, stats)
            if to_abort:
                self._tracker.finish_children(to_abort, "stop", now, stats)
            for out in request_outputs:
                if out.finished:
                    reason = finish_reason_of(out)
                    self._tracker.finish(out.request_id, reason, now, stats)
            self._collector.record(None, stats)
        return request_outputs

    # -- LoRA adapters (vLLM's LLMEngine methods) ---------------------------------------------
    def add_lora(self, lora_request: Any) -> bool:
        """Check an adapter against the model and read it into the workers' host caches;
        ``ValueError`` for one this engine cannot run. False if it was loaded already."""
        if not self.lora_registry.check(lora_request):
            return False
        return all(self.collective_rpc("add_lora", args=(lora_request,)))

    def remove_lora(self, lora_id: int) -> bool:
        """Drop adapter ``lora_id`` from the workers (a later request reads it again)."""
        if self.vllm_config.lora_config is None:
            return False
        self.lora_registry.forget(lora_id)
        return any(self.collective_rpc("remove_lora", args=(lora_id,)))

    def list_loras(self) -> set[int]:
        """Ids of the adapters the workers hold (host cache and slots)."""
        if self.vllm_config.lora_config is None:
            return set()
        return set(self.collective_rpc("list_loras")[0])

    # -- sleep mode -----------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the device memory of weights and KV cache (see ``LLM.sleep``)."""
        self._inproc_core("sleep").sleep(level)
        self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        core = self._inproc_core("wake_up")
        core.wake_up(tags)
        self.sleeping = core.is_sleeping()

    def _inproc_core(self, what: str) -> Any:
        if not isinstance(self.engine_core, InprocClient):
            raise ValueError(f"{what} is not supported with data parallelism (data_parallel_size > 1)")
        return self.core

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing reset) while requests hold blocks."""
        return self.core.reset_prefix_cache()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` on every worker; their results in rank order (see ``LLM.collective_rpc``)."""
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` on every worker's model; the results in rank order."""
        return self.collective_rpc(_apply_to_model, args=(func,))

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start every worker's torch profiler (needs ``profiler_config``, see ``LLM.start_profile``)."""
        self.engine_core.profile(True, profile_prefix)

    def stop_profile(self) -> None:
        """Stop the profilers: each worker writes its trace."""
        self.engine_core.profile(False)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    @property
    def num_gpu_blocks(self) -> int:
        """KV-cache blocks the engine core allocated (the smallest replica's with data parallelism)."""
        return self.engine_core.num_gpu_blocks

    @property
    def core(self):
        """The in-process EngineCore (stats listeners, prefix-cache reset)."""
        return self.engine_core.engine_core

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def finish_reason_of(out: Any) -> str:
    """A finished output's reason for the request statistics (a pooling output just finished)."""
    if not isinstance(out, RequestOutput):
        return "stop"
    return "error" if out.error else (out.outputs[0].finish_reason or "stop")


def _apply_to_model(worker: Any, func: Callable[[Any], Any]) -> Any:
    """``apply_model``'s worker side (module-level: worker processes load it by name)."""
    return func(worker.get_model())
