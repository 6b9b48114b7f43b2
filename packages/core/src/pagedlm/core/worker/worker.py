"""A worker: one device rank. Owns the device, the model runner and the KV cache."""

from __future__ import annotations

import torch

from pagedlm.core.config import VllmConfig
from pagedlm.core.logger import init_logger
from pagedlm.core.platforms import resolve_platform
from pagedlm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedlm.core.worker.model_runner import ModelRunner

logger = init_logger(__name__)


class Worker:
    def __init__(self, vllm_config: VllmConfig, *, local_rank: int = 0, rank: int = 0) -> None:
        self.vllm_config = vllm_config
        self.local_rank = local_rank
        self.rank = rank
        self.platform = resolve_platform(vllm_config.device_config.device)
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.device = self.platform.set_device(self.local_rank)
        torch.manual_seed(self.vllm_config.model_config.seed)
        self.model_runner = ModelRunner(self.vllm_config, self.device)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def kv_cache_bytes_per_block(self) -> int:
        assert self.model_runner is not None
        return self.model_runner.kv_cache_bytes_per_block()

    def determine_num_available_blocks(self) -> int:
        """Blocks that fit in the memory the platform grants the KV cache on this rank."""
        assert self.model_runner is not None and self.device is not None
        override = self.vllm_config.cache_config.num_gpu_blocks_override
        if override is not None:
            return override
        budget = self.platform.kv_cache_memory_bytes(self.vllm_config, self.device)
        return max(budget // self.kv_cache_bytes_per_block(), 0)

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model_runner is not None
        return self.model_runner.execute_model(scheduler_output)
