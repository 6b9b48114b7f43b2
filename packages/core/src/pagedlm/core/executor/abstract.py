"""The executor: runs the workers of all ranks and hands back one rank's output."""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedlm.core.config import VllmConfig
from pagedlm.core.kv_cache.spec import AttentionSpec, KVCacheGroupSpec
from pagedlm.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput


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

    #: whether a step can go out before its grammar bitmask (``pending_structured_output_tokens``
    #: and :meth:`sample_tokens`): executors whose workers share the engine core's process
    supports_deferred_sampling: bool = False
    #: the workers run in this process: host arrays in a SchedulerOutput reach them as they are
    #: (not serialised), so page-locked ones are copied to the device without staging
    in_process_workers: bool = False

    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Finish the step that :meth:`execute_model` ran with ``pending_structured_output_tokens``:
        sample it under ``grammar_output``'s bitmask (vLLM's ``sample_tokens``)."""
        raise NotImplementedError(f"{type(self).__name__} runs every step to its sampled tokens")

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` on every worker and return their results in rank order (vLLM's
        ``collective_rpc``): a ``Worker`` method name, or a function called as
        ``method(worker, *args, **kwargs)``. A worker's exception is raised here (the engine goes
        on); ``timeout`` (seconds) raises ``TimeoutError`` when a worker has not answered by then."""
        raise NotImplementedError(f"{type(self).__name__} has no collective_rpc")

    def profile(self, is_start: bool, profile_prefix: str | None = None) -> None:
        """Start or stop the torch profiler of every worker (``Worker.profile``)."""
        self.collective_rpc("profile", args=(is_start, profile_prefix))

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


class WorkerCall:
    """One ``collective_rpc`` call: a ``Worker`` method name or a function of the worker.

    NOTE: a function travels to worker processes as bytes (cloudpickle when it is installed, so
    lambdas and functions of ``__main__`` work; else pickle, by reference) and is loaded in the
    worker only when called, so a function the worker cannot load fails that call, not the worker.
    """

    def __init__(self, method: str | Callable[..., Any] | WorkerCall) -> None:
        if isinstance(method, WorkerCall):  # passed on (a data-parallel replica's engine core)
            self.__dict__.update(method.__dict__)
            return
        if not (isinstance(method, str) or callable(method)):
            raise TypeError(f"collective_rpc method must be a Worker method name or a callable, got {method!r}")
        self.method: str | Callable[..., Any] | None = method
        self.name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
        self._payload: bytes | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if callable(self.method):
            state["method"], state["_payload"] = None, _dumps_callable(self.method, self.name)
        return state

    def __call__(self, worker: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.method is None:
            assert self._payload is not None
            self.method = pickle.loads(self._payload)
        if isinstance(self.method, str):
            fn = getattr(worker, self.method, None)
            if fn is None or not callable(fn):
                raise AttributeError(
                    f"collective_rpc: the worker ({type(worker).__name__}) has no method {self.method!r}")
            return fn(*args, **kwargs)
        return self.method(worker, *args, **kwargs)


def _dumps_callable(fn: Callable[..., Any], name: str) -> bytes:
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    if cloudpickle is not None:
        return cloudpickle.dumps(fn)
    try:
        return pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(
            f"collective_rpc cannot send {name} to the worker processes: {e}. Pass a function defined at "
            "module level (importable by the workers), or install cloudpickle for lambdas and closures"
        ) from e
