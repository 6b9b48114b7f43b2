"""The batch-level logits-processor interface (vLLM V1's ``vllm.v1.sample.logits_processor``).

A logits processor sees the whole persistent batch: every step, ``update_state`` learns how the
batch changed (requests added, removed, moved between rows) and ``apply`` transforms the logits
``[batch_size, vocab]`` of every request in it, row ``i`` belonging to the request at index ``i``.
Per-request settings come from ``SamplingParams`` (custom ones from ``extra_args``).

The model runner keeps the batch dense as vLLM's does (``batch_update.BatchUpdateTracker``):
indices are ``0 .. batch_size - 1``; an added request takes the lowest index a finished request
freed, else the next one; holes left by removals are filled by moving the highest requests down
(``UNIDIRECTIONAL`` moves). The order of operations in one :class:`BatchUpdate` is removed, added,
moved. A request's ``output_tok_ids`` list is the live list the runner appends to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from pagedlm.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig


class MoveDirectionality(Enum):
    #: the request at index ``a`` moves to index ``b``; ``a`` becomes empty
    UNIDIRECTIONAL = auto()
    #: the requests at ``a`` and ``b`` exchange indices
    SWAP = auto()


#: index of a request removed without replacement
RemovedRequest = int
#: ``(index, params, prompt_tok_ids, output_tok_ids)``; the prompt ids are None for a prompt given
#: as embeddings; ``output_tok_ids`` is the request's live output list
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
#: ``(index a, index b, directionality)``
MovedRequest = tuple[int, int, MoveDirectionality]

#: vLLM's per-request logits processor (``vllm.logits_process.LogitsProcessor``): called with the
#: output token ids so far (and, with three parameters, the prompt token ids first) and one row of
#: logits ``[vocab]``; returns the new row (or modifies it in place and returns it)
RequestLogitsProcessor = (
    Callable[[list[int], torch.Tensor], torch.Tensor] | Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
)


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the last ``update_state`` call."""

    #: requests in the batch after the update (indices ``0 .. batch_size - 1``)
    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Base class of batch-level logits processors (``LLM(logits_processors=[cls or "module:Class"])``).

    One instance per worker (device rank), built as ``cls(vllm_config, device, is_pin_memory)``.
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError when a request's parameters (its ``extra_args``) are invalid for this
        processor. Runs in the front end, before the request is queued."""

    @abstractmethod
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform ``logits`` ``[batch_size, vocab]`` float32 (in place or not); return them."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes a row's argmax (e.g. it only masks low-probability
        tokens): then it is skipped for greedy rows and runs on the random path only, after the
        temperature. Asked once, when the engine starts."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step's forward pass; ``batch_update`` is None when the batch's
        membership did not change (the output token lists may still have grown)."""
        raise NotImplementedError
