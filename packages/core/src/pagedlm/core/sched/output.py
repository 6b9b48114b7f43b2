"""What the scheduler tells the workers each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedlm.core.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen before (first schedule)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    #: one block table per KV-cache group (kv_cache/spec.py)
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    #: ``[num_prompt_tokens, hidden]`` CPU tensor when the prompt is given as embeddings
    #: (``prompt_token_ids`` are placeholders then)
    prompt_embeds: Any = None
    #: the request's LoRA adapter (``pagedlm.core.lora.LoRARequest``), None: the base model
    lora_request: Any = None
    #: multimodal items (``pagedlm.core.multimodal.inputs.MultiModalFeature``), in prompt order
    mm_features: list[Any] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Requests the workers already hold, in schedule order.

    ``new_block_ids[i]`` holds one list of block ids per KV-cache group. NOTE: for a request
    resumed after preemption, they are its whole new block tables, ``token_ids[i]`` is its full
    token list (prompt + outputs) and ``new_token_ids[i]`` is empty; otherwise each list is
    appended to that group's table, ``token_ids[i]`` is None and ``new_token_ids[i]`` holds the
    tokens the scheduler received for it since it last scheduled it (the output tokens the
    workers have not been sent yet, oldest first). A sliding-window group never sends the blocks
    it freed: the worker's table keeps their stale ids, at positions the window masks.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    token_ids: list[list[int] | None] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    #: req_id -> number of tokens computed for it this step
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    #: requests finished or aborted since the last step: workers drop their state
    finished_req_ids: set[str]
    #: requests preempted this step: workers drop them from the batch (their KV blocks are freed)
    #: but keep their per-request state until they resume (resumed_from_preemption) or finish
    preempted_req_ids: set[str] = field(default_factory=set)
    #: the KV connector's metadata for the workers (kv_transfer_config), or None
    kv_connector_metadata: Any = None
    #: req_id -> indices of its ``mm_features`` whose encoder outputs the workers compute this step
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    #: item hashes whose encoder outputs the workers drop (evicted from the encoder cache)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    #: structured outputs: req_id -> row of ``grammar_bitmask`` (``int32 [rows, ceil(V/32)]``) for
    #: the requests that sample in this step under a grammar (structured_output/bitmask.py)
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    #: req_id -> the draft tokens scheduled after its newest token (speculative decoding; vLLM's
    #: name): part of ``num_scheduled_tokens``, verified by the workers in this step
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    #: structured outputs under async scheduling: the grammar bitmask waits for the tokens of the
    #: batch in flight, so the workers run the forward and stop before sampling; the executor's
    #: ``sample_tokens(GrammarOutput)`` finishes the step (vLLM's name)
    pending_structured_output_tokens: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class GrammarOutput:
    """A step's grammar bitmask, filled after its forward went out (``sample_tokens``): req_id ->
    row of ``grammar_bitmask`` (``int32 [rows, ceil(V/32)]``), as in :class:`SchedulerOutput`."""

    structured_output_request_ids: dict[str, int]
    grammar_bitmask: np.ndarray | None


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, in ``req_ids`` order."""

    req_ids: list[str]
    #: sampled tokens per request; empty for a prefill chunk that does not end the prompt
    sampled_token_ids: list[list[int]]
    #: req_id -> (token ids [n, k+1], logprobs [n, k+1], ranks [n]) of the sampled tokens
    logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)
    #: req_id -> same triple for prompt positions 1..P-1, sent once the prompt is done
    prompt_logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)
    #: what the worker's KV connector reports (``kv_transfer.base.KVConnectorOutput``), or None
    kv_connector_output: Any = None
    #: speculative decoding: per request (``req_ids`` order) the drafts for its next step; None when off
    spec_token_ids: list[list[int]] | None = None
    #: pooling models: req_id -> the prompt's raw pooled vector, in the step its prompt ends
    pooler_output: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    """One sample per engine step (cheap counters; feeds logs, metrics and plots)."""

    step: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0
    num_cached_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: LoRA adapter name -> requests running / waiting with it (vLLM's names; empty without LoRA)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
