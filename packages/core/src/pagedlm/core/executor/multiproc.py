"""``MultiprocExecutor``: one worker process per rank on this host.

- Workers come from a fork server (see ``mp_context``: never a plain fork of the engine, whose
  CUDA context or OpenMP pool would be unusable in the child) and join one
  torch.distributed group (gloo on the CPU, NCCL on GPUs) over a TCP rendezvous on 127.0.0.1.
- Every call reaches every worker through one :class:`ShmBroadcast` (pickled once, copied once);
  each worker answers on its own pipe, and for ``execute_model`` only the output rank (TP rank 0
  of the last stage) answers, unless a rank fails.
- Supervision: every wait also watches the worker processes' sentinels, and a monitor thread
  does the same while the engine is idle. The first rank that dies or raises fails the engine
  with a ``RuntimeError`` naming it, and the other workers are stopped at once (they would
  otherwise hang in a collective waiting for the dead peer).
- Clean-up: :meth:`shutdown`, garbage collection of the executor, and interpreter exit all stop
  the workers (ask, then SIGTERM, then SIGKILL). Workers also exit on their own when this process
  dies (they watch its sentinel), so no orphan outlives the engine.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedlm.core.config import VllmConfig
from pagedlm.core.distributed import output_rank
from pagedlm.core.distributed.shm_broadcast import ShmBroadcast, ShmReader
from pagedlm.core.distributed.utils import describe_exit, format_exception, get_open_port, mp_context
from pagedlm.core.executor.abstract import Executor, WorkerCall, merge_kv_cache_specs
from pagedlm.core.kv_cache.spec import AttentionSpec, KVCacheGroupSpec
from pagedlm.core.logger import init_logger
from pagedlm.core.sched.output import ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)

_SHUTDOWN = "__shutdown__"


# -- the worker process --------------------------------------------------------------------------


def _exit_with_parent() -> None:
    """Exit this worker as soon as the process that spawned it is gone (no orphans, even when
    the engine is SIGKILLed)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        mp_connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="pagedlm-parent-watch", daemon=True).start()


def _worker_main(vllm_config: VllmConfig, rank: int, local_rank: int, init_method: str,
                 reader: ShmReader, conn: Any) -> None:
    _exit_with_parent()
    from pagedlm.core.worker.worker import Worker

    worker = None
    try:
        worker = Worker(vllm_config, local_rank=local_rank, rank=rank, distributed_init_method=init_method)
        worker.init_device()
        worker.load_model()
        conn.send(("ok", os.getpid()))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the executor
        # Report and keep waiting: the executor reads the error first and then stops us, so the
        # error, not a bare exit code, is what the user sees.
        conn.send(("error", format_exception(e)))
        worker = None
    while True:
        _, message = reader.dequeue(timeout=None)
        method, args, kwargs, reply_ranks = message
        if method == _SHUTDOWN:
            break
        if worker is None:
            continue
        if isinstance(method, WorkerCall):  # a user's collective_rpc: its failure is not the engine's
            try:
                result = method(worker, args, kwargs)
                conn.send(("ok", result))
            except BaseException as e:  # noqa: BLE001 - reported to the caller, the worker goes on
                conn.send(("rpc_error", format_exception(e)))
            continue
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the executor
            conn.send(("error", format_exception(e)))
            continue
        if reply_ranks is None or rank in reply_ranks:
            conn.send(("ok", result))
    if worker is not None:
        worker.shutdown()


# -- supervision state, shared with the monitor thread and the finalizer (never the executor) -----


