"""EngineCore: the step loop (schedule -> execute -> update) around one executor."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedlm.core.config import VllmConfig
from pagedlm.core.executor import Executor
from pagedlm.core.kv_cache import KVCacheManager
from pagedlm.core.kv_cache.spec import KVCacheGroupSpec, group_size, make_kv_cache_groups, max_blocks_per_request
from pagedlm.core.logger import init_logger
from pagedlm.core.multimodal.encoder_cache import make_encoder_cache_manager
from pagedlm.core.request import EngineCoreRequest, Request, RequestStatus
from pagedlm.core.sched import EngineCoreOutput, Scheduler, SchedulerStats
from pagedlm.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedlm.core.spec_decode.engine_step import synchronous_step
from pagedlm.core.structured_output.manager import StructuredOutputManager

logger = init_logger(__name__)

#: called once per step with that step's scheduler stats (see EngineCore.add_stats_listener)
StatsListener = Callable[[SchedulerStats], None]


class EngineCore:
    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor] | None = None) -> None:
        start = time.perf_counter()
        if not vllm_config.frozen:
            raise ValueError("EngineCore needs a final config: call vllm_config.finalize() in the front end, "
                             "before the engine core starts")
        self.vllm_config = vllm_config
        executor_class = executor_class or Executor.get_class(vllm_config)
        self.executor = executor_class(vllm_config)
        executor_s = time.perf_counter() - start
        try:
            #: KV-cache blocks allocated on every rank (the front end reports it)
            num_blocks, kv_cache_groups = self._initialize_kv_cache()
            self.num_gpu_blocks = num_blocks
        except BaseException:
            self.executor.shutdown()
            raise
        # which part of a slow start-up to look at (the model load and the KV cache log their own)
        total_s = time.perf_counter() - start
        logger.info("engine core ready in %.2fs: executor (workers, device, model) %.2fs, KV cache %.2fs",
                    total_s, executor_s, total_s - executor_s)
        sc = vllm_config.scheduler_config
        cc = vllm_config.cache_config
        # Pipeline parallelism: up to pp_size batches in flight, so every stage has work
        # (a request is in at most one of them: the scheduler skips requests whose sampled
        # token is not back yet). Async scheduling: two batches, the one the device runs and
        # the next, scheduled meanwhile on output placeholders.
        pipeline_depth = self.executor.max_concurrent_batches
        self.scheduler = Scheduler(
            kv_cache_manager=KVCacheManager(
                num_blocks=num_blocks,
                block_size=cc.block_size,
                enable_caching=cc.enable_prefix_caching,
                max_model_len=vllm_config.max_model_len,
                kv_cache_groups=kv_cache_groups,
            ),
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=int(sc.max_num_batched_tokens or 8192),
            max_model_len=vllm_config.max_model_len,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            async_scheduling=bool(sc.async_scheduling),
            pipeline_depth=pipeline_depth,
            max_loras=vllm_config.lora_config.max_loras if vllm_config.lora_config is not None else None,
            kv_connector=self._create_kv_connector(num_blocks),
            kv_load_failure_policy=(vllm_config.kv_transfer_config.kv_load_failure_policy
                                    if vllm_config.kv_transfer_config is not None else "recompute"),
            encoder_cache=make_encoder_cache_manager(vllm_config),
            structured_output_manager=StructuredOutputManager(vllm_config,
                                                              pinned_bitmasks=self.executor.in_process_workers),
            speculative_config=vllm_config.speculative_config,
            policy=sc.policy,
        )
        self._stats_listeners: list[StatsListener] = []
        #: ``pause_scheduler``: nothing new is scheduled (batches in flight still finish)
        self.paused = False
        #: sleep mode: the parts asleep ("weights", "kv_cache"); the scheduler is paused meanwhile
        self.sleeping_tags: set[str] = set()
        self._paused_before_sleep = False
        depth = 2 if sc.async_scheduling else pipeline_depth
        self.batch_queue: deque[tuple[Future, SchedulerOutput]] | None = deque() if depth > 1 else None
        self.batch_queue_size = depth
        #: the sampling of the newest step while its grammar bitmask is still filling
        self._deferred_sample: _DeferredSample | None = None

    def _create_kv_connector(self, num_blocks: int) -> Any:
        """The scheduler half of kv_transfer_config's KV connector, or None."""
        if self.vllm_config.kv_transfer_config is None:
            return None
        from pagedlm.core.distributed.kv_transfer.base import KVCacheInfo, KVConnectorRole
        from pagedlm.core.distributed.kv_transfer.factory import create_kv_connector

        info = KVCacheInfo(num_blocks=num_blocks, block_size=self.vllm_config.cache_config.block_size,
                           bytes_per_block=self.executor.kv_cache_bytes_per_block())
        return create_kv_connector(self.vllm_config, KVConnectorRole.SCHEDULER, info)

    def _initialize_kv_cache(self) -> tuple[int, list[KVCacheGroupSpec]]:
        cc = self.vllm_config.cache_config
        start = time.perf_counter()
        groups = make_kv_cache_groups(self.executor.get_kv_cache_specs())
        self.executor.set_kv_cache_groups(groups)
        num_blocks = self.executor.determine_num_available_blocks()
        max_len = self.vllm_config.max_model_len
        # what one request of max_model_len holds at most at once, over all KV-cache groups
        needed = max_blocks_per_request(groups, max_len, cc.block_size,
                                        int(self.vllm_config.scheduler_config.max_num_batched_tokens or 8192))
        if cc.num_gpu_blocks_override is None:
            # NOTE: more blocks than max_num_seqs full-length requests can hold would only keep
            # more of the prefix cache, at the price of start-up time and memory; cap there.
            num_blocks = min(num_blocks, needed * self.vllm_config.scheduler_config.max_num_seqs)
        if num_blocks < needed:
            bytes_per_block = self.executor.kv_cache_bytes_per_block()
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cc.block_size} tokens "
                f"({num_blocks * cc.block_size} tokens), but one request of max_model_len={max_len} needs "
                f"{needed} blocks ({needed * bytes_per_block / 2**20:.1f} MiB). Raise num_gpu_blocks_override "
                "(or kv_cache_memory_bytes / gpu_memory_utilization), or lower max_model_len."
            )
        self.executor.initialize_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks x %d tokens, %d group(s) of %d layer(s); max concurrency %.1fx at "
            "max_model_len=%d (%.2fs)", num_blocks, cc.block_size, len(groups), group_size(groups),
            num_blocks / needed, max_len, time.perf_counter() - start,
        )
        return num_blocks, groups

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        req = Request.from_engine_core_request(request, self.vllm_config.max_model_len)
        if self.vllm_config.model_config.logits_processors:
            # Custom logits processors read the output token lists: no step may run ahead of a
            # token still on the device (async scheduling).
            req.needs_output_history = True
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def has_work(self) -> bool:
        """Whether ``step`` would do anything: batches in flight, or requests to schedule."""
        return bool(self.batch_queue) or (not self.paused and self.scheduler.has_unfinished_requests())

    def pause_scheduler(self) -> None:
        """Schedule nothing until :meth:`resume_scheduler`; requests keep their state and blocks
        (``AsyncLLM.pause_generation(mode="keep")``)."""
        if self.sleeping_tags:
            self._paused_before_sleep = True  # stays paused after the wake-up
        self.paused = True

    def resume_scheduler(self) -> None:
        if self.sleeping_tags:
            self._paused_before_sleep = False  # resumes with the wake-up, not before
            return
        self.paused = False

    def is_paused(self) -> bool:
        return self.paused

    # -- sleep mode (enable_sleep_mode) ------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the workers' device memory (worker/sleep.py). Refused while requests are in the
        engine; requests that arrive while asleep wait (nothing is scheduled) until wake_up."""
        if not self.vllm_config.model_config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"level={level!r} must be 1 (weights to host memory) or 2 (weights dropped)")
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError(f"cannot sleep with {self.scheduler.get_num_unfinished_requests()} request(s) in "
                               "the engine: let them finish (or abort them) first")
        if self.sleeping_tags:
            return  # already asleep (vLLM's sleep is idempotent too)
        self._drain_batch_queue()
        # NOTE: the KV cache comes back empty: no cached prefix may survive the sleep
        self.scheduler.kv_cache_manager.reset_prefix_cache()
        self.executor.collective_rpc("sleep", None, (level,), None)
        self.sleeping_tags = {"weights", "kv_cache"}
        self._paused_before_sleep, self.paused = self.paused, True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore ``tags`` ("weights", "kv_cache"; None: both); scheduling resumes once all are back."""
        if not self.sleeping_tags:
            return
        self.executor.collective_rpc("wake_up", None, (list(tags) if tags is not None else None,), None)
        self.sleeping_tags -= set(tags) if tags is not None else set(self.sleeping_tags)
        if not self.sleeping_tags:
            self.paused = self._paused_before_sleep

    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    # -- stepping ---------------------------------------------------------------------------
    def add_stats_listener(self, listener: StatsListener) -> None:
        """Receive a SchedulerStats sample after every step (costs nothing when none is set)."""
        self._stats_listeners.append(listener)

    def step(self) -> list[EngineCoreOutput]:
        outputs = self._step()
        if self.scheduler.failed_outputs:  # requests failed outside the step (their grammar)
            outputs = self.scheduler.failed_outputs + outputs
            self.scheduler.failed_outputs = []
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        if self.paused:
            # Only the batches already on the device finish.
            outputs: list[EngineCoreOutput] = []
            while self.batch_queue:
                future, scheduler_output = self.batch_queue.popleft()
                outputs.extend(self._update(scheduler_output, future.result()))
            return outputs
        if self.batch_queue is not None:
            return self._step_with_batch_queue(self.batch_queue)
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self._update(scheduler_output, runner_output)

    def _step_with_batch_queue(self, queue: deque[tuple[Future, SchedulerOutput]]) -> list[EngineCoreOutput]:
        """Submit a new batch while the queue has room; otherwise (or when nothing new can be
        scheduled) wait for the oldest batch and return its outputs."""
        spec = self.scheduler.spec
        if spec is not None and spec.steps_synchronously(len(self.scheduler.running)):
            return synchronous_step(self, queue)  # drafts need the last step's tokens
        outputs: list[EngineCoreOutput] = []
        if len(queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            # NOTE: an empty batch still goes out when it carries finished or preempted ids: the
            # workers must drop those requests (a preempted one resumes from its saved state).
            # (with a KV connector too: its workers report transfers only from steps they run)
            if not scheduler_output.is_empty or scheduler_output.finished_req_ids \
                    or scheduler_output.preempted_req_ids or scheduler_output.kv_connector_metadata is not None \
                    or self.scheduler.kv_transfer is not None:
                self._launch_deferred_sample()
                if self.scheduler.needs_grammar_bitmask(scheduler_output):
                    future = self._execute_with_grammar(scheduler_output, queue, outputs)
                else:
                    future = self.executor.execute_model(scheduler_output, non_block=True)
                queue.append((future, scheduler_output))  # type: ignore[arg-type]
                if len(queue) < self.batch_queue_size and scheduler_output.total_num_scheduled_tokens > 0:
                    return outputs
        if not queue:
            return outputs
        future, scheduler_output = queue.popleft()
        outputs.extend(self._update(scheduler_output, future.result()))
        # NOTE: once nothing is left to run, batches still in flight only carry tokens of finished
        # requests; drain them now so that no stale batch is waiting when new requests arrive.
        while queue and not self.scheduler.has_unfinished_requests():
            future, scheduler_output = queue.popleft()
            outputs.extend(self._update(scheduler_output, future.result()))
        return outputs

    def _execute_with_grammar(self, scheduler_output: SchedulerOutput, queue: deque[tuple[Future, SchedulerOutput]],
                              outputs: list[EngineCoreOutput]) -> Future | _DeferredSample:
        """Send out a step with grammar bitmask rows, whose matchers must first advance over the
        tokens of the batch in flight. Where the executor can, the forward goes out first and the
        bitmask is filled while it runs; its sampling (``sample_tokens``) goes out once the fill is
        done, at the latest when the core next calls the executor, so a fill left running on the
        fill thread overlaps the outputs' return and the next schedule. Otherwise the batch in
        flight is taken back before the step goes out."""
        deferred = self.executor.supports_deferred_sampling and self.scheduler.kv_transfer is None
        if deferred:
            scheduler_output.pending_structured_output_tokens = True
            self.executor.execute_model(scheduler_output, non_block=True)
        while queue:
            future, in_flight = queue.popleft()
            outputs.extend(self._update(in_flight, future.result()))
        if not deferred:
            self.scheduler.fill_grammar_bitmask(scheduler_output)
            return self.executor.execute_model(scheduler_output, non_block=True)  # type: ignore[return-value]
        fill = self.scheduler.fill_grammar_bitmask_deferred(scheduler_output)
        grammar = GrammarOutput(scheduler_output.structured_output_request_ids, scheduler_output.grammar_bitmask)
        if fill is None:  # filled already
            return self.executor.sample_tokens(grammar, non_block=True)  # type: ignore[return-value]
        self._deferred_sample = _DeferredSample(self, grammar, fill)
        return self._deferred_sample

    def _launch_deferred_sample(self) -> None:
        """Send out the sampling of a step whose bitmask was still filling: the executor's calls
        run in order, and that sampling comes before anything sent after it."""
        if self._deferred_sample is not None:
            self._deferred_sample.launch()

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self._stats_listeners:
            stats = self.scheduler.make_stats()
            for listener in self._stats_listeners:
                listener(stats)
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call a worker method (or ``method(worker, ...)``) on every worker, between steps."""
        self._drain_batch_queue()
        return self.executor.collective_rpc(method, timeout, tuple(args), kwargs)

    def lora_targets(self) -> list[dict[str, list[int]]]:
        """Each rank's table of LoRA-adaptable modules (``Worker.lora_targets``). NOTE: read-only,
        so it may run while steps are in flight (unlike ``collective_rpc``)."""
        return self.executor.collective_rpc("lora_targets")

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        self._drain_batch_queue()
        self.executor.profile(is_start, profile_prefix)

    def _drain_batch_queue(self) -> None:
        """Workers take calls only between steps: finish the batches still in flight once no
        request is left (their outputs belong to finished requests); refuse while requests run."""
        queue = self.batch_queue
        while queue and not self.scheduler.has_unfinished_requests():
            future, scheduler_output = queue.popleft()
            self._update(scheduler_output, future.result())
        if queue:
            raise RuntimeError("the engine has steps in flight; call this between generate() calls")

    def check_health(self) -> None:
        """Raise if the executor lost a worker."""
        self.executor.check_health()

    def shutdown(self) -> None:
        try:
            self._finish_kv_transfers()
        finally:
            som = self.scheduler.structured_output_manager if hasattr(self, "scheduler") else None
            if som is not None:
                som.shutdown()
            self.executor.shutdown()

    def _finish_kv_transfers(self, timeout_s: float = 30.0) -> None:
        """Run the steps that finish the KV connector's exports of finished requests (an offline
        producer's last requests are written out before the engine goes)."""
        kvt = getattr(self, "scheduler", None) and self.scheduler.kv_transfer
        if not kvt:
            return
        deadline = time.monotonic() + timeout_s
        while kvt.delayed_free and not (self.scheduler.waiting or self.scheduler.running) \
                and time.monotonic() < deadline:
            self.step()


class _DeferredSample:
    """The sampling of a step sent out before its bitmask was filled, in the batch queue in place
    of the step's future: ``launch`` waits for the fill and calls ``sample_tokens``; ``result``
    launches it if that has not happened yet."""

    __slots__ = ("_core", "_grammar", "_fill", "_future")

    def __init__(self, core: EngineCore, grammar: GrammarOutput, fill: Future) -> None:
        self._core = core
        self._grammar = grammar
        self._fill = fill
        self._future: Future | None = None

    def launch(self) -> None:
        if self._future is not None:
            return
        core = self._core
        core._deferred_sample = None
        som = core.scheduler.structured_output_manager
        assert som is not None
        som.wait_fill(self._fill)
        self._future = core.executor.sample_tokens(self._grammar, non_block=True)  # type: ignore[assignment]

    def result(self) -> ModelRunnerOutput:
        self.launch()
        assert self._future is not None
        return self._future.result()
