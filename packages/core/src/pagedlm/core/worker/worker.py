"""A worker: one device rank. Owns the device, the model runner and the KV cache."""

from __future__ import annotations

from typing import Any

import torch

from pagedlm.core.config import VllmConfig
from pagedlm.core.distributed import (
    destroy_distributed_environment,
    get_pp_group,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from pagedlm.core.kv_cache.spec import AttentionSpec, KVCacheGroupSpec
from pagedlm.core.logger import init_logger
from pagedlm.core.platforms import resolve_platform
from pagedlm.core.plugins import resolve_class_path
from pagedlm.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedlm.core.worker.model_runner import AsyncModelRunnerOutput, ModelRunner
from pagedlm.core.worker.profiler import WorkerProfiler
from pagedlm.core.worker.sleep import SleepState

logger = init_logger(__name__)


class Worker:
    """``rank`` is the global rank (``pp_rank * tp + tp_rank``); ``local_rank`` picks the device
    on this host. ``distributed_init_method`` (``tcp://host:port``) is needed for more than one
    rank."""

    def __init__(self, vllm_config: VllmConfig, *, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        self.vllm_config = vllm_config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.platform = resolve_platform(vllm_config.device_config.device)
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        self.profiler: WorkerProfiler | None = None
        #: the worker half of kv_transfer_config's KV connector (built with the KV cache)
        self.kv_connector = None
        #: sleep mode (enable_sleep_mode): what is asleep on this worker
        self.sleep_state = SleepState()
        self.num_kv_blocks = 0

    def init_device(self) -> None:
        self.device = self.platform.set_device(self.local_rank)
        pc = self.vllm_config.parallel_config
        if pc.world_size > 1:
            self.platform.configure_threads(pc.world_size * pc.data_parallel_size)
            if self.distributed_init_method is None:
                raise ValueError("a multi-rank worker needs distributed_init_method")
            init_distributed_environment(world_size=pc.world_size, rank=self.rank,
                                         init_method=self.distributed_init_method,
                                         backend=self.platform.dist_backend)
            initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        torch.manual_seed(self.vllm_config.model_config.seed)
        runner_cls = resolve_class_path(self.platform.get_model_runner_cls(self.vllm_config))
        self.model_runner = runner_cls(self.vllm_config, self.device)
        if self.vllm_config.profiler_config.profiler == "torch":
            dp = pc.data_parallel_rank
            pp, tp = get_pp_group().rank_in_group, get_tp_group().rank_in_group
            self.profiler = WorkerProfiler(self.vllm_config.profiler_config, rank=self.rank,
                                           name_suffix=f"dp{dp}_pp{pp}_tp{tp}",
                                           device_activity=self.platform.profiler_activity)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def get_kv_cache_specs(self) -> dict[str, AttentionSpec]:
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_specs()

    def set_kv_cache_groups(self, groups: list[KVCacheGroupSpec]) -> None:
        assert self.model_runner is not None
        self.model_runner.set_kv_cache_groups(groups)

    def kv_cache_bytes_per_block(self) -> int:
        assert self.model_runner is not None
        return self.model_runner.kv_cache_bytes_per_block()

    def determine_num_available_blocks(self) -> int:
        """Blocks that fit in the memory the platform grants the KV cache on this rank."""
        assert self.model_runner is not None and self.device is not None
        override = self.vllm_config.cache_config.num_gpu_blocks_override
        if override is not None:
            return override
        # NOTE: the peak must be this engine's (weights + the profiling pass, plus whatever else is
        # still allocated), not a peak the process reached before, e.g. under a model since freed.
        self.platform.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run()
        budget = self.platform.kv_cache_memory_bytes(self.vllm_config, self.device)
        return max(budget // self.kv_cache_bytes_per_block(), 0)

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.model_runner is not None
        self.num_kv_blocks = num_blocks
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.vllm_config.kv_transfer_config is not None:
            from pagedlm.core.distributed.kv_transfer.worker_step import create_worker_connector

            self.kv_connector = create_worker_connector(self.vllm_config, self.model_runner)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run one step. ``non_block``: return once the step is queued (async scheduling).

        NOTE: the scheduler output is all this rank learns: a pipeline stage that does not sample
        gets the sampled tokens it must feed from ``CachedRequestData.new_token_ids``."""
        assert self.model_runner is not None
        if self.profiler is not None:
            self.profiler.step()
        if self.kv_connector is not None:
            from pagedlm.core.distributed.kv_transfer.worker_step import execute_with_kv_connector

            return execute_with_kv_connector(self.kv_connector, self.model_runner, scheduler_output, non_block)
        return self.model_runner.execute_model(scheduler_output, non_block=non_block)

    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: bool = False) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Finish a step run with ``pending_structured_output_tokens`` (``ModelRunner.sample_tokens``)."""
        assert self.model_runner is not None
        return self.model_runner.sample_tokens(grammar_output, non_block=non_block)

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Start or stop this worker's torch profiler (``LLM.start_profile`` / ``stop_profile``)."""
        if self.profiler is None:
            raise RuntimeError("profiling is not enabled: pass LLM(profiler_config={'profiler': 'torch', "
                               "'torch_profiler_dir': DIR}) (--profiler-config) or set VLLM_TORCH_PROFILER_DIR")
        if is_start:
            self.profiler.start(profile_prefix)
        else:
            self.profiler.stop()

    def sleep(self, level: int = 1) -> None:
        """Free this rank's device memory (worker/sleep.py): level 1 keeps the weights in host
        memory, level 2 reads them again on wake; the KV cache is dropped."""
        assert self.model_runner is not None
        self.sleep_state.sleep(self.model_runner, level, self.num_kv_blocks)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both)."""
        assert self.model_runner is not None
        self.sleep_state.wake_up(self.model_runner, tags)

    def get_model(self) -> Any:
        """This rank's model (``torch.nn.Module``; vLLM's ``Worker.get_model``)."""
        assert self.model_runner is not None
        return self.model_runner.model

    # -- LoRA adapters (vLLM's Worker methods; arguments may be msgpack values) -------------
    def add_lora(self, lora_request: Any) -> bool:
        """Read an adapter into this rank's host cache (``LoRARequest`` or its wire form)."""
        from pagedlm.core.lora.request import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            lora_request = LoRARequest.from_wire(lora_request)
        return self._lora_manager().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove_adapter(int(lora_id))

    def list_loras(self) -> list[int]:
        return sorted(self._lora_manager().list_adapters())

    def lora_targets(self) -> dict[str, list[int]]:
        """HF module path -> [in, out] of every module an adapter may target on this rank."""
        return self._lora_manager().targets

    def _lora_manager(self) -> Any:
        assert self.model_runner is not None
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise ValueError("LoRA is not enabled: pass enable_lora=True (--enable-lora)")
        return manager

    def check_health(self) -> None:
        """Returns if the worker can serve calls (the executor times the answer)."""

    def shutdown(self) -> None:
        if self.profiler is not None:
            self.profiler.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        destroy_distributed_environment()