class _Workers:
    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.broadcast: ShmBroadcast | None = None
        self.failure: str | None = None
        self.stopping = False
        self.lock = threading.Lock()
        # NOTE: a forkserver child's exit status is read from the server once, by whichever
        # poll (is_alive, join) comes first after it dies; a second thread polling at the same
        # moment reads EOF and records exit code 255. So every poll holds this lock.
        self.poll_lock = threading.Lock()
        self.wake_r, self.wake_w = multiprocessing.Pipe(duplex=False)

    def record_failure(self, message: str) -> str:
        with self.lock:
            if self.failure is None:
                self.failure = message
                logger.error("%s", message)
            return self.failure

    def alive(self, proc: Any) -> bool:
        with self.poll_lock:
            return proc.is_alive()

    def join_all(self, procs: list[Any], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in procs:
            with self.poll_lock:
                p.join(max(0.0, deadline - time.monotonic()))

    def death_message(self, rank: int) -> str:
        proc = self.procs[rank]
        with self.poll_lock:
            proc.join(1.0)  # its sentinel fires before it is reaped; the exit status names the cause
            code = proc.exitcode
        return (f"pagedlm worker rank {rank} (pid {proc.pid}) died unexpectedly "
                f"({describe_exit(code)}); the engine cannot continue")

    def stop(self, graceful: bool = True) -> None:
        """Stop every worker; idempotent, safe from any thread, at GC and at exit."""
        with self.lock:
            if self.stopping and not any(self.alive(p) for p in self.procs):
                return
            self.stopping = True
        with contextlib.suppress(OSError):
            self.wake_w.send(None)
        alive = [p for p in self.procs if self.alive(p)]
        if graceful and alive and self.broadcast is not None and len(alive) == len(self.procs):
            # A worker that died meanwhile makes enqueue raise: then the signals below do it.
            with contextlib.suppress(RuntimeError):
                self.broadcast.enqueue((_SHUTDOWN, (), {}, ()), check=self._raise_if_dead)
                self.join_all(alive, 5.0)
        for sig in ("terminate", "kill"):
            alive = [p for p in self.procs if self.alive(p)]
            if not alive:
                break
            for p in alive:
                getattr(p, sig)()
            self.join_all(alive, 3.0)

    def _raise_if_dead(self) -> None:
        if any(not self.alive(p) for p in self.procs):
            raise RuntimeError("a worker is dead")


def _monitor(workers: _Workers) -> None:
    sentinels = {p.sentinel: rank for rank, p in enumerate(workers.procs)}
    ready = mp_connection.wait([*sentinels, workers.wake_r])
    if workers.stopping:
        return
    for obj in ready:
        if obj in sentinels:
            workers.record_failure(workers.death_message(sentinels[obj]))
            workers.stop(graceful=False)
            return


def _start_even_if_daemonic(proc: Any) -> None:
    """Start ``proc`` also from a daemonic process (e.g. an engine-core process of the server).

    multiprocessing refuses children of daemonic processes because they would be orphaned when
    their parent is terminated; our workers exit on their own when their parent goes (see
    :func:`_exit_with_parent`), so the rule's reason does not apply to them.
    """
    me = multiprocessing.current_process()
    daemonic = me.daemon
    if daemonic:
        me.daemon = False
    try:
        proc.start()
    finally:
        if daemonic:
            me.daemon = True


# -- the executor ---------------------------------------------------------------------------------


class _PendingOutput(Future):
    """The output of a step submitted with ``non_block=True``; ``result()`` drives the pipe."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        while not self.done():
            self._executor._receive_next_output()
        return super().result(timeout)


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        pc = self.vllm_config.parallel_config
        self.world_size = pc.world_size
        self.tp_size = pc.tensor_parallel_size
        self.pp_size = pc.pipeline_parallel_size
        self.output_rank = output_rank(self.tp_size, self.pp_size)
        self._pending: deque[_PendingOutput] = deque()
        #: per rank, replies still to come for user calls that timed out (discarded on arrival)
        self._stale = [0] * self.world_size
        ctx = mp_context()
        workers = self._workers = _Workers()
        workers.broadcast = ShmBroadcast(ctx, self.world_size)
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        # NOTE: replica d of data parallelism uses devices [d * world, (d + 1) * world).
        first_device = pc.data_parallel_rank * self.world_size
        start = time.perf_counter()
        for rank in range(self.world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker_main, name=f"pagedlm-worker-rank{rank}", daemon=True,
                args=(self.vllm_config, rank, first_device + rank, init_method, workers.broadcast.reader(rank), send),
            )
            _start_even_if_daemonic(proc)
            send.close()
            workers.procs.append(proc)
            workers.conns.append(recv)
        # GC of the executor, or interpreter exit, stops the workers; atexit runs before
        # multiprocessing's own exit hook, which would otherwise wait for them forever.
        self._finalizer = weakref.finalize(self, workers.stop)
        atexit.register(self._finalizer)
        threading.Thread(target=_monitor, args=(workers,), name="pagedlm-worker-monitor", daemon=True).start()
        try:
            pids = self._wait_replies(set(range(self.world_size)))
        except BaseException:
            self.shutdown()
            raise
        self.worker_pids = [pids[r] for r in range(self.world_size)]
        logger.info("started %d worker processes (tp=%d, pp=%d) in %.1fs", self.world_size, self.tp_size,
                    self.pp_size, time.perf_counter() - start)

    @property
    def max_concurrent_batches(self) -> int:
        return self.pp_size

    # -- talking to the workers ------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        message = self._workers.record_failure(message)
        self._workers.stop(graceful=False)
        raise RuntimeError(message)

    def check_health(self) -> None:
        workers = self._workers
        if workers.failure is not None:
            raise RuntimeError(workers.failure)
        if workers.stopping:
            raise RuntimeError("the executor is shut down")
        for rank, proc in enumerate(workers.procs):
            if not workers.alive(proc):
                self._fail(workers.death_message(rank))

    def _send(self, method: str | WorkerCall, args: tuple = (), kwargs: dict | None = None,
              reply_ranks: tuple[int, ...] | None = None) -> None:
        self.check_health()
        assert self._workers.broadcast is not None
        self._workers.broadcast.enqueue((method, args, kwargs or {}, reply_ranks), check=self.check_health)

    def _wait_replies(self, ranks: set[int], *, deadline: float | None = None,
                      rpc_errors: dict[int, str] | None = None) -> dict[int, Any]:
        """One reply from each of ``ranks``; any error or death of any rank fails the engine.

        For a user's call (``rpc_errors`` given), a rank's exception is collected there instead,
        and past ``deadline`` (monotonic) the ranks that have not answered are returned without a
        result: their replies are discarded when they come."""
        workers = self._workers
        results: dict[int, Any] = {}
        answered: set[int] = set()
        conn_rank = {id(c): r for r, c in enumerate(workers.conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(workers.procs)}
        while len(answered) < len(ranks):
            if workers.failure is not None:
                raise RuntimeError(workers.failure)
            timeout = 1.0
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    for late in ranks - answered:
                        self._stale[late] += 1
                    return results
            waiting = [c for r, c in enumerate(workers.conns) if r not in answered]
            ready = mp_connection.wait([*waiting, *sentinel_rank], timeout=timeout)
            # Messages first: a rank that reported an error is named by its error, unless a
            # peer has died (its death is the cause: the survivors' collectives then fail).
            for obj in ready:
                rank = conn_rank.get(id(obj))
                if rank is None:
                    continue
                try:
                    status, value = obj.recv()
                except (EOFError, OSError):
                    self._fail(workers.death_message(rank))
                if status == "error":
                    dead = [r for r, p in enumerate(workers.procs) if r != rank and not workers.alive(p)]
                    if dead:  # a peer died first: this rank's error (a broken collective) follows from it
                        self._fail(workers.death_message(dead[0]))
                    summary = str(value).strip().splitlines()[-1]
                    self._fail(f"pagedlm worker rank {rank} raised an error; the engine cannot continue: "
                               f"{summary}\n{value}")
                if self._stale[rank]:  # the late reply of a user call that timed out
                    self._stale[rank] -= 1
                    continue
                if status == "rpc_error" and rpc_errors is not None:
                    rpc_errors[rank] = str(value)
                    answered.add(rank)
                elif rank in ranks:
                    results[rank] = value
                    answered.add(rank)
            for obj in ready:
                if obj in sentinel_rank:
                    self._fail(workers.death_message(sentinel_rank[obj]))
        return results

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.method(*args)`` on every rank (an engine call: any failure is fatal)."""
        assert not self._pending, "no RPC while steps are in flight"
        self._send(method, args)
        results = self._wait_replies(set(range(self.world_size)))
        return [results[r] for r in range(self.world_size)]

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        if self._pending:
            raise RuntimeError("collective_rpc while engine steps are in flight; call it between steps")
        call = WorkerCall(method)
        self._send(call, tuple(args), dict(kwargs or {}))
        errors: dict[int, str] = {}
        ranks = set(range(self.world_size))
        deadline = None if timeout is None else time.monotonic() + timeout
        results = self._wait_replies(ranks, deadline=deadline, rpc_errors=errors)
        if errors:
            rank = min(errors)
            summary = errors[rank].strip().splitlines()[-1]
            raise RuntimeError(f"collective_rpc({call.name!r}) failed on worker rank(s) {sorted(errors)}: "
                               f"{summary}\n{errors[rank]}")
        missing = sorted(ranks - set(results))
        if missing:
            raise TimeoutError(f"collective_rpc({call.name!r}): worker rank(s) {missing} did not answer within "
                               f"{timeout}s (the call goes on there; its result will be dropped)")
        return [results[r] for r in range(self.world_size)]

    # -- the Executor interface ------------------------------------------------------------------
    def get_kv_cache_specs(self) -> dict[str, AttentionSpec]:
        return merge_kv_cache_specs(self._call_all("get_kv_cache_specs"))

    def set_kv_cache_groups(self, groups: list[KVCacheGroupSpec]) -> None:
        self._call_all("set_kv_cache_groups", groups)

    def determine_num_available_blocks(self) -> int:
        return min(self._call_all("determine_num_available_blocks"))

    def kv_cache_bytes_per_block(self) -> int:
        return max(self._call_all("kv_cache_bytes_per_block"))

    def initialize_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        self._send("execute_model", (scheduler_output,), reply_ranks=(self.output_rank,))
        future = _PendingOutput(self)
        self._pending.append(future)
        return future if non_block else future.result()

    def _receive_next_output(self) -> None:
        output: ModelRunnerOutput = self._wait_replies({self.output_rank})[self.output_rank]
        self._pending.popleft().set_result(output)

    def shutdown(self) -> None:
        if hasattr(self, "_finalizer"):
            atexit.unregister(self._finalizer)
            self._finalizer()
