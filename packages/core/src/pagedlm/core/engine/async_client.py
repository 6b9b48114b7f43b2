"""Asyncio clients of the engine core, as used by ``AsyncLLM``.

Both clients have the same surface:
  ``await add_request_async(request)``     queue a validated EngineCoreRequest
  ``abort_requests_nowait(request_ids)``   synchronous on purpose: callable from ``finally``
                                           blocks of cancelled tasks, where awaiting is unsafe
  ``await get_output_async()``             the next ``EngineCoreOutputs`` (waits while idle)
  ``get_output_nowait()``                  the next one if it has already arrived, else None
  ``await call_utility_async(method, *args)``  an ``EngineCore`` method run between steps
                                           (pause/resume, prefix-cache reset, profile, RPC)
  ``is_dead`` / ``dead_error``             whether the core is gone, and why
  ``shutdown()``

``AsyncInprocClient`` runs the core on one worker thread of this process (tests, notebooks).
``AsyncMPClient`` runs it in a spawned process over two ZMQ pipes (PUSH/PULL over ipc):
tokenization, detokenization and HTTP then overlap with model execution. Its sockets are plain
(blocking) ZMQ sockets: sends never block (unbounded queue), and a reader thread waits on the
output pipe and wakes whichever event loop is waiting, so the client is not tied to one loop
(tests run several ``asyncio.run`` in turn) and a dead core is noticed even while idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedlm.core.config import VllmConfig
from pagedlm.core.engine import serial
from pagedlm.core.engine.serial import EngineCoreOutputs, InputKind, OutputKind
from pagedlm.core.logger import init_logger
from pagedlm.core.metrics.stats import EngineStatsSnapshot
from pagedlm.core.request import EngineCoreRequest

logger = init_logger(__name__)

# How often a waiting front end checks that the core process is still alive.
_LIVENESS_POLL_MS = 250


class EngineDeadError(RuntimeError):
    """The engine core is gone (crashed, killed or shut down); no request can be served."""


class AsyncInprocClient:
    """The engine core on a single worker thread: calls are serialized in submission order."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        from pagedlm.core.engine.core import EngineCore

        self.engine_core = EngineCore(vllm_config)
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedlm-engine-core")
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: EngineDeadError | None = None
        self.pid = os.getpid()

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def _event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._wakeup is None or self._loop is not loop:
            self._wakeup, self._loop = asyncio.Event(), loop
        return self._wakeup

    def _check(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._check()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.engine_core.add_request, request)
        self._event().set()

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead_error is not None:
            return
        self._executor.submit(self.engine_core.abort_requests, list(request_ids))
        if self._wakeup is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wakeup.set)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._check()
        loop = asyncio.get_running_loop()
        event = self._event()
        event.clear()
        has_work = await loop.run_in_executor(self._executor, self.engine_core.has_work)
        if not has_work:
            await event.wait()
            # Woken by an add or an abort: report the state (an abort may have emptied the engine).
            return await loop.run_in_executor(self._executor, self._snapshot_only)
        try:
            return await loop.run_in_executor(self._executor, self._step)
        except Exception as e:
            self.dead_error = EngineDeadError(f"engine core step failed: {type(e).__name__}: {e}")
            raise self.dead_error from e

    def get_output_nowait(self) -> EngineCoreOutputs | None:
        return None  # steps run on demand here: nothing is ever queued

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._check()
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._executor, lambda: getattr(self.engine_core, method)(*args))
        self._event().set()  # e.g. a resume: the output loop has work again
        return result

    def _snapshot_only(self) -> EngineCoreOutputs:
        return EngineCoreOutputs([], EngineStatsSnapshot.from_engine_core(self.engine_core))

    def _step(self) -> EngineCoreOutputs:
        outputs = self.engine_core.step()
        return EngineCoreOutputs(outputs, EngineStatsSnapshot.from_engine_core(self.engine_core))

    def shutdown(self) -> None:
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        self._executor.shutdown(wait=True)
        self.engine_core.shutdown()


