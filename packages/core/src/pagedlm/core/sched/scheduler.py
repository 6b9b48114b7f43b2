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

Structured outputs (``structured_output/manager.py``): a request with a grammar waits outside the
waiting queue until its grammar has compiled; each schedule ends with the bitmask rows of the
requests that sample under a grammar, and ``update_from_output`` advances their matchers.

The ``SchedulerOutput`` is the workers' one source of request state: new requests in full, and
for the others their new blocks and the tokens the scheduler received for them since it last
scheduled them (``new_token_ids``). Every worker, of every pipeline stage, learns the sampled
tokens that way; preempted requests are named so that workers drop them from their batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedlm.core.distributed.kv_transfer.base import KVConnectorBase_V1
from pagedlm.core.distributed.kv_transfer.scheduling import KVTransferScheduling
from pagedlm.core.kv_cache import KVCacheManager
from pagedlm.core.logger import init_logger
from pagedlm.core.multimodal.encoder_cache import EncoderCacheManager
from pagedlm.core.request import _FIRST_FINISHED, Request, RequestStatus
from pagedlm.core.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from pagedlm.core.sched.request_queue import create_request_queue, priority_order
from pagedlm.core.spec_decode.config import SpeculativeConfig
from pagedlm.core.spec_decode.scheduling import SpecDecodeScheduling

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pagedlm.core.structured_output.manager import StructuredOutputManager

logger = init_logger(__name__)


