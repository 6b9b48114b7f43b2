"""The proposer interface: what a speculative-decoding method implements, and how one is found.

A proposer lives in the model runner of every rank. After each step's verification the runner
hands it a :class:`ProposalBatch` (every request of the step, what stayed of its tokens, what it
got) and the proposer returns the draft tokens of the requests asked for. The scheduler schedules
them with the request's next step (``SchedulerOutput.scheduled_spec_decode_tokens``).

Methods are plugins: ``pagedlm_register_spec_proposers(register)`` maps a method name to a
``"module:Class"`` subclass of :class:`SpecProposer`; the built-in ``ngram`` and ``draft_model``
are registered through the same hook (``plugins/core_plugin.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pagedlm.core.spec_decode.config import SpeculativeConfig
    from pagedlm.core.worker.input_batch import StepInputs


@dataclass
class ProposalBatch:
    """One verified step, per batch index ``b`` of ``step.req_ids`` (``B`` requests).

    NOTE: ``token_ids[rows[b], :num_tokens[b]]`` is request ``b``'s verified token history, this
    step's new tokens included (the runner writes them ahead of the scheduler sending them back).
    """

    step: StepInputs
    #: ``[max_num_reqs, max_model_len]`` the runner's token table (read only)
    token_ids: np.ndarray
    rows: np.ndarray  # [B]
    #: ``[B]`` tokens of the request known after this step (history + new tokens)
    num_tokens: np.ndarray
    #: ``[B]`` tokens of this step whose K/V stay: scheduled minus rejected drafts
    num_verified: np.ndarray
    #: ``[B]`` new tokens this step gave the request (0 for a prefill chunk short of the prompt's end)
    num_new_tokens: np.ndarray
    #: ``[B]`` drafts wanted for the request's next step (0: none)
    max_drafts: np.ndarray


class SpecProposer:
    """Base class of a speculative-decoding method (one instance per model runner).

    ``runner`` is the :class:`~pagedlm.core.worker.model_runner.ModelRunner`; a proposer may read
    its device, dtype, attention backend, metadata builder, KV-cache groups and input batch.
    Methods without a model of their own (n-gram) implement only :meth:`propose`.
    """

    #: whether :meth:`propose` must see every step (a method with its own KV cache follows the
    #: target's tokens). Methods that need not run with async scheduling: steps that get no
    #: drafts (``disable_by_batch_size``) are then scheduled asynchronously and not proposed for.
    needs_every_step: bool = True

    def __init__(self, *, speculative_config: SpeculativeConfig, runner: Any) -> None:
        self.speculative_config = speculative_config
        self.runner = runner

    def load_model(self) -> None:
        """Load what the method needs (after the target model is loaded)."""

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV-cache block id costs the method (its own cache tensors), 0 by default."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the method's cache tensors for ``num_blocks`` block ids (the target's block ids)."""

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        """Draft tokens per batch index, at most ``batch.max_drafts[b]`` each (``[]``: none).
        Called after every step that ran a forward pass, also when nothing is wanted (a method with
        its own KV cache follows the target's tokens then)."""
        raise NotImplementedError


def get_proposer_cls(method: str) -> type[SpecProposer]:
    """The registered proposer class of ``method`` (``ValueError`` naming the registered ones)."""
    from pagedlm.core.plugins import get_plugins, resolve_class_path

    registered = get_plugins().spec_proposers()
    if method not in registered:
        raise ValueError(f"speculative_config.method={method!r} is not a registered proposer; registered: "
                         f"{sorted(registered)} (plugins add more through pagedlm_register_spec_proposers)")
    cls = resolve_class_path(registered[method])
    if not (isinstance(cls, type) and issubclass(cls, SpecProposer)):
        raise ValueError(f"proposer {method!r} ({registered[method]}) is not a SpecProposer subclass")
    return cls
