"""Data parallelism: ``data_parallel_size`` engine-core replicas behind one client.

Each replica is a full engine core (scheduler, KV cache, executor with its own TP x PP workers) in
its own process, so replicas step concurrently; replica ``d`` uses devices
``[d * tp * pp, (d + 1) * tp * pp)``. The client sends each new request to the replica with the
fewest unfinished requests (ties: the lowest index) and merges their outputs.

Protocol (pickled over one duplex pipe per replica):
  client -> replica: ``("add", EngineCoreRequest)``, ``("abort", [ids])``, ``("shutdown", None)``,
                     ``("call", (EngineCore method, args))`` (collective_rpc, profile)
  replica -> client: ``("ready", num_gpu_blocks)``, ``("out", [EngineCoreOutput])``, ``("error", text)``,
                     ``("result", value)`` / ``("call_error", text)`` answering a call

A replica that dies or raises fails the client with an error naming it; shutdown, garbage
collection and interpreter exit stop every replica (which stops its workers).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import threading
import time
import weakref
from typing import Any

from pagedlm.core.config import VllmConfig
from pagedlm.core.distributed.utils import describe_exit, format_exception, mp_context
from pagedlm.core.engine.core_client import EngineCoreClient
from pagedlm.core.logger import init_logger
from pagedlm.core.request import EngineCoreRequest
from pagedlm.core.sched import EngineCoreOutput

logger = init_logger(__name__)


def _run_replica(vllm_config: VllmConfig, conn: Any) -> None:
    """Process entry point of replica ``vllm_config.parallel_config.data_parallel_rank``."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        # No orphans: leave as soon as the client's process is gone (our workers follow us).
        def watch() -> None:
            mp_connection.wait([parent.sentinel])
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    import torch

    pc = vllm_config.parallel_config
    from pagedlm.core.utils.cores import usable_cores

    torch.set_num_threads(max(1, usable_cores() // (pc.data_parallel_size * pc.world_size)))
    from pagedlm.core.engine.core import EngineCore

    try:
        core = EngineCore(vllm_config)
    except BaseException as e:  # noqa: BLE001 - reported to the client, which fails loudly
        conn.send(("error", format_exception(e)))
        return
    conn.send(("ready", core.num_gpu_blocks))
    try:
        while True:
            # Block only when idle; otherwise take whatever arrived and keep stepping.
            idle = not core.has_unfinished_requests() and not core.batch_queue
            while conn.poll(None if idle else 0):
                kind, payload = conn.recv()
                if kind == "add":
                    core.add_request(payload)
                elif kind == "abort":
                    core.abort_requests(payload)
                elif kind == "shutdown":
                    return
                elif kind == "call":
                    method, args = payload
                    try:
                        conn.send(("result", getattr(core, method)(*args)))
                    except Exception as e:  # noqa: BLE001 - the caller's failure, not the replica's
                        conn.send(("call_error", format_exception(e)))
                    continue
                idle = False
            outputs = core.step()
            if outputs:
                conn.send(("out", outputs))
    except BaseException as e:  # noqa: BLE001 - reported to the client, which fails loudly
        conn.send(("error", format_exception(e)))
    finally:
        core.shutdown()


class _Replicas:
    """Processes and pipes; shared with the finalizer (never the client itself)."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.stopped = False

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("shutdown", None))
                except OSError:
                    pass
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for sig in ("terminate", "kill"):
            alive = [p for p in self.procs if p.is_alive()]
            for p in alive:
                getattr(p, sig)()
            for p in alive:
                p.join(3.0)


class DPClient(EngineCoreClient):
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.size = vllm_config.parallel_config.data_parallel_size
        ctx = mp_context()
        replicas = self._replicas = _Replicas()
        for rank in range(self.size):
            config = vllm_config.for_data_parallel_rank(rank)
            parent_conn, child_conn = ctx.Pipe()
            # NOTE: not daemonic: a replica with TP/PP starts worker processes of its own.
            proc = ctx.Process(target=_run_replica, args=(config, child_conn), name=f"pagedlm-dp-replica{rank}")
            proc.start()
            child_conn.close()
            replicas.procs.append(proc)
            replicas.conns.append(parent_conn)
        self._finalizer = weakref.finalize(self, replicas.stop)
        # Before multiprocessing's exit hook, which would wait for the (non-daemonic) replicas.
        atexit.register(self._finalizer)
        #: request id -> replica index, for requests not finished yet
        self.owner: dict[str, int] = {}
        self.load = [0] * self.size
        self._failure: str | None = None
        #: outputs that arrived while a call waited for its answers
        self._early: list[list[EngineCoreOutput]] = []
        blocks: dict[int, int] = {}
        try:
            while len(blocks) < self.size:
                for rank, kind, payload in self._receive(block=True):
                    if kind == "ready":
                        blocks[rank] = payload
        except BaseException:
            self.shutdown()
            raise
        #: what the front end reports: the smallest replica's KV cache
        self.num_gpu_blocks = min(blocks.values())

    # -- plumbing ----------------------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
            logger.error("%s", message)
        self._replicas.stop()
        raise RuntimeError(self._failure)

    def _receive(self, *, block: bool) -> list[tuple[int, str, Any]]:
        """Messages available now (at least one when ``block``); raises for a failed replica."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        replicas = self._replicas
        sentinels = {p.sentinel: r for r, p in enumerate(replicas.procs)}
        conn_rank = {id(c): r for r, c in enumerate(replicas.conns)}
        while True:
            ready = mp_connection.wait([*replicas.conns, *sentinels], timeout=1.0 if block else 0)
            messages = []
            for obj in ready:
                rank = conn_rank.get(id(obj))
                if rank is None:
                    continue
                while obj.poll():
                    try:
                        kind, payload = obj.recv()
                    except (EOFError, OSError):
                        break
                    if kind == "error":
                        self._fail(f"data-parallel replica {rank} failed; the engine cannot continue:\n{payload}")
                    messages.append((rank, kind, payload))
            if messages:
                return messages
            for obj in ready:
                if obj in sentinels:
                    proc = replicas.procs[sentinels[obj]]
                    self._fail(f"data-parallel replica {sentinels[obj]} (pid {proc.pid}) died unexpectedly "
                               f"({describe_exit(proc.exitcode)}); the engine cannot continue")
            if not block:
                return []

    def _send(self, rank: int, message: tuple[str, Any]) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        try:
            self._replicas.conns[rank].send(message)
        except OSError:
            proc = self._replicas.procs[rank]
            self._fail(f"data-parallel replica {rank} (pid {proc.pid}) is gone ({describe_exit(proc.exitcode)})")

    # -- EngineCoreClient ------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        rank = _assign(self.owner, self.load, request.request_id)
        try:
            self._send(rank, ("add", request))
        except BaseException:
            _release(self.owner, self.load, [request.request_id])
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for rank, ids in _release(self.owner, self.load, request_ids).items():
            self._send(rank, ("abort", ids))

    def call(self, method: str, *args: Any) -> list[Any]:
        """``EngineCore.method(*args)`` on every replica; their results in replica order."""
        for rank in range(self.size):
            self._send(rank, ("call", (method, args)))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(results) + len(errors) < self.size:
            for rank, kind, payload in self._receive(block=True):
                if kind == "result":
                    results[rank] = payload
                elif kind == "call_error":
                    errors[rank] = payload
                elif kind == "out":
                    self._early.append(payload)
        if errors:
            rank = min(errors)
            summary = str(errors[rank]).strip().splitlines()[-1]
            raise RuntimeError(f"{method} failed on data-parallel replica(s) {sorted(errors)}: {summary}\n"
                               f"{errors[rank]}")
        return [results[r] for r in range(self.size)]

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        from pagedlm.core.executor.abstract import WorkerCall

        # NOTE: a WorkerCall carries a function as bytes (the pipe pickles it by reference otherwise).
        per_replica = self.call("collective_rpc", WorkerCall(method), timeout, tuple(args), kwargs)
        return [result for results in per_replica for result in results]

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        self.call("profile", is_start, profile_prefix)

    def get_output(self) -> list[EngineCoreOutput]:
        """Outputs of every replica that has some; waits for one if none has (and any is busy)."""
        if not self.owner:
            return []
        outputs: list[EngineCoreOutput] = []
        if self._early:
            batches, self._early = self._early, []
        else:
            batches = [payload for _, kind, payload in self._receive(block=True) if kind == "out"]
        for payload in batches:
            for out in payload:
                if out.request_id not in self.owner:
                    continue  # aborted meanwhile
                outputs.append(out)
                if out.finished:
                    self.load[self.owner.pop(out.request_id)] -= 1
        return outputs

    @property
    def engine_core(self) -> Any:
        raise RuntimeError("with data_parallel_size > 1 the engine cores run in their own processes")

    @property
    def replica_pids(self) -> list[int]:
        return [p.pid for p in self._replicas.procs]

    def shutdown(self) -> None:
        atexit.unregister(self._finalizer)
        self._finalizer()


class AsyncDPClient:
    """Data parallelism for ``AsyncLLM`` (the server): one ``AsyncMPClient`` engine-core process
    per replica, with the same surface as ``AsyncMPClient`` and the same load balancing as
    :class:`DPClient`.

    NOTE: ``EngineCoreOutputs.stats`` snapshots come from whichever replica answered; each
    describes that replica alone.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        from pagedlm.core.engine.async_client import AsyncMPClient

        self.size = vllm_config.parallel_config.data_parallel_size
        self.clients: list[Any] = []
        try:
            for rank in range(self.size):
                self.clients.append(AsyncMPClient(vllm_config.for_data_parallel_rank(rank)))
        except BaseException:
            self.shutdown()
            raise
        # The scheduler limit the front end reports is the smallest replica's.
        self.num_gpu_blocks = min(c.num_gpu_blocks for c in self.clients)
        self.pid: int = self.clients[0].pid
        self.owner: dict[str, int] = {}
        self.load = [0] * self.size
        self._tasks: dict[int, Any] = {}

    @property
    def is_dead(self) -> bool:
        return any(c.is_dead for c in self.clients)

    @property
    def dead_error(self) -> Any:
        return next((c.dead_error for c in self.clients if c.is_dead), None)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        rank = _assign(self.owner, self.load, request.request_id)
        try:
            await self.clients[rank].add_request_async(request)
        except BaseException:
            _release(self.owner, self.load, [request.request_id])
            raise

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        for rank, ids in _release(self.owner, self.load, request_ids).items():
            self.clients[rank].abort_requests_nowait(ids)

    async def get_output_async(self) -> Any:
        """The next batch of any replica (one waiting call per replica is kept running)."""
        import asyncio

        for rank, client in enumerate(self.clients):
            if rank not in self._tasks:
                self._tasks[rank] = asyncio.ensure_future(client.get_output_async())
        await asyncio.wait(self._tasks.values(), return_when=asyncio.FIRST_COMPLETED)
        rank = min(r for r, t in self._tasks.items() if t.done())
        return self._account(rank, self._tasks.pop(rank).result())  # re-raises EngineDeadError

    def get_output_nowait(self) -> Any:
        """A batch that has already arrived from any replica, else None (never waits)."""
        for rank in sorted(r for r, t in self._tasks.items() if t.done()):
            return self._account(rank, self._tasks.pop(rank).result())
        for rank, client in enumerate(self.clients):
            if rank in self._tasks:
                continue  # a waiting call owns this replica's next batch
            batch = client.get_output_nowait()
            if batch is not None:
                return self._account(rank, batch)
        return None

    async def call_utility_async(self, method: str, *args: Any) -> list[Any]:
        """``EngineCore.method(*args)`` on every replica; their results in replica order."""
        import asyncio

        return list(await asyncio.gather(*(c.call_utility_async(method, *args) for c in self.clients)))

    def _account(self, rank: int, batch: Any) -> Any:
        for out in batch.outputs:
            if out.finished and self.owner.get(out.request_id) == rank:
                del self.owner[out.request_id]
                self.load[rank] -= 1
        return batch

    def shutdown(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        for client in self.clients:
            client.shutdown()


def _assign(owner: dict[str, int], load: list[int], request_id: str) -> int:
    """Route a new request to the least-loaded replica (lowest rank on ties); returns the rank."""
    rank = min(range(len(load)), key=lambda r: (load[r], r))
    owner[request_id] = rank
    load[rank] += 1
    return rank


def _release(owner: dict[str, int], load: list[int], request_ids: list[str]) -> dict[int, list[str]]:
    """Forget requests (unknown ids are ignored); returns rank -> the ids that replica held."""
    by_rank: dict[int, list[str]] = {}
    for req_id in request_ids:
        rank = owner.pop(req_id, None)
        if rank is not None:
            load[rank] -= 1
            by_rank.setdefault(rank, []).append(req_id)
    return by_rank