class EngineCoreOutput:
    """New tokens (and maybe a finish) of one request after one step."""

    __slots__ = (
        "request_id", "new_token_ids", "finish_reason", "stop_reason", "new_logprobs",
        "new_prompt_logprobs", "num_cached_tokens", "error", "timing", "num_preemptions", "kv_transfer_params",
        "pooling_output",
    )

    def __init__(self, request_id: str, new_token_ids: list[int], finish_reason: str | None = None,
                 stop_reason: int | str | None = None, new_logprobs=None, new_prompt_logprobs=None,
                 num_cached_tokens: int = 0, error: str | None = None,
                 timing: tuple[float, float] | None = None, num_preemptions: int = 0,
                 kv_transfer_params: dict | None = None,
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
        #: a KV connector's parameters for the next instance (disaggregated prefill), on the last output
        self.kv_transfer_params = kv_transfer_params
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
        max_loras: int | None = None,
        kv_connector: KVConnectorBase_V1 | None = None,
        kv_load_failure_policy: str = "recompute",
        encoder_cache: EncoderCacheManager | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        policy: str = "fcfs",
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        #: holds requests with ``structured_outputs`` until their grammar is ready, fills each
        #: step's bitmask rows and advances their matchers (structured_output/manager.py)
        self.structured_output_manager = structured_output_manager
        #: outputs of requests finished outside a step (a grammar that failed to compile); the
        #: engine core sends them with the next step's outputs
        self.failed_outputs: list[EngineCoreOutput] = []
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
        #: with LoRA: at most max_loras distinct adapters among running requests (pagedlm.core.lora)
        self.lora_gate = None
        if max_loras is not None:
            from pagedlm.core.lora.scheduling import LoRAGate

            self.lora_gate = LoRAGate(max_loras)
        #: KV transfer (kv_transfer_config): requests loading external KV, delayed frees
        self.kv_transfer = (KVTransferScheduling(kv_connector, kv_cache_manager,
                                                 fail_on_load_error=kv_load_failure_policy == "fail")
                            if kv_connector is not None else None)
        #: multimodal models: the encoder outputs the workers hold and the budget to compute them
        self.encoder_cache = encoder_cache
        #: speculative decoding's part (spec_decode/scheduling.py); None when it is off
        self.spec = SpecDecodeScheduling(speculative_config, max_model_len) if speculative_config else None

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in the engine")
        # NOTE: the length limit in one number (max_tokens and max_model_len), read every step
        request.max_num_tokens = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        self.requests[request.request_id] = request
        if self.structured_output_manager is not None and self.structured_output_manager.hold(request):
            return  # joins the waiting queue once its grammar is compiled
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
            elif (self.kv_transfer is None or not self.kv_transfer.forget_waiting(req)) and \
                    (self.structured_output_manager is None or not self.structured_output_manager.is_held(req)):
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            finished.append(req)
        return finished

    def _free(self, request: Request) -> dict | None:
        """Release a finished request; returns the KV connector's kv_transfer_params for it."""
        free_now, params = True, None
        if self.kv_transfer is not None:
            free_now, params = self.kv_transfer.on_request_finished(request)
        if free_now:
            self.kv_cache_manager.free(request)
        if self.encoder_cache is not None and request.mm_features:
            self.encoder_cache.free_request(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        if self.structured_output_manager is not None:
            self.structured_output_manager.remove(request.request_id)
        return params

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._num_held()) or (
            self.kv_transfer is not None and self.kv_transfer.has_work())

    def get_num_unfinished_requests(self) -> int:
        loading = self.kv_transfer.num_waiting() if self.kv_transfer is not None else 0
        return len(self.waiting) + len(self.running) + self._num_held() + loading

    def _num_held(self) -> int:
        som = self.structured_output_manager
        return som.num_held if som is not None else 0

    def _admit_structured_output_requests(self, som: StructuredOutputManager) -> None:
        """Move requests whose grammar is ready to the waiting queue; finish those whose grammar
        failed (with their error, sent by the engine core with the next outputs)."""
        ready, failed = som.take_ready(block=not self.waiting and not self.running)
        self.waiting.extend(ready)
        for request, error in failed:
            request.status = RequestStatus.FINISHED_ERROR
            self._free(request)
            self.failed_outputs.append(EngineCoreOutput(request.request_id, [], "error", error=error))

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # NOTE: this runs every step over every running request, so each of them costs what
        # changed for it (its new token, rarely a block) and nothing else: the per-request numbers
        # are read once into locals, the workers' columns are appended to in one pass, and the
        # request's bookkeeping (tokens computed, placeholder) is updated in that same pass.
        som = self.structured_output_manager
        if som is not None and som.num_held:
            self._admit_structured_output_requests(som)
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
        spec = self.spec
        scheduled_spec_tokens: dict[str, list[int]] = {}
        num_computed_col, new_token_ids_col = cached.num_computed_tokens, cached.new_token_ids
        encoder = self.encoder_cache
        scheduled_encoder_inputs: dict[str, list[int]] = {}
        if encoder is not None:
            encoder.begin_step()

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
            # (none in a step scheduled ahead of the last one's tokens: spec_decode/engine_step.py)
            drafts = spec.drafts_to_schedule(request, num_new_tokens, len(running)) \
                if spec is not None and request.spec_token_ids and not async_scheduling else None
            if drafts:
                num_new_tokens += len(drafts)
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
            to_encode = None
            if encoder is not None and request.mm_features and encoder.needs_plan(request, num_computed):
                num_new_tokens, to_encode = encoder.plan(request, num_computed, num_new_tokens)
                if num_new_tokens <= 0:
                    continue  # its next image does not fit the encoder budget this step
            num_slots = num_new_tokens if spec is None else spec.num_slots(num_computed, num_new_tokens)
            new_blocks = allocate_slots(request, num_slots)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = allocate_slots(request, num_slots)
            if new_blocks is None:
                break
            request_id = request.request_id
            if to_encode is not None:
                encoder.commit(request, num_computed, num_new_tokens, to_encode)  # type: ignore[union-attr]
                if to_encode:
                    scheduled_encoder_inputs[request_id] = to_encode
            num_scheduled_tokens[request_id] = num_new_tokens
            if drafts and num_new_tokens > 1:  # (the budget may have cut some drafts, or all)
                scheduled_spec_tokens[request_id] = drafts[: num_new_tokens - 1]
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
        lora_gate, lora_skipped = self.lora_gate, []
        if lora_gate is not None:
            lora_gate.begin(running)
        while not preempted and self.waiting and token_budget > 0 and len(running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: it resumes once the token is back
            if lora_gate is not None and not lora_gate.admits(request):
                lora_skipped.append(self.waiting.popleft())  # its adapter would need one slot too many
                continue
            kvt = self.kv_transfer
            num_external = 0
            if kvt is not None and kvt.is_loaded(request):
                # its external KV loaded: it holds its blocks, computed up to the last one that loaded
                computed_blocks, num_computed = None, request.num_computed_tokens
            else:
                computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
                if kvt is not None:
                    num_external, load_async = kvt.match(request, num_computed)
                    if num_external is None:
                        break
                    if load_async and num_external:
                        if not kvt.start_async_load(request, computed_blocks, num_computed, num_external):
                            break
                        self.waiting.popleft()  # it waits for its KV in kv_transfer.loading
                        continue
            num_new_tokens = request.num_tokens - num_computed - num_external
            if num_new_tokens > token_budget:
                if not self.enable_chunked_prefill:
                    break
                num_new_tokens = token_budget
            to_encode = None
            if encoder is not None and request.mm_features:
                num_new_tokens, to_encode = encoder.plan(request, num_computed, num_new_tokens,
                                                         self.enable_chunked_prefill)
                if num_new_tokens <= 0:
                    break  # its image does not fit the encoder budget this step
            num_slots = num_new_tokens if spec is None else spec.num_slots(num_computed, num_new_tokens)
            new_blocks = allocate_slots(
                request, num_external + num_slots, new_computed_blocks=computed_blocks,
                num_new_computed_tokens=num_computed if computed_blocks is not None else 0,
            )
            if new_blocks is None:
                break
            if kvt is not None:
                if num_external:  # loaded before this step's forward
                    kvt.on_sync_load(request, num_computed, num_external)
                    num_computed += num_external
                kvt.on_admitted(request)
            if to_encode is not None:
                encoder.commit(request, num_computed, num_new_tokens, to_encode)  # type: ignore[union-attr]
                if to_encode:
                    scheduled_encoder_inputs[request.request_id] = to_encode
            self.waiting.popleft()
            running.append(request)
            if lora_gate is not None:
                lora_gate.admit(request)
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
                        lora_request=request.lora_request,
                        mm_features=request.mm_features,
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

        if lora_skipped:
            self.waiting.extendleft(reversed(lora_skipped))
        total = self.max_num_batched_tokens - token_budget
        assert len(running) <= self.max_num_seqs
        # NOTE: with async scheduling the engine core fills them (fill_grammar_bitmask) once the
        # batch in flight, whose tokens the grammars need first, is back
        grammar_rows, grammar_bitmask = som.grammar_bitmask(self.requests, num_scheduled_tokens) \
            if som is not None and not async_scheduling else ({}, None)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            structured_output_request_ids=grammar_rows,
            grammar_bitmask=grammar_bitmask,
            scheduled_spec_decode_tokens=scheduled_spec_tokens,
        )
        if encoder is not None:
            output.scheduled_encoder_inputs = scheduled_encoder_inputs
            output.free_encoder_mm_hashes = encoder.end_step()
        self.finished_req_ids = set()
        if self.kv_transfer is not None:
            self.kv_transfer.build_meta(output)
        self._update_stats(output, len(preempted), num_decode_tokens)
        return output

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.encoder_cache is not None and request.mm_features:
            self.encoder_cache.free_request(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
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
        if self.kv_transfer is not None:
            self._update_kv_transfer(scheduler_output, runner_output, outputs)
        all_logprobs, all_prompt_logprobs = runner_output.logprobs, runner_output.prompt_logprobs
        spec_tokens, all_spec_token_ids = scheduler_output.scheduled_spec_decode_tokens, runner_output.spec_token_ids
        pooler_output = runner_output.pooler_output
        get_request = self.requests.get
        running_status = RequestStatus.RUNNING
        som = self.structured_output_manager
        grammar_active = som is not None and som.has_requests
        for i, (req_id, token_ids) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
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
            if spec_tokens and req_id in spec_tokens:
                self.spec.on_verified(request, len(spec_tokens[req_id]), len(token_ids))  # type: ignore[union-attr]
            if all_spec_token_ids is not None:
                request.spec_token_ids = all_spec_token_ids[i]
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
            error = None
            if grammar_active and new_token_ids and not request.is_finished:
                error = self._advance_grammar(request, new_token_ids)
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
                    num_preemptions=request.num_preemptions, error=error,
                    pooling_output=pooler_output.get(req_id) if pooler_output else None,
                )
            )
            if finished:
                if request in self.waiting:  # preempted with its last token in flight
                    self.waiting.remove(request)
                else:
                    self.running.remove(request)
                kv_transfer_params = self._free(request)
                if kv_transfer_params is not None:
                    outputs[-1].kv_transfer_params = kv_transfer_params
        return outputs

    def _update_kv_transfer(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                            outputs: list[EngineCoreOutput]) -> None:
        """Requests whose external KV loaded go back to the front of the queue; those whose
        load failed for good fail (their tokens of this step, if any, are dropped)."""
        assert self.kv_transfer is not None
        ready, failures = self.kv_transfer.update(scheduler_output, runner_output.kv_connector_output)
        self.waiting.extendleft(reversed(ready))
        for req_id, reason in failures.items():
            if self.finish_requests([req_id], RequestStatus.FINISHED_ERROR):
                logger.warning("request %s failed: %s", req_id, reason)
                outputs.append(EngineCoreOutput(req_id, [], finish_reason="error", error=reason))

    def needs_grammar_bitmask(self, output: SchedulerOutput) -> bool:
        """Whether a step scheduled with async scheduling has rows for the engine core to fill."""
        som = self.structured_output_manager
        return self.async_scheduling and som is not None and som.any_in(output.num_scheduled_tokens)

    def fill_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """Fill a step's grammar bitmask rows (async scheduling: once the batch in flight is back)."""
        som = self.structured_output_manager
        assert som is not None
        output.structured_output_request_ids, output.grammar_bitmask = som.grammar_bitmask(
            self.requests, output.num_scheduled_tokens)

    def fill_grammar_bitmask_deferred(self, output: SchedulerOutput) -> Future | None:
        """:meth:`fill_grammar_bitmask`, possibly still filling on the structured-output manager's
        fill thread: then its future (``structured_output_manager.wait_fill`` it)."""
        som = self.structured_output_manager
        assert som is not None
        output.structured_output_request_ids, output.grammar_bitmask, future = som.grammar_bitmask_deferred(
            self.requests, output.num_scheduled_tokens)
        return future

    def _advance_grammar(self, request: Request, token_ids: list[int]) -> str | None:
        """Advance the request's grammar over its new tokens: a grammar that has ended stops the
        request; a token it refuses fails the request (returns the error)."""
        verdict = self.structured_output_manager.accept_tokens(request, token_ids)  # type: ignore[union-attr]
        if verdict is None:
            return None
        if verdict == "stop":
            request.status = RequestStatus.FINISHED_STOPPED
            return None
        request.status = RequestStatus.FINISHED_ERROR
        return verdict

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
        if self.lora_gate is not None:
            self._last_stats.running_lora_adapters = self.lora_gate.adapter_counts(self.running)
            self._last_stats.waiting_lora_adapters = self.lora_gate.adapter_counts(self.waiting)

    def make_stats(self) -> SchedulerStats:
        return self._last_stats
