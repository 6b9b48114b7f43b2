"""Building ``BatchUpdate`` s, the set of loaded processors, and the per-request adapter."""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pagedlm.core.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RequestLogitsProcessor,
)
from pagedlm.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig

T = TypeVar("T")


class BatchUpdateBuilder:
    """Collects one step's changes. Removals are registered first; adds then reuse the lowest
    freed index (``pop_removed``); what is left in ``removed`` was removed without replacement."""

    def __init__(self) -> None:
        self._removed: list[int] = []
        self.added: list[AddedRequest] = []
        self.moved: list[MovedRequest] = []

    @property
    def removed(self) -> list[int]:
        """Indices removed without replacement, lowest last."""
        self._removed.sort(reverse=True)
        return self._removed

    def removed_append(self, index: int) -> None:
        self._removed.append(index)

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """The lowest removed index, or None."""
        return self.removed[-1] if self._removed else None

    def pop_removed(self) -> int | None:
        """Take the lowest removed index (an add replaces that request), or None."""
        return self.removed.pop() if self._removed else None

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """The step's update (None when nothing changed); starts the next step empty."""
        if not (self._removed or self.added or self.moved):
            return None
        update = BatchUpdate(batch_size=batch_size, removed=self.removed, added=self.added, moved=self.moved)
        self._removed, self.added, self.moved = [], [], []
        return update


class LogitsProcessors:
    """The loaded processors, split by ``is_argmax_invariant()`` (asked once, here)."""

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] | None = None) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in logitsprocs or ():
            (self.argmax_invariant if proc.is_argmax_invariant() else self.non_argmax_invariant).append(proc)

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        return chain(self.argmax_invariant, self.non_argmax_invariant)

    def __bool__(self) -> bool:
        return bool(self.argmax_invariant or self.non_argmax_invariant)


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Apply ``batch_update`` to a sparse ``index -> state`` dict (vLLM's helper of the same name):
    removed indices are dropped, an added request gets ``new_state(params, prompt_ids, output_ids)``
    (None: no entry), moves move or swap entries. Returns whether ``req_entries`` changed."""
    if not batch_update:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        elif req_entries.pop(index, None) is not None:  # replaced a request that had an entry
            changed = True
    for a, b, direction in batch_update.moved:
        a_state = req_entries.pop(a, None)
        b_state = req_entries.pop(b, None)
        if a_state is not None:
            req_entries[b] = a_state
        if direction == MoveDirectionality.SWAP and b_state is not None:
            req_entries[a] = b_state
        changed |= a_state is not None or b_state is not None
    return changed


class AdapterLogitsProcessor(LogitsProcessor):
    """Wraps a per-request logits processor (a function of the output ids and one logits row) as
    a batch-level one. Subclasses implement :meth:`new_req_logits_processor` and
    :meth:`is_argmax_invariant`; a subclass ``__init__`` must call ``super().__init__(...)``.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        #: index -> the request's processor with its token lists bound (live references)
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The per-request processor for a new request, or None to leave its rows alone."""
        raise NotImplementedError

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None,
                   output_ids: list[int]) -> partial[torch.Tensor] | None:
        req_lp: Any = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        # Three parameters: (prompt_ids, output_ids, logits); two: (output_ids, logits).
        if len(inspect.signature(req_lp).parameters) == 3:
            return partial(req_lp, prompt_ids if prompt_ids is not None else [], output_ids)
        return partial(req_lp, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, req_lp in self.req_info.items():
            row = logits[index]
            new_row = req_lp(row)
            if new_row is not row:
                logits[index] = new_row
        return logits
