"""The engine core in its own process: a loop of step() fed and drained over ZMQ.

Started by ``AsyncMPClient`` with multiprocessing's *spawn* method (forking a process that has
imported torch, or initialised a device, is unsafe). The loop:

  * while requests are in flight: take every pending input without blocking, run one step, send
    its outputs (and a stats snapshot) — model execution never waits for the front end;
  * when idle: block on the input socket (with a timeout, to notice a dead parent) — an idle
    server uses no CPU.

Failure policy: an exception in a step is fatal. The process sends FAILED with the error text
and exits 1; the front end fails every in-flight request with that message. If the parent dies,
the process exits on its own within a second or two.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import time
import traceback
from typing import Any

import msgspec

from pagedlm.core.config import VllmConfig
from pagedlm.core.engine import serial
from pagedlm.core.engine.serial import EngineCoreOutputs, InputKind, OutputKind
from pagedlm.core.logger import init_logger
from pagedlm.core.metrics.stats import EngineStatsSnapshot
from pagedlm.core.sched import EngineCoreOutput

logger = init_logger(__name__)

# How long an idle core blocks on its input before checking that its parent is still alive.
_IDLE_POLL_MS = 1000
# While busy, how often (seconds) to check the parent (is_alive() is a cheap waitpid).
_BUSY_PARENT_CHECK_S = 2.0
# The EngineCore methods a UTILITY call may run (their arguments and results are msgpack values).
_UTILITY_METHODS = frozenset({"pause_scheduler", "resume_scheduler", "is_paused", "reset_prefix_cache", "profile",
                              "collective_rpc", "lora_targets", "sleep", "wake_up", "is_sleeping"})


def run_engine_core(vllm_config: VllmConfig, input_addr: str, output_addr: str) -> None:
    """Process entry point (must be importable by name for spawn)."""
    # Ctrl-C in a terminal signals the whole process group; the parent decides when we stop
    # (it sends SHUTDOWN), so the core must not die half-way through a step on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import zmq

    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)
    input_socket.connect(input_addr)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.setsockopt(zmq.LINGER, 5000)
    output_socket.connect(output_addr)
    exit_code = 0
    try:
        try:
            from pagedlm.core.engine.core import EngineCore

            engine_core = EngineCore(vllm_config)
        except BaseException as e:  # noqa: BLE001 - any startup error must reach the parent as text
            # Start-up errors go to the operator's terminal: the traceback helps there.
            output_socket.send(serial.encode(OutputKind.FAILED, _describe(e, "engine core failed to start",
                                                                           with_traceback=True)))
            exit_code = 1
            return
        # NOTE: the start-up heap (torch, transformers, the model) lives as long as this process:
        # frozen out of the garbage collector's sight, a collection then scans what the steps
        # allocated, not every object of the process (host_overhead.py, frozen the same way after
        # LLM(...): collections charged to a step fell from about 0.15 to 0.05 ms).
        gc.collect()
        gc.freeze()
        proc = EngineCoreProc(engine_core, input_socket, output_socket)
        if not proc.handshake():  # the parent went away before we were ready
            engine_core.shutdown()
            exit_code = 1
            return
        exit_code = proc.run()
    finally:
        input_socket.close(linger=0)
        output_socket.close()
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
        # NOTE: os._exit, so that the parent sees exactly this status; the engine and the
        # sockets are already released, interpreter teardown has nothing left to do.
        os._exit(exit_code)


def _describe(e: BaseException, what: str, *, with_traceback: bool) -> str:
    # A ValueError is a configuration error whose message already says what to do.
    reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    text = f"{what}: {reason}"
    if with_traceback and not isinstance(e, ValueError):
        text += "\n" + "".join(traceback.format_exception(e))
    return text


class EngineCoreProc:
    def __init__(self, engine_core: Any, input_socket: Any, output_socket: Any) -> None:
        import zmq

        self._zmq = zmq
        self.engine_core = engine_core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent = multiprocessing.parent_process()
        self._shutdown = False
        # Requests refused by add_request, reported with the next batch of outputs.
        self._rejected: list[EngineCoreOutput] = []
        self._last_parent_check = time.monotonic()

    def _parent_alive(self) -> bool:
        return self.parent is None or self.parent.is_alive()

    def handshake(self) -> bool:
        """Wait for the parent's HELLO (proving our input pipe is connected), then say READY."""
        while not self.input_socket.poll(_IDLE_POLL_MS):
            if not self._parent_alive():
                return False
        kind, _ = serial.decode(self.input_socket.recv())
        if kind != InputKind.HELLO:
            logger.error("engine core: expected HELLO first, got message kind %s", kind)
            return False
        vc = self.engine_core.vllm_config
        info = {"num_gpu_blocks": self.engine_core.num_gpu_blocks, "max_model_len": vc.max_model_len,
                "pid": os.getpid()}
        self.output_socket.send(serial.encode(OutputKind.READY, info))
        return True

    def run(self) -> int:
        core = self.engine_core
        try:
            while not self._shutdown:
                if not core.has_work():
                    # Idle (or paused): block until the front end sends something.
                    if not self.input_socket.poll(_IDLE_POLL_MS):
                        if not self._parent_alive():
                            logger.warning("engine core: parent process is gone; exiting")
                            return 0
                        continue
                    self._drain_inputs()
                    if not core.has_work() or self._rejected:
                        # e.g. an abort of a waiting request: publish the new (empty) state.
                        self._send(EngineCoreOutputs([], EngineStatsSnapshot.from_engine_core(core)))
                    continue
                self._drain_inputs()
                if self._shutdown:
                    break
                outputs = core.step()
                self._send(EngineCoreOutputs(outputs, EngineStatsSnapshot.from_engine_core(core)))
                now = time.monotonic()
                if now - self._last_parent_check > _BUSY_PARENT_CHECK_S:
                    self._last_parent_check = now
                    if not self._parent_alive():
                        logger.warning("engine core: parent process is gone; exiting")
                        return 0
        except BaseException as e:  # noqa: BLE001 - a failed step is fatal; the front end is told why
            # The traceback stays in this process's log; the one-line reason reaches the front
            # end, and from there the HTTP clients whose requests fail.
            logger.error("%s", _describe(e, "engine core step failed", with_traceback=True))
            message = _describe(e, "engine core step failed", with_traceback=False)
            try:
                self.output_socket.send(serial.encode(OutputKind.FAILED, message), flags=self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                pass
            return 1
        finally:
            core.shutdown()
        return 0

    def _drain_inputs(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frame = self.input_socket.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, payload = serial.decode(frame)
            if kind == InputKind.ADD:
                request = serial.request_from_wire(payload)
                try:
                    self.engine_core.add_request(request)
                except ValueError as e:
                    # e.g. a duplicate request id: that request fails, the engine goes on.
                    self._rejected.append(EngineCoreOutput(request.request_id, [], finish_reason="error",
                                                           error=str(e)))
            elif kind == InputKind.ABORT:
                self.engine_core.abort_requests(list(payload))
            elif kind == InputKind.SHUTDOWN:
                self._shutdown = True
                return
            elif kind == InputKind.UTILITY:
                self._utility(*payload)
            # HELLO again (a reconnecting client) needs no action.

    def _utility(self, call_id: int, method: str, args: list[Any]) -> None:
        """Run one EngineCore method between steps and answer it; its failure is the caller's."""
        if method not in _UTILITY_METHODS:
            ok, value = False, f"engine core: unknown utility method {method!r}"
        else:
            try:
                ok, value = True, getattr(self.engine_core, method)(*args)
            except Exception as e:  # noqa: BLE001 - reported to the caller; the engine goes on
                ok, value = False, _describe(e, f"{method} failed", with_traceback=False)
        try:
            frame = serial.encode(OutputKind.UTILITY, [call_id, ok, value])
        except (TypeError, ValueError, msgspec.EncodeError) as e:
            frame = serial.encode(OutputKind.UTILITY, [call_id, False, f"the result of {method} cannot be sent to the "
                                                                      f"front end (not a msgpack value): {e}"])
        self.output_socket.send(frame)

    def _send(self, batch: EngineCoreOutputs) -> None:
        if self._rejected:
            batch.outputs = self._rejected + batch.outputs
            self._rejected = []
        self.output_socket.send(serial.encode_outputs(batch))
