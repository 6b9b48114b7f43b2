"""AsyncLLM: the asyncio front end of the engine (what an HTTP server drives).

    llm = AsyncLLM.from_engine_args(EngineArgs(model=DIR))          # core in its own process
    async for out in llm.generate("Hello", SamplingParams(output_kind=RequestOutputKind.DELTA),
                                  request_id="r1"):
        print(out.outputs[0].text, end="")

Work split (DESIGN.md §5): this object tokenizes and validates (``Processor``), sends requests to
the engine core through an async client (in-process thread or background process, see
``async_client``), and one output-handler task per event loop receives the core's outputs,
detokenizes them (``OutputProcessor``) and puts each ``RequestOutput`` on its request's
``asyncio.Queue``. ``generate`` reads that queue; leaving the ``async for`` early (client
disconnect, cancellation) aborts the request in the core at once, which frees its KV blocks.

If the core dies, every in-flight ``generate`` raises ``EngineDeadError`` with the reason, new
calls raise it at once, and ``is_dead`` turns True.

``AsyncLLM`` implements ``EngineClient`` (``engine/protocol.py``), all a server may use.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pagedlm.core.config import ModelConfig, VllmConfig
from pagedlm.core.engine.arg_utils import EngineArgs
from pagedlm.core.engine.async_client import AsyncInprocClient, AsyncMPClient, EngineDeadError
from pagedlm.core.engine.dp_client import AsyncDPClient
from pagedlm.core.engine.llm_engine import fan_out, finish_reason_of, output_prompt_ids
from pagedlm.core.engine.output_processor import OutputProcessor
from pagedlm.core.engine.processor import Processor, PromptType
from pagedlm.core.engine.tokenizer import get_tokenizer
from pagedlm.core.logger import init_logger
from pagedlm.core.metrics import (
    EngineStatsSnapshot,
    IterationStats,
    LoggingStatLogger,
    RequestStatsTracker,
    StatLoggerBase,
)
from pagedlm.core.outputs import PoolingRequestOutput, RequestOutput
from pagedlm.core.pooling_params import PoolingParams, check_runner, pooling_request
from pagedlm.core.request import EngineCoreRequest
from pagedlm.core.sampling_params import SamplingParams

logger = init_logger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError"]

# Most engine steps turned into RequestOutputs at once when the front end lags behind the core.
_MAX_MERGED_BATCHES = 32

#: what ``pause_generation`` does with requests in flight (vLLM's ``PauseMode``)
PauseMode = Literal["abort", "wait", "keep"]


class AsyncLLM:
    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        multiprocess: bool = True,
        log_stats: bool = True,
        stat_loggers: Sequence[StatLoggerBase] = (),
        log_interval_s: float = 5.0,
    ) -> None:
        """Build the front end and start the engine core (blocks until the core is ready).

        ``multiprocess=False`` runs the core on a worker thread of this process instead of a
        spawned process (tests, debugging). ``log_stats`` adds a ``LoggingStatLogger`` that logs
        a throughput line every ``log_interval_s`` seconds while busy.
        """
        if not vllm_config.frozen:
            # Online serving: platform defaults favour latency (e.g. smaller prefill chunks).
            vllm_config.usage_context = "server"
        # NOTE: final before the engine core process starts; every process reads this same config.
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
        self.processor = Processor(vllm_config, self.tokenizer)
        self.output_processor = OutputProcessor(
            self.tokenizer, stream_interval=vllm_config.scheduler_config.stream_interval,
            pooler_normalize=mc.pooler_normalize)
        self.stat_loggers: list[StatLoggerBase] = list(stat_loggers)
        if log_stats:
            self.stat_loggers.append(LoggingStatLogger())
        self.log_interval_s = log_interval_s
        self.latest_stats: EngineStatsSnapshot | None = None
        self._tracker = RequestStatsTracker()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._handler: asyncio.Task[None] | None = None
        self._log_task: asyncio.Task[None] | None = None
        #: pause_generation: new requests wait for resume_generation (per event loop)
        self._paused = False
        self._core_paused = False
        self._resumed: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._drained: asyncio.Event | None = None
        from pagedlm.core.lora.frontend import LoRARegistry

        #: the adapters checked against the model (add_lora, lora_request=)
        self.lora_registry = LoRARegistry(vllm_config.lora_config)
        self.engine_core: AsyncInprocClient | AsyncMPClient | AsyncDPClient
        data_parallel = vllm_config.parallel_config.data_parallel_size > 1
        if multiprocess or data_parallel:
            # Data parallelism: one engine-core process per replica, requests balanced by load.
            self.engine_core = AsyncDPClient(vllm_config) if data_parallel else AsyncMPClient(vllm_config)
        else:
            self.engine_core = AsyncInprocClient(vllm_config)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(engine_args.create_vllm_config(), **kwargs)

    # -- properties --------------------------------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        return self.vllm_config.model_config

    @property
    def model_name(self) -> str:
        return self.vllm_config.model_config.name

    @property
    def max_model_len(self) -> int:
        return self.vllm_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    @property
    def mm_processor(self) -> Any | None:
        return self.processor.mm_processor

    @property
    def scheduling_policy(self) -> str:
        return self.vllm_config.scheduler_config.policy

    @property
    def num_gpu_blocks(self) -> int:
        """KV-cache blocks the engine core allocated (the smallest replica's with data parallelism)."""
        return self.engine_core.num_gpu_blocks

    @property
    def engine_pid(self) -> int:
        """Process id of the engine core (this process for the in-process client)."""
        return int(self.engine_core.pid)

    @property
    def is_dead(self) -> bool:
        return self.engine_core.is_dead

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.engine_core.dead_error if self.engine_core.is_dead else None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer

    async def check_health(self) -> None:
        dead = self.dead_error
        if dead is not None:
            raise dead

    # -- prompts -----------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, *, add_special_tokens: bool = True) -> list[int]:
        return self.processor.tokenize_prompt(prompt, add_special_tokens=add_special_tokens)[1]

    def validate_prompt(self, token_ids: list[int], params: SamplingParams, *, has_mm_data: bool = False) -> None:
        self.processor.validate(token_ids, params, has_mm_data=has_mm_data)

    def validate_prompt_embeds(self, embeds: Any, params: SamplingParams) -> Any:
        """The ``[T, hidden]`` tensor an ``{"prompt_embeds": embeds}`` prompt would queue (CPU, the
        model dtype); raises ``ValueError`` as :meth:`generate` would."""
        tensor = self.processor._prompt_embeds({"prompt_embeds": embeds}, params)
        self.processor.validate([0] * int(tensor.shape[0]), params)
        return tensor

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        add_special_tokens: bool = True,
        lora_request: Any = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield ``RequestOutput`` s of one request until it is finished.

        What each output holds follows ``sampling_params.output_kind`` (CUMULATIVE, DELTA or
        FINAL_ONLY). Raises ``ValueError`` for invalid input before anything is queued, and
        ``EngineDeadError`` if the engine core is or becomes unavailable. Closing the generator
        early aborts the request.
        """
        self._ensure_running()
        if request_id in self._queues:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        check_runner(self.vllm_config.model_config, "generate", "AsyncLLM.generate")
        if self.lora_registry.needs_check(lora_request):
            await self.add_lora(lora_request)
        core_request, text = self.processor.process(request_id, prompt, sampling_params,
                                                    add_special_tokens=add_special_tokens, lora_request=lora_request,
                                                    priority=priority)
        submitted = self._submit(core_request, text)
        try:
            async for out in submitted:
                yield out
        finally:
            # NOTE: closes it at once (aborting the request) when our consumer stops early
            await submitted.aclose()

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling model's output for one prompt (vLLM's ``AsyncLLM.encode``): one final
        ``PoolingRequestOutput``. Raises ``ValueError`` for invalid input before anything is queued."""
        self._ensure_running()
        if request_id in self._queues:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        core_request, text = pooling_request(self.processor, self.vllm_config.model_config, request_id, prompt,
                                             pooling_params, priority=priority)
        submitted = self._submit(core_request, text, pooling_params)
        try:
            async for out in submitted:
                yield out
        finally:
            await submitted.aclose()

    async def _submit(self, core_request: EngineCoreRequest, text: str | None,
                      pooling_params: PoolingParams | None = None) -> AsyncGenerator[Any, None]:
        """Queue a processed request and yield its outputs until it finishes (aborts it if the
        consumer stops early)."""
        request_id = core_request.request_id
        arrival = time.monotonic()
        sampling_params = core_request.sampling_params
        while self._paused:  # validated, and held back until resume_generation
            await self._resume_event().wait()
            self._ensure_running()
            if request_id in self._queues:
                raise ValueError(f"request_id={request_id!r} is already in the engine")
        children = fan_out(core_request)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(
            request_id, text, output_prompt_ids(core_request), core_request.sampling_params,
            [c.request_id for c in children], [c.sampling_params for c in children], pooling_params=pooling_params,
        )
        self._tracker.add(request_id, [c.request_id for c in children], len(core_request.prompt_token_ids),
                          arrival, n=sampling_params.n, max_tokens=core_request.sampling_params.max_tokens)
        finished = False
        try:
            for child in children:
                await self.engine_core.add_request_async(child)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort: the core is gone
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if self._drained is not None and not self._queues:
                self._drained.set()
            if not finished:
                # NOTE: synchronous on purpose. This runs when the consumer stops early: on
                # GeneratorExit or CancelledError, where awaiting again is not safe.
                self.abort(request_id)

    # -- LoRA adapters (vLLM's AsyncLLM methods) -----------------------------------------------
    async def add_lora(self, lora_request: Any) -> bool:
        """Check an adapter against the model (``ValueError`` for one it cannot run); False if it
        was checked already. NOTE: the workers read it when a request first needs it, so adding
        one never waits for (or interrupts) the steps running meanwhile."""
        if self.lora_registry.lora_config is not None and self.lora_registry.targets is None:
            tables = await self.engine_core.call_utility_async("lora_targets")
            if isinstance(self.engine_core, AsyncDPClient):
                tables = [t for replica in tables for t in replica]
            self.lora_registry.set_targets(tables)
        return self.lora_registry.check(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` in the front end: a request naming it is checked again."""
        return self.lora_registry.forget(lora_id)

    async def list_loras(self) -> set[int]:
        """Ids of the adapters checked and not removed."""
        return set(self.lora_registry.checked)

    def abort(self, request_id: str) -> None:
        """Stop a request now: the core frees its KV blocks in its next loop iteration."""
        self._queues.pop(request_id, None)
        child_ids = self.output_processor.abort_requests([request_id])
        if child_ids:
            stats = IterationStats()
            self._tracker.finish(request_id, "abort", time.monotonic(), stats)
            self._record(None, stats)
            self.engine_core.abort_requests_nowait(child_ids)

    # -- pausing (vLLM's pause_generation / resume_generation / is_paused) ----------------------
    async def pause_generation(self, *, mode: PauseMode = "abort", wait_for_inflight_requests: bool | None = None,
                               clear_cache: bool = True) -> None:
        """Stop generating, e.g. to update the weights. New ``generate`` calls wait (validated,
        nothing queued) until :meth:`resume_generation`. In-flight requests:

        - ``mode="abort"`` (default): they end now with ``finish_reason="abort"`` (their generators
          yield that final output);
        - ``"wait"``: this call returns once they have finished;
        - ``"keep"``: they stay in the engine, frozen, and go on after ``resume_generation``.

        ``clear_cache`` then resets the prefix cache (with ``"keep"`` only when no request holds
        blocks). ``wait_for_inflight_requests=True`` is vLLM's older spelling of ``mode="wait"``.
        """
        if wait_for_inflight_requests:
            warnings.warn("pause_generation(wait_for_inflight_requests=...) is deprecated; use mode='wait'",
                          DeprecationWarning, stacklevel=2)
            mode = "wait"
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode={mode!r} is invalid: must be 'abort', 'wait' or 'keep'")
        self._ensure_running()
        self._paused = True
        self._resume_event().clear()
        if mode == "abort":
            self._abort_in_flight()
        elif mode == "wait":
            self._drained = asyncio.Event()
            try:
                while self._queues:
                    await self._drained.wait()
                    self._drained.clear()
            finally:
                self._drained = None
        else:
            await self.engine_core.call_utility_async("pause_scheduler")
            self._core_paused = True
        if clear_cache:
            await self.engine_core.call_utility_async("reset_prefix_cache")

    async def resume_generation(self) -> None:
        """Generate again after :meth:`pause_generation`: waiting and kept requests go on."""
        if self._core_paused:
            await self.engine_core.call_utility_async("resume_scheduler")
            self._core_paused = False
        self._paused = False
        self._resume_event().set()

    async def is_paused(self) -> bool:
        return self._paused

    def _resume_event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._resumed is None or self._resumed[0] is not loop:
            self._resumed = (loop, asyncio.Event())
            if not self._paused:
                self._resumed[1].set()
        return self._resumed[1]

    def _abort_in_flight(self) -> None:
        """End every in-flight request with finish_reason "abort" (a final output each)."""
        request_ids = list(self._queues)
        outputs, child_ids = self.output_processor.finish_requests(request_ids, "abort")
        stats = IterationStats()
        now = time.monotonic()
        for out in outputs:
            self._tracker.finish(out.request_id, "abort", now, stats)
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        self._record(None, stats)
        self.engine_core.abort_requests_nowait(child_ids)

    # -- sleep mode (enable_sleep_mode) --------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Free the workers' device memory (``LLM.sleep``); requests that arrive meanwhile wait
        until :meth:`wake_up`."""
        await self.engine_core.call_utility_async("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine_core.call_utility_async("wake_up", tags)

    async def is_sleeping(self) -> bool:
        result = await self.engine_core.call_utility_async("is_sleeping")
        return any(result) if isinstance(self.engine_core, AsyncDPClient) else bool(result)

    # -- engine-core utilities ---------------------------------------------------------------
    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False while requests hold blocks."""
        return _all_true(await self.engine_core.call_utility_async("reset_prefix_cache"))

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start the workers' torch profilers (needs ``profiler_config``; see ``LLM.start_profile``)."""
        await self.engine_core.call_utility_async("profile", True, profile_prefix)

    async def stop_profile(self) -> None:
        await self.engine_core.call_utility_async("profile", False, None)

    async def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``LLM.collective_rpc`` on this engine's workers. With the engine core in its own process
        (the default) ``method`` is a ``Worker`` method name and the arguments and results travel
        as msgpack values; a function works with ``multiprocess=False``."""
        if not isinstance(method, str) and not isinstance(self.engine_core, AsyncInprocClient):
            raise ValueError("AsyncLLM.collective_rpc takes a Worker method name when the engine core runs in its "
                             "own process (functions need AsyncLLM(..., multiprocess=False))")
        results = await self.engine_core.call_utility_async("collective_rpc", method, timeout, list(args),
                                                            dict(kwargs or {}))
        if isinstance(self.engine_core, AsyncDPClient):
            return [r for replica in results for r in replica]
        return list(results)

    # -- output handling ---------------------------------------------------------------------
    def _ensure_running(self) -> None:
        dead = self.dead_error
        if dead is not None:
            raise dead
        loop = asyncio.get_running_loop()
        if self._handler is None or self._handler.done() or self._handler.get_loop() is not loop:
            self._handler = loop.create_task(self._output_handler(), name="pagedlm-output-handler")
        if self.stat_loggers and self.log_interval_s > 0 and (
            self._log_task is None or self._log_task.done() or self._log_task.get_loop() is not loop
        ):
            self._log_task = loop.create_task(self._log_loop(), name="pagedlm-stats-logger")

    async def _output_handler(self) -> None:
        try:
            while True:
                batch = await self.engine_core.get_output_async()
                batches = [batch]
                # If the core ran ahead (this loop was busy), take what has queued up in one go:
                # each request then gets one output for several steps, and the backlog shrinks.
                for _ in range(_MAX_MERGED_BATCHES - 1):
                    more = self.engine_core.get_output_nowait()
                    if more is None:
                        break
                    batches.append(more)
                    batch = more
                now = time.monotonic()
                stats = IterationStats()
                for b in batches:  # the metrics see each step, with the core's time of it
                    self._tracker.on_outputs(b.outputs, now, stats, b.timestamp)
                outputs = batches[0].outputs if len(batches) == 1 else [o for b in batches for o in b.outputs]
                request_outputs, to_abort = self.output_processor.process_outputs(outputs)
                if to_abort:
                    self._tracker.finish_children(to_abort, "stop", now, stats)
                for out in request_outputs:
                    if out.finished:
                        reason = finish_reason_of(out)
                        self._tracker.finish(out.request_id, reason, now, stats)
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                # Stop strings are matched here, in the front end: the core must stop those.
                self.engine_core.abort_requests_nowait(to_abort)
                if batch.stats is not None:
                    self.latest_stats = batch.stats
                self._record(batch.stats, stats)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:
            logger.exception("the output handler failed")
            self._fail_all(EngineDeadError(f"the engine front end failed: {type(e).__name__}: {e}"))

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        # Requests held by a pause find the engine dead when they wake.
        if self._resumed is not None and not self._resumed[0].is_closed():
            with contextlib.suppress(RuntimeError):
                self._resumed[0].call_soon_threadsafe(self._resumed[1].set)

    def _record(self, engine_stats: EngineStatsSnapshot | None, stats: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(engine_stats, stats)
            except Exception:
                logger.exception("stat logger %s failed", type(stat_logger).__name__)

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.log_interval_s)
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.log()
                except Exception:
                    logger.exception("stat logger %s failed", type(stat_logger).__name__)

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine core; pending ``generate`` calls fail with EngineDeadError."""
        for task in (self._handler, self._log_task):
            if task is not None and not task.done():
                with contextlib.suppress(RuntimeError):  # its loop may be closed already
                    task.cancel()
        self.engine_core.shutdown()
        self._fail_all(self.engine_core.dead_error or EngineDeadError("the engine was shut down"))


def _all_true(result: Any) -> bool:
    """A utility's bool result (one per replica with data parallelism)."""
    return all(result) if isinstance(result, list) else bool(result)


if TYPE_CHECKING:
    from pagedlm.core.engine.protocol import EngineClient

    # NOTE: mypy (nox -s typecheck) checks here that AsyncLLM implements the protocol.
    _ENGINE_CLIENT: type[EngineClient] = AsyncLLM
