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
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

from pagedlm.core.config import ModelConfig, VllmConfig
from pagedlm.core.engine.arg_utils import EngineArgs
from pagedlm.core.engine.async_client import AsyncInprocClient, AsyncMPClient, EngineDeadError
from pagedlm.core.engine.dp_client import AsyncDPClient
from pagedlm.core.engine.llm_engine import fan_out
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
from pagedlm.core.outputs import RequestOutput
from pagedlm.core.sampling_params import SamplingParams

logger = init_logger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError"]

# Most engine steps turned into RequestOutputs at once when the front end lags behind the core.
_MAX_MERGED_BATCHES = 32


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
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers: list[StatLoggerBase] = list(stat_loggers)
        if log_stats:
            self.stat_loggers.append(LoggingStatLogger())
        self.log_interval_s = log_interval_s
        self.latest_stats: EngineStatsSnapshot | None = None
        self._tracker = RequestStatsTracker()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._handler: asyncio.Task[None] | None = None
        self._log_task: asyncio.Task[None] | None = None
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

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        self.processor.validate(token_ids, params)

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        add_special_tokens: bool = True,
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
        arrival = time.monotonic()
        core_request, text = self.processor.process(request_id, prompt, sampling_params,
                                                    add_special_tokens=add_special_tokens)
        children = fan_out(core_request)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(
            request_id, text, core_request.prompt_token_ids, core_request.sampling_params,
            [c.request_id for c in children], [c.sampling_params for c in children],
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
            if not finished:
                # NOTE: synchronous on purpose. This runs when the consumer stops early: on
                # GeneratorExit or CancelledError, where awaiting again is not safe.
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request now: the core frees its KV blocks in its next loop iteration."""
        self._queues.pop(request_id, None)
        child_ids = self.output_processor.abort_requests([request_id])
        if child_ids:
            stats = IterationStats()
            self._tracker.finish(request_id, "abort", time.monotonic(), stats)
            self._record(None, stats)
            self.engine_core.abort_requests_nowait(child_ids)

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
                        reason = "error" if out.error else (out.outputs[0].finish_reason or "stop")
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


if TYPE_CHECKING:
    from pagedlm.core.engine.protocol import EngineClient

    # NOTE: mypy (nox -s typecheck) checks here that AsyncLLM implements the protocol.
    _ENGINE_CLIENT: type[EngineClient] = AsyncLLM
