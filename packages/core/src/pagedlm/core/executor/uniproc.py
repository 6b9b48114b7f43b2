"""One worker in the engine's own process."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedlm.core.executor.abstract import Executor, WorkerCall, done_future
from pagedlm.core.kv_cache.spec import AttentionSpec, KVCacheGroupSpec
from pagedlm.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedlm.core.worker.worker import Worker


class UniProcExecutor(Executor):
    in_process_workers = True

    def _init_executor(self) -> None:
        self.worker = Worker(self.vllm_config, local_rank=0, rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def get_kv_cache_specs(self) -> dict[str, AttentionSpec]:
        return self.worker.get_kv_cache_specs()

    def set_kv_cache_groups(self, groups: list[KVCacheGroupSpec]) -> None:
        self.worker.set_kv_cache_groups(groups)

    def determine_num_available_blocks(self) -> int:
        return self.worker.determine_num_available_blocks()

    def kv_cache_bytes_per_block(self) -> int:
        return self.worker.kv_cache_bytes_per_block()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if non_block and self.vllm_config.scheduler_config.async_scheduling:
            # The step is queued on the device; result() waits for its tokens.
            return self.worker.execute_model(scheduler_output, non_block=True)  # type: ignore[return-value]
        output = self.worker.execute_model(scheduler_output)
        assert isinstance(output, ModelRunnerOutput)
        return done_future(output) if non_block else output

    @property
    def supports_deferred_sampling(self) -> bool:  # type: ignore[override]
        return self.vllm_config.scheduler_config.async_scheduling

    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        return self.worker.sample_tokens(grammar_output, non_block=non_block)  # type: ignore[return-value]

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        # NOTE: in this process: the call runs to its end (``timeout`` cannot interrupt it).
        return [WorkerCall(method)(self.worker, tuple(args), dict(kwargs or {}))]
