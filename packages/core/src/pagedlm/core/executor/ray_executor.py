"""``RayExecutor``: one Ray actor per rank, placed with a placement group, so one model can span
several hosts of a Ray cluster (``distributed_executor_backend="ray"``, extra ``pagedlm-core[ray]``).

- Connects to the Ray cluster the usual way (``ray.init()``: ``RAY_ADDRESS``, a cluster started
  with ``ray start`` on this host, or else a new local instance, which this executor then owns and
  stops at shutdown).
- One bundle per rank (``{"GPU": 1}`` on CUDA, ``{"CPU": 1}`` on the CPU) with strategy
  ``PACK``: ranks fill one host before the next, so a TP group (consecutive ranks) stays on one
  host whenever it fits and only pipeline stages cross hosts.
- Ray gives each GPU actor its own ``CUDA_VISIBLE_DEVICES``, so every worker uses its device 0.
- The rendezvous of torch.distributed is rank 0's node (127.0.0.1 when every rank is on the
  driver's node).
- Each step's scheduler output is put in the object store once and every actor reads it; only the
  output rank returns its result. A failed or dead actor fails the engine naming its rank.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedlm.core.distributed import output_rank
from pagedlm.core.distributed.utils import format_exception, get_open_port
from pagedlm.core.executor.abstract import Executor, WorkerCall, merge_kv_cache_specs
from pagedlm.core.kv_cache.spec import AttentionSpec, KVCacheGroupSpec
from pagedlm.core.logger import init_logger
from pagedlm.core.sched.output import ModelRunnerOutput, SchedulerOutput

logger = init_logger(__name__)

#: seconds to wait for the cluster to grant the placement group before giving up
PLACEMENT_TIMEOUT_S = 120.0


class RayWorkerWrapper:
    """The actor body: builds a :class:`Worker` and runs its methods on request."""

    def __init__(self, vllm_config: Any, rank: int) -> None:
        self.vllm_config = vllm_config
        self.rank = rank
        self.worker: Any = None

    def node_info(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def open_port(self) -> int:
        return get_open_port("0.0.0.0")

    def init_worker(self, init_method: str, single_host: bool) -> None:
        from pagedlm.core.worker.worker import Worker

        if single_host:
            # All ranks share this host: keep gloo's traffic on the loopback interface.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.worker = Worker(self.vllm_config, local_rank=0, rank=self.rank, distributed_init_method=init_method)
        self.worker.init_device()
        self.worker.load_model()

    def execute(self, method: str, args: tuple, reply: bool) -> Any:
        result = getattr(self.worker, method)(*args)
        return result if reply else None

    def call(self, call: WorkerCall, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A user's ``collective_rpc``."""
        return call(self.worker, args, kwargs)


def _stop(actors: list[Any], placement_group: Any, owns_ray: bool) -> None:
    try:
        import ray
    except ImportError:
        return
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - best effort: the actor may be gone already
            pass
    if placement_group is not None:
        try:
            ray.util.remove_placement_group(placement_group)
        except Exception:  # noqa: BLE001 - best effort, as above
            pass
    if owns_ray:
        ray.shutdown()


class _RayOutput(Future):
    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        super().__init__()
        self._executor = executor
        self._refs = refs

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            self.set_result(self._executor._gather(self._refs))
        return super().result(timeout)


class RayExecutor(Executor):
    def _init_executor(self) -> None:
        try:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ImportError(
                'distributed_executor_backend="ray" needs Ray: pip install "pagedlm-core[ray]"'
            ) from e
        from pagedlm.core.platforms import resolve_platform

        pc = self.vllm_config.parallel_config
        self.world_size = pc.world_size
        self.pp_size = pc.pipeline_parallel_size
        self.output_rank = output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self._failure: str | None = None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(include_dashboard=False, log_to_driver=True)
        resource = resolve_platform(self.vllm_config.device_config.device).ray_device_key
        self._pg = ray.util.placement_group([{resource: 1}] * self.world_size, strategy="PACK")
        self.actors: list[Any] = []
        self._finalizer = weakref.finalize(self, _stop, self.actors, self._pg, self._owns_ray)
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RuntimeError(
                    f"the Ray cluster could not place {self.world_size} bundles of {{{resource!r}: 1}} within "
                    f"{PLACEMENT_TIMEOUT_S:.0f}s (cluster resources: {ray.cluster_resources()})"
                )
            actor_cls = ray.remote(RayWorkerWrapper)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                            placement_group_bundle_index=rank)
                options: dict[str, Any] = {"scheduling_strategy": strategy, "num_cpus": 0 if resource == "GPU" else 1,
                                           "name": None}
                if resource == "GPU":
                    options["num_gpus"] = 1
                self.actors.append(actor_cls.options(**options).remote(self.vllm_config, rank))
            nodes = self._gather([a.node_info.remote() for a in self.actors], all_results=True)
            driver_node = ray.get_runtime_context().get_node_id()
            single_host = all(node_id == driver_node for node_id, _ in nodes)
            host = "127.0.0.1" if single_host else nodes[0][1]
            port = self._gather([self.actors[0].open_port.remote()], all_results=True)[0]
            init_method = f"tcp://{host}:{port}"
            self._gather([a.init_worker.remote(init_method, single_host) for a in self.actors], all_results=True)
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %d Ray workers (%s rendezvous %s)", self.world_size,
                    "one host," if single_host else f"{len({n for n, _ in nodes})} hosts,", init_method)

    @property
    def max_concurrent_batches(self) -> int:
        return self.pp_size

    def _gather(self, refs: list[Any], all_results: bool = False) -> Any:
        """Wait for one call per rank (``refs[rank]``); the first failure fails the engine."""
        import ray

        if self._failure is not None:
            raise RuntimeError(self._failure)
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"pagedlm Ray worker rank {rank} died unexpectedly; the engine cannot continue: {e}")
                except Exception as e:  # noqa: BLE001 - any worker error is fatal and reported
                    self._fail(f"pagedlm Ray worker rank {rank} raised an error; the engine cannot continue:\n"
                               f"{format_exception(e)}")
        return [results[r] for r in range(len(refs))] if all_results else results[self.output_rank]

    def _fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
            logger.error("%s", message)
        self.shutdown()
        raise RuntimeError(self._failure)

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        return self._gather([a.execute.remote(method, args, True) for a in self.actors], all_results=True)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        import ray

        if self._failure is not None:
            raise RuntimeError(self._failure)
        call = WorkerCall(method)
        refs = [a.call.remote(call, tuple(args), dict(kwargs or {})) for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            missing = [r for r, ref in enumerate(refs) if ref not in ready]
            raise TimeoutError(f"collective_rpc({call.name!r}): Ray worker rank(s) {missing} did not answer "
                               f"within {timeout}s")
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                self._fail(f"pagedlm Ray worker rank {rank} died unexpectedly; the engine cannot continue: {e}")
            except Exception as e:
                raise RuntimeError(f"collective_rpc({call.name!r}) failed on Ray worker rank {rank}: {e}") from e
        return results

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
        import ray

        if self._failure is not None:
            raise RuntimeError(self._failure)
        # Put once; each actor reads the same object (Ray resolves top-level ref arguments).
        args_ref = ray.put((scheduler_output,))
        refs = [a.execute.remote("execute_model", args_ref, rank == self.output_rank)
                for rank, a in enumerate(self.actors)]
        future = _RayOutput(self, refs)
        return future if non_block else future.result()

    def check_health(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def shutdown(self) -> None:
        if hasattr(self, "_finalizer"):
            self._finalizer()