class AsyncMPClient:
    """The engine core in a spawned process, driven over ZMQ (see ``core_proc`` for the loop)."""

    def __init__(self, vllm_config: VllmConfig, *, startup_timeout_s: float = 900.0) -> None:
        import zmq

        from pagedlm.core.engine.core_proc import run_engine_core

        self._zmq = zmq
        self.dead_error: EngineDeadError | None = None
        self._closed = False
        # ipc endpoints in a private (0700) directory: other users of the host cannot connect.
        self._tmpdir = tempfile.mkdtemp(prefix="pagedlm-engine-")
        input_addr = f"ipc://{self._tmpdir}/input"
        output_addr = f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.Context()
        # Sends are always non-blocking (HWM 0 = unbounded queue while the peer is connected),
        # so the input socket can stay synchronous and be used from finally blocks.
        self.input_socket = self._ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(input_addr)
        self.output_socket = self._ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(output_addr)
        # Frames from the reader thread; None means "check liveness" (the thread saw a dead core).
        self._frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        #: UTILITY calls waiting for their answer: call id -> (its loop, its future)
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()

        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=run_engine_core, args=(vllm_config, input_addr, output_addr),
                               name="pagedlm-engine-core", daemon=True)
        try:
            self.proc.start()
            ready = self._handshake(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.pid: int = self.proc.pid  # type: ignore[assignment]
        self.num_gpu_blocks = int(ready["num_gpu_blocks"])
        logger.info("engine core process %d is ready (%d KV-cache blocks)", self.pid, self.num_gpu_blocks)

    # -- startup ---------------------------------------------------------------------------------
    def _handshake(self, timeout_s: float) -> dict[str, Any]:
        zmq = self._zmq
        deadline = time.monotonic() + timeout_s
        # HELLO blocks until the core's input pipe connects; retry in short slices so that a core
        # that dies while importing is noticed.
        self.input_socket.setsockopt(zmq.SNDTIMEO, _LIVENESS_POLL_MS)
        while True:
            try:
                self.input_socket.send(serial.encode(InputKind.HELLO))
                break
            except zmq.Again:
                self._check_startup(deadline)
        self.input_socket.setsockopt(zmq.SNDTIMEO, -1)
        while True:
            if self.output_socket.poll(_LIVENESS_POLL_MS):
                kind, payload = serial.decode(self.output_socket.recv())
                if kind == OutputKind.READY:
                    return dict(payload)
                if kind == OutputKind.FAILED:
                    # Startup errors are usually configuration errors: re-raise as ValueError so
                    # the CLI prints them like any other bad option.
                    raise ValueError(str(payload))
                continue
            self._check_startup(deadline)

    def _check_startup(self, deadline: float) -> None:
        if not self.proc.is_alive():
            raise RuntimeError(
                f"the engine core process exited during startup (exit code {self.proc.exitcode}); "
                "see its log above"
            )
        if time.monotonic() > deadline:
            raise TimeoutError("the engine core process did not become ready in time")

    # -- liveness --------------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        if self.dead_error is None and not self.proc.is_alive():
            self._mark_dead(f"the engine core process {self.pid} died unexpectedly "
                            f"(exit code {self.proc.exitcode})")
        return self.dead_error is not None

    def _mark_dead(self, message: str) -> EngineDeadError:
        if self.dead_error is None:
            self.dead_error = EngineDeadError(message)
            if not self._closed:
                logger.error("%s", message)
        return self.dead_error

    def _check(self) -> None:
        if self.is_dead:
            assert self.dead_error is not None
            raise self.dead_error

    # -- requests --------------------------------------------------------------------------------
    def _send(self, frame: bytes) -> None:
        zmq = self._zmq
        try:
            self.input_socket.send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:
            # No connected peer: the core is gone (its pipe closes when the process exits).
            self._check()
            raise self._mark_dead("the engine core stopped accepting requests") from None

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._check()
        self._send(serial.encode_add(request))

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead_error is not None or self._closed:
            return
        with contextlib.suppress(EngineDeadError):
            self._send(serial.encode(InputKind.ABORT, list(request_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        event = self._attach(asyncio.get_running_loop())
        while True:
            try:
                frame = self._frames.get_nowait()
            except queue.Empty:
                self._check()
                event.clear()
                if self._frames.empty():  # re-checked after clear(): a wake-up is never lost
                    # NOTE: not asyncio.wait_for: before Python 3.12 it returns normally when the
                    # event is set in the same turn as a cancel, and this loop would then never
                    # end (asyncio.run waits forever for it). A timer that sets the event gives the
                    # same liveness tick and leaves cancellation to event.wait().
                    tick = asyncio.get_running_loop().call_later(_LIVENESS_POLL_MS / 1000, event.set)
                    try:
                        await event.wait()
                    finally:
                        tick.cancel()
                continue
            batch = self._decode(frame)
            if batch is not None:
                return batch

    def get_output_nowait(self) -> EngineCoreOutputs | None:
        """The next batch if one has already arrived, else None (never waits)."""
        while True:
            try:
                frame = self._frames.get_nowait()
            except queue.Empty:
                return None
            batch = self._decode(frame)
            if batch is not None:
                return batch

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.method(*args)`` in the core process between steps (arguments and
        result are msgpack values); its exception is raised here as RuntimeError."""
        loop = asyncio.get_running_loop()
        self._attach(loop)  # the reader thread routes the answer
        future: asyncio.Future = loop.create_future()
        call_id = next(self._call_ids)
        with self._calls_lock:
            self._calls[call_id] = (loop, future)
        try:
            self._check()
            self._send(serial.encode(InputKind.UTILITY, [call_id, method, list(args)]))
            while True:
                done, _ = await asyncio.wait([future], timeout=_LIVENESS_POLL_MS / 1000)
                if done:
                    return future.result()
                self._check()
        finally:
            with self._calls_lock:
                self._calls.pop(call_id, None)

    def _answer(self, payload: list[Any]) -> None:
        """Reader thread: hand a UTILITY answer to the call waiting for it."""
        call_id, ok, value = payload
        with self._calls_lock:
            entry = self._calls.get(call_id)
        if entry is None:
            return  # the caller gave up (cancelled)
        loop, future = entry

        def settle() -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(str(value)))

        with contextlib.suppress(RuntimeError):  # the loop closed in between
            loop.call_soon_threadsafe(settle)

    def _decode(self, frame: bytes | None) -> EngineCoreOutputs | None:
        if frame is None:
            return None  # the reader saw the core die; the next _check() raises
        kind, payload = serial.decode(frame)
        if kind == OutputKind.OUTPUTS:
            return serial.outputs_from_wire(payload)
        if kind == OutputKind.FAILED:
            raise self._mark_dead(str(payload))
        return None

    def _attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """Bind the wake-up event to the running loop and start the reader thread once."""
        if self._wakeup is None or self._loop is not loop:
            self._loop, self._wakeup = loop, asyncio.Event()
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_outputs, name="pagedlm-engine-output", daemon=True)
            self._reader.start()
        return self._wakeup

    def _read_outputs(self) -> None:
        """Reader thread: the only user of the output socket after start-up."""
        zmq = self._zmq
        while not self._closed:
            try:
                if not self.output_socket.poll(_LIVENESS_POLL_MS):
                    if not self.proc.is_alive():
                        self._frames.put(None)
                        self._notify()
                        return
                    continue
                frame = self.output_socket.recv()
                if serial.peek_kind(frame) == OutputKind.UTILITY:
                    self._answer(serial.decode(frame)[1])
                    continue
                self._frames.put(frame)
            except zmq.ZMQError:
                return  # the context is being destroyed
            self._notify()

    def _notify(self) -> None:
        loop, event = self._loop, self._wakeup
        if loop is not None and event is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(event.set)

    # -- shutdown --------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait for it, and kill it if it does not go; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        proc = getattr(self, "proc", None)
        if proc is not None and proc.pid is not None:
            if proc.is_alive():
                with contextlib.suppress(self._zmq.ZMQError):
                    self.input_socket.send(serial.encode(InputKind.SHUTDOWN), flags=self._zmq.NOBLOCK)
                proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("engine core process %d did not stop in %.0fs; terminating it", proc.pid, timeout_s)
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        if self._reader is not None:
            self._reader.join(2 * _LIVENESS_POLL_MS / 1000)
        # destroy() closes every socket of the context and never waits on unsent messages.
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)
