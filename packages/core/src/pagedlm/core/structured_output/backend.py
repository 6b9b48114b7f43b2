"""The interface of a structured-output backend (a grammar engine).

A backend is registered by name through ``pagedlm_register_structured_output_backends`` as a
``"module:Class"`` string of a :class:`StructuredOutputBackend` subclass, built in the engine core
(the first time a request asks for a grammar) as ``Cls(vllm_config=..., tokenizer=..., vocab_size=...)``.
``vocab_size`` is the width of the model's logits (which may exceed the tokenizer's vocabulary).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from pagedlm.core.structured_output.params import StructuredOutputsParams


class StructuredOutputGrammar(ABC):
    """One request's matcher: where its output stands in its grammar."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False if one of them is not allowed (the state is then
        the one before that token)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (``int32 [W]``: bit ``t % 32`` of word
        ``t // 32`` is set when token ``t`` is allowed), every word of it: the row may hold an
        earlier step's mask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has ended (its stop token accepted, or nothing more can follow)."""


class StructuredOutputBackend(ABC):
    """A grammar engine: checks, compiles and matches the constraints of
    :class:`StructuredOutputsParams`."""

    def __init__(self, *, vllm_config: Any, tokenizer: Any, vocab_size: int) -> None:
        self.vllm_config = vllm_config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` naming the field when the constraint cannot compile (in the front
        end, before the request is queued; no tokenizer needed)."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled form of a constraint (runs on the manager's threads; shared by requests)."""

    @abstractmethod
    def new_grammar(self, compiled: Any, stop_token_ids: list[int]) -> StructuredOutputGrammar:
        """A fresh matcher at the start of ``compiled``; ``stop_token_ids`` end the grammar (empty:
        it ends by itself when complete)."""

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """``int32 [num_rows, ceil(vocab_size / 32)]``, every token allowed."""
        return np.full((num_rows, -(-self.vocab_size // 32)), -1, dtype=np.int32)

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray) -> None:
        """Row ``i`` of ``bitmask`` for ``grammars[i]``. Backends may batch (and parallelize) this."""
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)

    def fill_seconds_estimate(self, num_rows: int) -> float:
        """The host seconds :meth:`fill_bitmasks` is expected to take for ``num_rows`` rows. The
        engine core fills on its fill thread, beside its own work, when this is large; only a
        backend whose fill releases the GIL gains from that, so the default (0.0) keeps the fill
        on the engine core's thread."""
        return 0.0
