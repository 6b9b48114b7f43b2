"""Engine-side request state shared by the scheduler and the KV-cache manager."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from pagedlm.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Finished states: everything above this line is not finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        # NOTE: a plain int: looking up a member on the enum class costs more than the test
        # itself, and this runs for every request in every step.
        return self >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FIRST_FINISHED = int(RequestStatus.FINISHED_STOPPED)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class EngineCoreRequest:
    """What the front end sends to the engine core (tokenized and validated)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    #: ``[len(prompt_token_ids), hidden]`` CPU tensor in the model dtype when the prompt is given
    #: as embeddings (``enable_prompt_embeds``); ``prompt_token_ids`` are placeholders then
    prompt_embeds: Any = None
    #: the LoRA adapter to run with (``pagedlm.core.lora.LoRARequest``), None: the base model
    lora_request: Any = None
    #: multimodal items (``MultiModalFeature``) in prompt order; their placeholder tokens are in
    #: ``prompt_token_ids``
    mm_features: list[Any] | None = None
    #: scheduling priority under ``scheduling_policy="priority"``: lower runs first (vLLM's)
    priority: int = 0


class Request:
    """A request inside the engine core.

    ``all_token_ids`` is prompt + output; ``num_computed_tokens`` counts the tokens whose K/V are
    in the cache (or scheduled to be written this step). ``block_hashes`` holds the chained hash
    of every *full* block of ``all_token_ids`` and is extended by the KV-cache manager.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        max_tokens: int | None = None,
        prompt_embeds: Any = None,
        lora_request: Any = None,
        mm_features: list[Any] | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.prompt_embeds = prompt_embeds
        #: multimodal items in prompt order (their hashes enter the block hashes of their blocks)
        self.mm_features: list[Any] = mm_features or []
        #: what the prefix-cache hash chain starts from: None (the root) for token ids; for a
        #: prompt given as embeddings, a digest of them (its placeholder ids say nothing); with
        #: a LoRA adapter, also the adapter (two adapters never share KV blocks)
        self.block_hash_seed: bytes | None = None if prompt_embeds is None else _digest(prompt_embeds)
        self.lora_request = lora_request
        if lora_request is not None:
            from pagedlm.core.lora.request import lora_hash_seed

            self.block_hash_seed = lora_hash_seed(lora_request, self.block_hash_seed)
        self.sampling_params = sampling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 until scheduled
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.max_tokens = max_tokens if max_tokens is not None else (sampling_params.max_tokens or 1)
        #: prompt + output tokens at which the request ends by length; the scheduler caps it at
        #: max_model_len when the request arrives
        self.max_num_tokens = self.num_prompt_tokens + self.max_tokens
        self.num_preemptions = 0
        #: wall-clock times in the core (metrics): entered the scheduler; first scheduled (None until)
        self.queued_time = time.time()
        self.scheduled_time: float | None = None
        self.block_hashes: list[bytes] = []
        #: tokens sampled on the device but not yet back on the host (async scheduling); the
        #: scheduler already counts them: the next step computes their K/V
        self.num_output_placeholders = 0
        #: how many of ``all_token_ids`` the workers have been sent; the scheduler sends the rest
        #: with the request's next schedule (``CachedRequestData.new_token_ids``)
        self.num_tokens_sent = 0
        #: speculative decoding: draft tokens proposed for the request's next step (never part of
        #: ``all_token_ids``: only verified tokens are)
        self.spec_token_ids: list[int] = []
        # Penalties and min_tokens read the whole output so far on the host: such a request
        # waits for its sampled token instead of running one step ahead of it.
        p = sampling_params
        self.needs_output_history = (
            p.min_tokens > 0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        )

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> Request:
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - len(req.prompt_token_ids)
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params, req.arrival_time, max_tokens,
                   prompt_embeds=req.prompt_embeds, lora_request=req.lora_request, mm_features=req.mm_features,
                   priority=req.priority)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )


def _digest(tensor: Any) -> bytes:
    """SHA-256 of a CPU tensor's dtype, shape and bytes."""
    import torch

    hasher = hashlib.sha256(f"prompt_embeds {tensor.dtype} {tuple(tensor.shape)}".encode())
    hasher.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.digest()
