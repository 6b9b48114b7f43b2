"""The scheduler's side of KV transfer: what ``Scheduler`` does with a connector.

Kept out of sched/scheduler.py, which calls it at four points: admitting a waiting request
(``match`` / ``start_async_load`` / ``on_sync_load`` / ``on_admitted``), finishing one
(``on_request_finished``), building a step (``build_meta``) and reading a step's results
(``update``).

A request whose external tokens load asynchronously leaves the waiting queue with its blocks
allocated and waits here (``loading``); when the workers report the load over, it goes back to
the front of the waiting queue with ``num_computed_tokens`` up to the last block that loaded
(``loaded``), and is scheduled from there like a request that had a long prefix-cache hit.

NOTE: blocks being loaded are not in the prefix cache until they loaded (nobody may hit KV that
is not there yet); a request aborted while its load is in flight keeps its blocks until the
workers are done writing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedlm.core.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorOutput
from pagedlm.core.logger import init_logger

if TYPE_CHECKING:
    from pagedlm.core.kv_cache import KVCacheManager
    from pagedlm.core.request import Request
    from pagedlm.core.sched.output import SchedulerOutput

logger = init_logger(__name__)


@dataclass
class _Load:
    request: Request
    num_local: int
    num_external: int
    aborted: bool = False


@dataclass
class ExternalPrefixCacheStats:
    """KV-connector lookups since start, in tokens (vLLM's external prefix cache)."""

    num_queries_tokens: int = 0
    num_hit_tokens: int = 0
    #: tokens the connector offered that did not load and were computed instead
    num_recomputed_tokens: int = 0


class KVTransferScheduling:
    def __init__(self, connector: KVConnectorBase_V1, kv_cache_manager: KVCacheManager, *,
                 fail_on_load_error: bool) -> None:
        self.connector = connector
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.fail_on_load_error = fail_on_load_error
        self.loading: dict[str, _Load] = {}
        #: requests back in the waiting queue with their loaded blocks
        self.loaded: set[str] = set()
        #: finished requests whose blocks the connector keeps until their KV is sent
        self.delayed_free: dict[str, Request] = {}
        #: id(scheduler output) -> {request id: (first loaded block index, blocks)} of its sync loads
        self._sync_loads: dict[int, dict[str, tuple[int, int]]] = {}
        self._step_sync_loads: dict[str, tuple[int, int]] = {}
        self.stats = ExternalPrefixCacheStats()
        bind = getattr(connector, "bind_kv_cache_manager", None)
        if bind is not None:  # connectors that watch the device prefix cache (OffloadingConnector)
            bind(kv_cache_manager)

    def has_work(self) -> bool:
        return bool(self.loading or self.delayed_free) or self.connector.has_pending_work()

    def num_waiting(self) -> int:
        return len(self.loading)

    # -- admission -----------------------------------------------------------------------------
    def is_loaded(self, request: Request) -> bool:
        return request.request_id in self.loaded

    def match(self, request: Request, num_local: int) -> tuple[int | None, bool]:
        """(external tokens after the local hit, whether they load asynchronously); None: the
        connector cannot tell yet (the request waits a step)."""
        if request.sampling_params.prompt_logprobs is not None:
            return 0, False  # every prompt position's logits are needed: nothing may be skipped
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if num_external is None:
            return None, False
        # NOTE: never every token: the last one must run through the model for its logits.
        return max(min(num_external, request.num_tokens - 1 - num_local), 0), load_async

    def start_async_load(self, request: Request, computed_blocks: Any, num_local: int, num_external: int) -> bool:
        """Allocate the blocks of the local hit and of the external tokens and hand the load to
        the connector; False when the blocks do not fit (the request stays waiting)."""
        blocks = self.kv.allocate_slots(request, num_external, new_computed_blocks=computed_blocks,
                                        num_new_computed_tokens=num_local, num_tokens_to_cache=num_local)
        if blocks is None:
            return False
        request.num_computed_tokens = num_local
        self.connector.update_state_after_alloc(request, self.kv.get_blocks(request.request_id), num_external)
        self.loading[request.request_id] = _Load(request, num_local, num_external)
        self.stats.num_queries_tokens += request.num_tokens
        return True

    def on_sync_load(self, request: Request, num_local: int, num_external: int) -> None:
        """The request's blocks are allocated and its external tokens count as computed: the
        workers load them before this step's forward."""
        self.connector.update_state_after_alloc(request, self.kv.get_blocks(request.request_id), num_external)
        self._step_sync_loads[request.request_id] = (num_local // self.block_size, num_external // self.block_size)
        self.stats.num_hit_tokens += num_external

    def on_admitted(self, request: Request) -> None:
        if request.request_id in self.loaded:
            self.loaded.discard(request.request_id)  # (its query was counted when its load started)
        elif not request.num_preemptions:
            self.stats.num_queries_tokens += request.num_tokens

    # -- finishing -----------------------------------------------------------------------------
    def forget_waiting(self, request: Request) -> bool:
        """Take a request that is waiting for its load out (an abort); whether it was here."""
        load = self.loading.get(request.request_id)
        if load is None:
            return False
        load.aborted = True
        return True

    def on_request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """(free the blocks now, kv_transfer_params) for a request that finished."""
        self.loaded.discard(request.request_id)
        if request.request_id in self.loading:
            return False, None  # freed once the workers are done writing into them
        block_ids = self.kv.get_block_ids(request.request_id)[0]
        delay, params = self.connector.request_finished(request, block_ids)
        if delay:
            self.delayed_free[request.request_id] = request
        return not delay, params

    # -- steps ---------------------------------------------------------------------------------
    def build_meta(self, output: SchedulerOutput) -> None:
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        if self._step_sync_loads:
            self._sync_loads[id(output)] = self._step_sync_loads
            self._step_sync_loads = {}

    def update(self, output: SchedulerOutput, connector_output: KVConnectorOutput | None
               ) -> tuple[list[Request], dict[str, str]]:
        """Apply what the workers reported after ``output``'s step. Returns (requests whose
        loads are over, to put back at the front of the waiting queue in this order; request id
        -> reason for requests that must fail)."""
        sync_loads = self._sync_loads.pop(id(output), {})
        if connector_output is None:
            connector_output = KVConnectorOutput()
        self.connector.update_connector_output(connector_output)
        for req_id in connector_output.finished_sending:
            request = self.delayed_free.pop(req_id, None)
            if request is not None:
                self.kv.free(request)
        invalid = connector_output.invalid_block_ids
        failures = dict(connector_output.failed_recving)
        if invalid:
            for req_id, (first, num_blocks) in sync_loads.items():
                # a synchronous load already counted as computed: the step used bad KV
                if self._num_valid(req_id, first, num_blocks, invalid) < num_blocks:
                    self._drop_from_prefix_cache(req_id, first, num_blocks)
                    failures.setdefault(req_id, "the KV connector failed to load this request's cached KV blocks")
        ready: list[Request] = []
        for req_id in connector_output.finished_recving:
            load = self.loading.pop(req_id, None)
            if load is None:
                continue
            request = load.request
            if load.aborted:
                self.kv.free(request)
                continue
            if req_id in failures:
                self.loaded.add(req_id)  # holds its blocks: the scheduler finishes it from the waiting queue
                ready.append(request)
                continue
            first, num_blocks = load.num_local // self.block_size, load.num_external // self.block_size
            valid = self._num_valid(req_id, first, num_blocks, invalid)
            if valid < num_blocks:
                lost = (num_blocks - valid) * self.block_size
                self.stats.num_recomputed_tokens += lost
                logger.warning("request %s: %d of %d external KV blocks did not load; %s", req_id,
                               num_blocks - valid, num_blocks,
                               "failing it (kv_load_failure_policy='fail')" if self.fail_on_load_error
                               else f"recomputing {lost} tokens")
                if self.fail_on_load_error:
                    failures[req_id] = (f"{num_blocks - valid} of {num_blocks} KV blocks from the KV connector did not "
                                        "load (kv_load_failure_policy='fail')")
            request.num_computed_tokens = load.num_local + valid * self.block_size
            self.kv.cache_computed_blocks(request, request.num_computed_tokens)
            self.stats.num_hit_tokens += valid * self.block_size
            self.loaded.add(req_id)
            ready.append(request)
        return ready, failures

    def _num_valid(self, req_id: str, first: int, num_blocks: int, invalid: set[int]) -> int:
        block_ids = self.kv.get_block_ids(req_id)[0]
        for i in range(num_blocks):
            if block_ids[first + i] in invalid:
                return i
        return num_blocks

    def _drop_from_prefix_cache(self, req_id: str, first: int, num_blocks: int) -> None:
        blocks = self.kv.get_blocks(req_id)[0]
        self.kv.block_pool.uncache_blocks(blocks[first:first + num_blocks])
