"""The KV-connector interface (vLLM V1's ``KVConnectorBase_V1`` shape).

Scheduler half (engine core), per step:
  ``get_num_new_matched_tokens(request, num_computed_tokens)`` -> ``(n, load_async)``: how many
  tokens after the local prefix-cache hit the connector can supply. ``load_async=False``: they
  count as computed at once and the worker loads them before this step's forward
  (``start_load_kv``); ``True``: the request waits, its blocks allocated, until the worker
  reports the load done (``get_finished``), then runs from the last block that loaded.
  ``update_state_after_alloc(request, blocks, num_external_tokens)``: the blocks are allocated.
  ``build_connector_meta(scheduler_output)`` -> the metadata the workers get with the step.
  ``update_connector_output(output)``: what the workers reported back.
  ``request_finished(request, block_ids)`` -> ``(delay_free, kv_transfer_params)``: with
  ``delay_free`` the blocks stay allocated until the workers report the request's KV sent.

Worker half (each worker), per step: ``bind_connector_metadata``, ``start_load_kv`` (before the
forward), ``wait_for_layer_load(layer)`` and ``save_kv_layer(layer, kv, metadata)`` (called by
each attention layer, around its attention, in eager forwards), ``wait_for_save`` (after the
forward), ``get_finished(finished_req_ids)`` -> ``(done sending, done receiving)``,
``get_block_ids_with_load_errors``, ``clear_connector_metadata``.

NOTE: a forward replayed from a device graph runs no Python, so the per-layer hooks do not run
there; pagedlm's connectors do all their work in ``start_load_kv`` / ``wait_for_save``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedlm.core.config import VllmConfig
    from pagedlm.core.distributed.kv_transfer.config import KVTransferConfig
    from pagedlm.core.request import Request
    from pagedlm.core.sched.output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What a connector's scheduler half sends its worker halves with one step."""


@dataclass
class KVCacheInfo:
    """The paged KV cache as a connector sees it (vLLM passes its ``KVCacheConfig`` here).

    ``bytes_per_block`` counts one block id on this rank (every layer's K and V)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    #: worker half only: the dimension of each layer's cache tensor that indexes blocks
    block_dim: int | None = None


@dataclass
class KVConnectorOutput:
    """What the worker halves report after a step (``ModelRunnerOutput.kv_connector_output``)."""

    #: requests whose delayed blocks may be freed now (their KV is saved or sent)
    finished_sending: set[str] = field(default_factory=set)
    #: requests whose asynchronous load is over (successful or not)
    finished_recving: set[str] = field(default_factory=set)
    #: blocks that did not load (their requests recompute from the first of them)
    invalid_block_ids: set[int] = field(default_factory=set)
    #: request id -> why its load failed for good (the request fails with this reason)
    failed_recving: dict[str, str] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids or self.failed_recving)


class KVConnectorBase_V1(ABC):
    """Base class of KV connectors; one instance per role per process."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheInfo) -> None:
        if vllm_config.kv_transfer_config is None:
            raise ValueError("a KV connector needs vllm_config.kv_transfer_config")
        self._vllm_config = vllm_config
        self._kv_transfer_config: KVTransferConfig = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # -- worker half --------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's metadata, before the forward."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """After the step."""
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata is bound (outside a step)"
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The KV cache tensors, by layer name, once allocated (shapes: the attention backend's)."""

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start (or do) the step's loads into the paged KV cache, before the forward."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s loads are in the cache (layer-by-layer loading)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving what this step wrote into ``kv_layer`` (the layer's cache tensor)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until the step's saves no longer read the cache (it may be overwritten next step)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests done sending, requests done receiving) since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        return set()

    def get_failed_loads(self) -> dict[str, str]:
        """Request id -> reason, for loads that cannot succeed (pagedlm's: a peer that is gone)."""
        return {}

    def shutdown(self) -> None:
        """Stop threads, close sockets."""

    # -- scheduler half -----------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens after ``num_computed_tokens`` (the local hit) the connector can supply, and
        whether they load asynchronously. May be called again for a request that did not fit."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """``blocks`` (per KV-cache group) are allocated for the request, the first
        ``num_computed_tokens`` of it local hits, the next ``num_external_tokens`` to load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        """The metadata for this step's workers (None: nothing to do); resets the step's state."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the workers reported after a step."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request finished with these blocks (KV-cache group 0). Returns (keep the blocks
        until the workers report the request in ``finished_sending``, kv_transfer_params for
        the request's output)."""
        return False, None

    def has_pending_work(self) -> bool:
        """Whether steps must keep running although no request is scheduled (loads or sends in
        flight); pagedlm's, so the engine loop does not idle while a transfer is pending."""
        return False
