"""The executor: runs the workers of all ranks and hands back one rank's output."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from pagedlm.core.config import VllmConfig
from pagedlm.core.kv_cache.spec import AttentionSpec, KVCacheGroupSpec
from pagedlm.core.sched.output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self._init_executor()

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from pagedlm.core.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from pagedlm.core.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from pagedlm.core.executor.ray_executor import RayExecutor

            return RayExecutor
        raise ValueError(f"distributed_executor_backend={backend!r} must be one of uni, mp, ray")

    @property
    def max_concurrent_batches(self) -> int:
        """How many batches the engine may have in flight at once (the pipeline depth)."""
        return 1

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers, init their devices and load the model."""

    @abstractmethod
    def get_kv_cache_specs(self) -> dict[str, AttentionSpec]:
        """Every rank's attention layers and their spans, merged (pipeline stages hold different
        layers; tensor-parallel ranks the same)."""

    @abstractmethod
    def set_kv_cache_groups(self, groups: list[KVCacheGroupSpec]) -> None:
        """Give every rank the KV-cache groups, before the cache is sized and allocated."""

    @abstractmethod
    def determine_num_available_blocks(self) -> int:
        """The number of KV blocks every rank can hold (the minimum over ranks)."""

    @abstractmethod
    def kv_cache_bytes_per_block(self) -> int: ...

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step. ``non_block=True`` returns a future at once (batches in flight, for
        pipeline parallelism); results then arrive in submission order."""

    def check_health(self) -> None:
        """Raise if a worker is dead."""

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""


def merge_kv_cache_specs(per_rank: list[dict[str, AttentionSpec]]) -> dict[str, AttentionSpec]:
    """One layer -> span map from every rank's, in layer order (ranks hold layers in stage order)."""
    merged: dict[str, AttentionSpec] = {}
    for specs in per_rank:
        merged.update(specs)
    return merged


def done_future(value: ModelRunnerOutput) -> Future[ModelRunnerOutput]:
    future: Future[ModelRunnerOutput] = Future()
    future.set_result(value)
    return future
