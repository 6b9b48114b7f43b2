"""The scheduler's side of the encoder cache: which items' encoder outputs the workers hold,
which to compute this step, and what each step may spend.

An item's encoder output (``length`` rows) must be on the workers in every step that computes
any of its placeholder tokens; chunked prefill may split an item across steps, so the output is
computed once (in the first such step) and kept. Outputs are keyed by the item's hash: requests
with the same image share one. A request holds a reference on an item from the step that first
needs it until its computed tokens pass the item's end; unreferenced outputs stay cached (LRU)
until their space is needed, and the workers are told which ones to drop
(``SchedulerOutput.free_encoder_mm_hashes``).

Two budgets, both in encoder output tokens (vLLM's names): ``max_num_encoder_input_tokens`` per
step and ``encoder_cache_size`` in all; both are at least one largest item
(:func:`pagedlm.core.multimodal.registry.encoder_budget`), so every item can be scheduled.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderCacheManager:
    def __init__(self, *, cache_size: int, max_num_encoder_input_tokens: int, whole_items: bool = False) -> None:
        #: never end a step inside an item (items whose tokens attend to each other both ways)
        self.whole_items = whole_items
        self.cache_size = cache_size
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        #: hash -> rows, for every output the workers hold (or compute this step)
        self.cached: dict[str, int] = {}
        #: hash -> request ids referencing it
        self.refs: dict[str, set[str]] = {}
        #: request id -> hashes it references
        self.held: dict[str, set[str]] = {}
        #: unreferenced cached outputs, least recently used first (evicted when space is needed)
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.num_free = cache_size
        self._step_budget = max_num_encoder_input_tokens
        self._to_free: list[str] = []

    # -- one step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._step_budget = self.max_num_encoder_input_tokens

    def end_step(self) -> list[str]:
        """The hashes the workers must drop (evicted since the last step)."""
        freed, self._to_free = self._to_free, []
        return freed

    def plan(self, request: Any, num_computed: int, num_new_tokens: int,
             enable_chunked_prefill: bool = True) -> tuple[int, list[int]]:
        """(tokens the request may compute this step, indices of its items to encode now).

        Items whose placeholders the step reaches must be cached or encoded now; the first one
        that fits neither budget cuts the step's tokens short of its placeholders (to 0 without
        chunked prefill). Releases the request's references to items it has passed. Changes
        nothing else: :meth:`commit` does, once the request's KV blocks are allocated.
        """
        self._release_passed(request, num_computed)
        end = num_computed + num_new_tokens
        to_encode: list[int] = []
        budget = self._step_budget
        reclaimable = sum(self.freeable.values())
        needed = 0
        for index, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.end <= num_computed:
                continue
            if self.whole_items and end < feature.end:
                # the step would end inside the item: stop before it (or wait, when it started
                # inside, from a prefix-cache hit, for a step with room for its rest)
                num_new_tokens = max(feature.offset - num_computed, 0)
                break
            if feature.identifier in self.cached:
                reclaimable -= self.freeable.get(feature.identifier, 0)  # about to be referenced
                continue
            length = feature.length
            if length > budget or needed + length > self.num_free + reclaimable:
                num_new_tokens = feature.offset - num_computed if enable_chunked_prefill else 0
                break
            budget -= length
            needed += length
            to_encode.append(index)
        return max(num_new_tokens, 0), to_encode

    def commit(self, request: Any, num_computed: int, num_new_tokens: int, to_encode: list[int]) -> None:
        """The request runs ``num_new_tokens`` from ``num_computed``: reference every item the
        step reaches and allocate the outputs to encode (evicting unreferenced ones)."""
        end = num_computed + num_new_tokens
        for index, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.end <= num_computed:
                continue
            key = feature.identifier
            if index in to_encode and key not in self.cached:
                self._allocate(key, feature.length)
                self._step_budget -= feature.length
            self.freeable.pop(key, None)
            self.refs.setdefault(key, set()).add(request.request_id)
            self.held.setdefault(request.request_id, set()).add(key)

    def needs_plan(self, request: Any, num_computed: int) -> bool:
        """Whether the request's step must be planned: prompt tokens left, or references to drop."""
        return num_computed < request.num_prompt_tokens or request.request_id in self.held

    def free_request(self, request: Any) -> None:
        """Drop every reference of a request (finished, aborted or preempted)."""
        for feature in request.mm_features:
            self._unref(feature.identifier, request.request_id)

    # -- internals ---------------------------------------------------------------------------
    def _release_passed(self, request: Any, num_computed: int) -> None:
        for feature in request.mm_features:
            if feature.end > num_computed:
                break
            self._unref(feature.identifier, request.request_id)

    def _unref(self, key: str, request_id: str) -> None:
        holders = self.refs.get(key)
        if holders is None or request_id not in holders:
            return
        holders.discard(request_id)
        mine = self.held.get(request_id)
        if mine is not None:
            mine.discard(key)
            if not mine:
                del self.held[request_id]
        if not holders:
            del self.refs[key]
            self.freeable[key] = self.cached[key]

    def _allocate(self, key: str, length: int) -> None:
        while self.num_free < length:
            victim, size = self.freeable.popitem(last=False)
            del self.cached[victim]
            self.num_free += size
            self._to_free.append(victim)
        self.cached[key] = length
        self.num_free -= length


def make_encoder_cache_manager(vllm_config: Any) -> EncoderCacheManager | None:
    """The scheduler's encoder cache for a multimodal model; None for a text model."""
    from pagedlm.core.multimodal.registry import create_processor, encoder_budget

    budget = encoder_budget(vllm_config)
    if not budget:
        return None
    processor = create_processor(vllm_config.model_config)
    assert processor is not None
    whole_items = processor.bidirectional_item_attention
    if whole_items:
        largest = max(processor.max_tokens_per_item(m) for m in processor.supported_modalities)
        step_budget = int(vllm_config.scheduler_config.max_num_batched_tokens or 8192)
        if step_budget < largest:
            raise ValueError(f"max_num_batched_tokens={step_budget} is smaller than one image ({largest} tokens); "
                             f"{processor.architecture} computes an image's tokens in one step: raise it to at "
                             f"least {largest}")
    return EncoderCacheManager(cache_size=budget, max_num_encoder_input_tokens=budget, whole_items=whole_items)
