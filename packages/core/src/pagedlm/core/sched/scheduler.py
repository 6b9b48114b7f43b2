"""The scheduler: which requests run this step, and how many of their tokens.

There is no separate prefill or decode phase. Every request has ``num_computed_tokens`` and
``num_tokens`` (prompt + outputs); each step gives each scheduled request up to
``num_tokens - num_computed_tokens`` new tokens out of a shared budget. A long prompt is thus
chunked across steps and decode tokens of other requests ride along in the same batch.

Order of a step:
  1. running requests, oldest first; when blocks run out, the newest running request is
     preempted (its blocks are freed and it is recomputed later) until the current one fits;
  2. waiting requests, FCFS, while budget, ``max_num_seqs`` and blocks allow (none are
     admitted in a step that had to preempt).

``scheduling_policy="priority"`` orders both by ``(priority, arrival_time)`` instead (the waiting
queue is a heap and the running list is sorted each step, so the request preempted is the one of
the lowest priority): see sched/request_queue.py.

With ``async_scheduling`` the engine schedules step N+1 before step N's sampled tokens are
back: every request that samples in a step gets an output *placeholder*, which the next step
computes like a known token (the model runner feeds the sampled id on the device).
``update_from_output`` later swaps the placeholder for the real token. A request whose next
token would end it by length, or whose sampling reads its output history on the host
(penalties, ``min_tokens``), is not scheduled ahead of its placeholder.

The ``SchedulerOutput`` is the workers' one source of request state: new requests in full, and
for the others their new blocks and the tokens the scheduler received for them since it last
scheduled them (``new_token_ids``). Every worker, of every pipeline stage, learns the sampled
tokens that way; preempted requests are named so that workers drop them from their batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pagedlm.core.kv_cache import KVCacheManager
from pagedlm.core.logger import init_logger
from pagedlm.core.request import _FIRST_FINISHED, Request, RequestStatus
from pagedlm.core.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from pagedlm.core.sched.request_queue import create_request_queue, priority_order

logger = init_logger(__name__)


class EngineCoreOutput:
    """New tokens (and maybe a finish) of one request after one step."""

    __slots__ = (
        "request_id", "new_token_ids", "finish_reason", "stop_reason", "new_logprobs",
        "new_prompt_logprobs", "num_cached_tokens", "error", "timing", "num_preemptions", "pooling_output",
    )

    def __init__(self, request_id: str, new_token_ids: list[int], finish_reason: str | None = None,
                 stop_reason: int | str | None = None, new_logprobs=None, new_prompt_logprobs=None,
                 num_cached_tokens: int = 0, error: str | None = None,
                 timing: tuple[float, float] | None = None, num_preemptions: int = 0,
                 pooling_output: list[float] | None = None) -> None:
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.new_logprobs = new_logprobs
        self.new_prompt_logprobs = new_prompt_logprobs
        self.num_cached_tokens = num_cached_tokens
        self.error = error
        #: (queued, first scheduled) wall-clock times in the core, on a request's first output only
        self.timing = timing
        #: times the request has been preempted so far
        self.num_preemptions = num_preemptions
        #: a pooling request's raw pooled vector (it finishes with it)
        self.pooling_output = pooling_output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(
        self,
        *,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = False,
        pipeline_depth: int = 1,
        policy: str = "fcfs",
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._no_block_ids: tuple[list[int], ...] = tuple([] for _ in kv_cache_manager.managers)
        self.async_scheduling = async_scheduling
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        #: "fcfs" or "priority" (vLLM's SchedulerConfig.policy)
        self.policy = policy
        self.waiting = create_request_queue(policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the workers must drop them.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        self._step = 0
        self._last_stats = SchedulerStats()
        #: batches the pipeline stages hold at once. With more than one, each batch takes at most
        #: a 1/pipeline_depth share of the running requests, so decodes split into batches that
        #: occupy every stage instead of one batch and idle stages.
        self.pipeline_depth = pipeline_depth

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in the engine")
        # NOTE: the length limit in one number (max_tokens and max_model_len), read every step
        request.max_num_tokens = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; unknown ids are ignored."""
        assert status.is_finished
        finished = []
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            finished.append(req)
        return finished

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # NOTE: this runs every step over every running request, so each of them costs what
        # changed for it (its new token, rarely a block) and nothing else: the per-request numbers
        # are read once into locals, the workers' columns are appended to in one pass, and the
        # request's bookkeeping (tokens computed, placeholder) is updated in that same pass.
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: list[Request] = []
        num_decode_tokens = 0
        async_scheduling = self.async_scheduling
        allocate_slots = self.kv_cache_manager.allocate_slots
        no_block_ids = self._no_block_ids
        req_ids, new_block_ids = cached.req_ids, cached.new_block_ids
        num_computed_col, new_token_ids_col = cached.num_computed_tokens, cached.new_token_ids

        # 1. running requests, oldest first (by priority under the priority policy).
        running = self.running
        if self.policy == "priority":
            running.sort(key=priority_order)
        index = 0
        num_running_scheduled = 0
        cap = -(-len(running) // self.pipeline_depth)
        while index < len(running) and token_budget > 0 and num_running_scheduled < cap:
            request = running[index]
            index += 1
            all_token_ids = request.all_token_ids
            num_tokens = len(all_token_ids)
            num_placeholders = request.num_output_placeholders
            num_computed = request.num_computed_tokens
            num_new_tokens = num_tokens + num_placeholders - num_computed
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            # NOTE: a running request has at least one token to compute (the rest of its prompt,
            # or the token sampled in the previous step) unless its last batch is still in flight
            # (pipeline parallelism keeps several batches in flight); then it waits for the token.
            # With a token in flight it must wait for it when it reads its output history on the
            # host, or when its next token could end it by length.
            if num_new_tokens <= 0 or (num_placeholders and (
                    request.needs_output_history or num_tokens + num_placeholders >= request.max_num_tokens)):
                continue
            new_blocks = allocate_slots(request, num_new_tokens)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                break
            request_id = request.request_id
            num_scheduled_tokens[request_id] = num_new_tokens
            token_budget -= num_new_tokens
            if num_new_tokens == 1 and num_tokens > request.num_prompt_tokens:
                num_decode_tokens += 1
            req_ids.append(request_id)
            # NOTE: most decode rows get no block: one shared empty entry (workers only read it)
            new_block_ids.append(tuple([b.block_id for b in blocks] for blocks in new_blocks)
                                 if any(new_blocks) else no_block_ids)
            num_computed_col.append(num_computed)
            # NOTE: only tokens back from the workers are sent: with async scheduling the one
            # still in flight is a placeholder here, and the device feeds it to this step.
            new_token_ids_col.append(all_token_ids[request.num_tokens_sent:])
            request.num_tokens_sent = num_tokens
            num_running_scheduled += 1
            # NOTE: tokens count as computed from the moment they are scheduled; a sampled token
            # is appended in update_from_output and scheduled in the next step (or,
            # asynchronously, its placeholder is scheduled in the next step already).
            num_computed += num_new_tokens
            request.num_computed_tokens = num_computed
            if async_scheduling and num_computed >= num_tokens + num_placeholders:
                request.num_output_placeholders = num_placeholders + 1
        num_cached_running = len(req_ids)
        cached.resumed_from_preemption = [False] * num_cached_running
        cached.token_ids = [None] * num_cached_running

        # 2. waiting requests, in the queue's order.
        while not preempted and self.waiting and token_budget > 0 and len(running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: it resumes once the token is back
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed
            if num_new_tokens > token_budget:
                if not self.enable_chunked_prefill:
                    break
                num_new_tokens = token_budget
            new_blocks = allocate_slots(
                request, num_new_tokens, new_computed_blocks=computed_blocks, num_new_computed_tokens=num_computed
            )
            if new_blocks is None:
                break
            self.waiting.popleft()
            running.append(request)
            if request.scheduled_time is None:
                request.scheduled_time = time.time()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            if request.status == RequestStatus.PREEMPTED:
                req_ids.append(request.request_id)
                cached.resumed_from_preemption.append(True)
                new_block_ids.append(block_ids)
                num_computed_col.append(num_computed)
                cached.token_ids.append(list(request.all_token_ids))
                new_token_ids_col.append([])
            else:
                new_reqs.append(
                    NewRequestData(
                        req_id=request.request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        sampling_params=request.sampling_params,
                        block_ids=block_ids,
                        num_computed_tokens=num_computed,
                        prompt_embeds=request.prompt_embeds,
                    )
                )
            request.status = RequestStatus.RUNNING
            request.num_tokens_sent = request.num_tokens
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            request.num_computed_tokens = num_computed + num_new_tokens
            # (a waiting request has no placeholder: see the check above)
            if async_scheduling and request.num_computed_tokens >= request.num_tokens:
                request.num_output_placeholders = 1

        total = self.max_num_batched_tokens - token_budget
        assert len(running) <= self.max_num_seqs
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
        )
        self.finished_req_ids = set()
        self._update_stats(output, len(preempted), num_decode_tokens)
        return output

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (no free KV blocks)", request.request_id)

    # -- results ----------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        # NOTE: one pass over the step's requests; a request that got one token (the common
        # case) appends it and checks its stop conditions inline, without building lists.
        outputs: list[EngineCoreOutput] = []
        all_logprobs, all_prompt_logprobs = runner_output.logprobs, runner_output.prompt_logprobs
        pooler_output = runner_output.pooler_output
        get_request = self.requests.get
        running_status = RequestStatus.RUNNING
        for req_id, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = get_request(req_id)
            if request is None:
                continue  # finished or aborted while the step ran: its tokens are dropped
            num_placeholders = request.num_output_placeholders
            if num_placeholders:
                request.num_output_placeholders = num_placeholders - len(token_ids)
            elif request.status != running_status:
                # Preempted while the step ran (only possible with batches in flight for pipeline
                # stages): it is recomputed and samples this position again.
                continue
            # NOTE: with async scheduling a request preempted while its token was in flight keeps
            # that token (drawn from the right context, and its generator has moved on).
            prompt_logprobs = all_prompt_logprobs.get(req_id) if all_prompt_logprobs else None
            if len(token_ids) == 1:  # the common case: one token, no list to build
                new_token_ids = token_ids
                token_id = token_ids[0]
                request.output_token_ids.append(token_id)
                request.all_token_ids.append(token_id)
                params = request.sampling_params
                if token_id in params.all_stop_token_ids or len(request.all_token_ids) >= request.max_num_tokens:
                    self._check_stop(request, token_id)
            elif not token_ids:
                pooled = pooler_output.get(req_id) if pooler_output else None
                if pooled is not None:
                    # a pooling request ends with its prompt: it never decodes
                    request.status = RequestStatus.FINISHED_STOPPED
                elif prompt_logprobs is None:
                    continue
                new_token_ids = token_ids
            else:
                new_token_ids = []
                for token_id in token_ids:
                    request.append_output_token_ids([token_id])
                    new_token_ids.append(token_id)
                    if self._check_stop(request, token_id):
                        break
            logprobs = all_logprobs.get(req_id) if all_logprobs else None
            if logprobs is not None and len(new_token_ids) < len(token_ids):
                logprobs = tuple(x[: len(new_token_ids)] for x in logprobs)
            status = request.status
            finished = status >= _FIRST_FINISHED
            outputs.append(
                EngineCoreOutput(
                    req_id, new_token_ids, status.finish_reason if finished else None, request.stop_reason,
                    logprobs, prompt_logprobs, request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
                    # the metrics' queue and prefill times, once per request
                    timing=((request.queued_time, request.scheduled_time or request.queued_time)
                            if request.num_output_tokens == len(new_token_ids) else None),
                    num_preemptions=request.num_preemptions,
                    pooling_output=pooler_output.get(req_id) if pooler_output else None,
                )
            )
            if finished:
                if request in self.waiting:  # preempted with its last token in flight
                    self.waiting.remove(request)
                else:
                    self.running.remove(request)
                self._free(request)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Finish the request if ``token_id`` (its newest token) stops it; returns whether it did."""
        # NOTE: all_stop_token_ids = stop_token_ids plus the model's eos ids unless ignore_eos
        # (filled by the Processor); only the user's own stop ids are reported as stop_reason.
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and token_id in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
            return True
        if request.num_tokens >= request.max_num_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # -- stats ------------------------------------------------------------------------------
    def _update_stats(self, output: SchedulerOutput, num_preempted: int, num_decode: int) -> None:
        kv = self.kv_cache_manager
        self._step += 1
        stats = kv.prefix_cache_stats
        self._last_stats = SchedulerStats(
            step=self._step,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_blocks=kv.num_blocks,
            num_used_blocks=kv.num_blocks - kv.num_free_blocks,
            num_cached_free_blocks=kv.block_pool.num_cached_free_blocks,
            kv_cache_usage=kv.usage,
            num_preemptions=num_preempted,
            num_scheduled_tokens=output.total_num_scheduled_tokens,
            num_prefill_tokens=output.total_num_scheduled_tokens - num_decode,
            num_decode_tokens=num_decode,
            prefix_cache_queries=stats.num_queries_tokens,
            prefix_cache_hits=stats.num_hit_tokens,
        )

    def make_stats(self) -> SchedulerStats:
        return self._last_stats
