"""The attention-backend interface: Backend, Metadata, MetadataBuilder, Impl.

A backend is four pieces (one file per backend in its package):

- ``XBackend``: static description (name, KV-cache shape, supported head sizes and dtypes) and
  the classes of the other three pieces.
- ``XMetadata``: a dataclass of flat tensors describing one step's batch.
- ``XMetadataBuilder``: builds ``XMetadata`` from :class:`CommonAttentionMetadata`.
- ``XImpl``: ``forward(q, k, v, kv_cache, metadata)`` for one layer.

Tokens of a step are laid out flat: the ``num_reqs`` requests' new tokens are concatenated, so
request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``. Its context (cached
tokens plus the new ones) has length ``seq_lens[i]``; the new tokens are the last
``query_len`` positions of that context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch


@dataclass
class CommonAttentionMetadata:
    """Backend-independent description of one step, built by the model runner.

    Shapes: ``B = num_reqs``, ``T = num_actual_tokens``.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # [B + 1] int32, host
    seq_lens: torch.Tensor  # [B] int32, device: context length incl. this step's tokens
    seq_lens_cpu: torch.Tensor  # [B] int32, host
    num_computed_tokens_cpu: torch.Tensor  # [B] int32, host: context already in the cache
    block_table: torch.Tensor  # [B, max_blocks_per_req] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device: flat cache slot of each new token
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    #: ``[B]`` int32, device: the requests by descending ``seq_len``, for backends that balance
    #: decode work across the GPU (longest first); ``None`` when the runner does not provide it
    decode_order: torch.Tensor | None = None
    #: ``[B]`` lists of ``(start, end)`` absolute positions whose tokens also attend to each other
    #: forward (the images of a model with bidirectional attention over an image, Gemma 3), for
    #: backends with ``supports_bidirectional_spans``; None when the step has none
    bidirectional_spans: list[list[tuple[int, int]]] | None = None


M = TypeVar("M")


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns :class:`CommonAttentionMetadata` into a backend's own metadata."""

    def __init__(self, *, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M: ...

    def bind_model(self, *, num_kv_heads: int, head_size: int) -> None:
        """Called once the model is built, with its smallest per-rank kv head count and its head
        size (a builder that sizes work by them, as split-KV does, keeps them)."""

    def precompile_metadata(
        self, batch_sizes: list[int], prefill_tokens: int, stage: Callable[[int, int], CommonAttentionMetadata]
    ) -> Iterator[tuple[int, M]]:
        """The metadata of every kernel variant this backend can launch, for a runner that
        compiles kernels before it serves: ``(num_tokens, metadata)`` pairs, each to be run
        through one forward. ``stage(num_tokens, num_reqs)`` stages an all-padding batch (decode
        when the two are equal) and returns its common metadata; ``batch_sizes`` are the decode
        batch sizes the runner will see. None by default (nothing to compile ahead)."""
        return iter(())


class AttentionImpl(ABC, Generic[M]):
    """Attention of one layer over the paged KV cache."""

    def __init__(
        self,
        *,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    #: the KV cache's ``kv_cache_dtype`` and, for ``"fp8"``, the layer's per-tensor scales
    #: (``[1]`` float32; stored value = value / scale), set by the ``Attention`` layer after construction
    kv_cache_dtype: str = "auto"
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    #: whether :meth:`forward` takes ``rotary=`` (a fusable
    #: :class:`~pagedlm.core.layers.rotary.PendingRotary`, with unrotated ``query``/``key``) and
    #: applies it while writing K/V; the ``Attention`` layer passes one only then, and only with
    #: metadata (never in the profiling run)
    fuses_rotary: bool = False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: M,
    ) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache`` and attend.

        Args:
            query: ``[T, num_heads, head_size]``
            key, value: ``[T, num_kv_heads, head_size]``
            kv_cache: the backend's cache tensor for this layer (shape from
                :meth:`AttentionBackend.get_kv_cache_shape`)
            metadata: the backend's metadata for this step
        Returns:
            ``[T, num_heads, head_size]``
        """


class AttentionBackend(ABC):
    """Static description of a backend and the classes of its pieces."""

    name: ClassVar[str]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any
    #: platform names (``device=``) whose runner can drive this backend; None: any
    supported_devices: ClassVar[tuple[str, ...] | None] = None
    #: KV-cache block sizes must be a multiple of this (a kernel's page size)
    block_size_multiple: ClassVar[int] = 1
    #: ``kv_cache_dtype`` values this backend reads and writes (``"auto"``: the model dtype)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    #: whether a step's launches may be captured in a device graph and replayed (no host syncs,
    #: fixed buffers)
    supports_graphs: ClassVar[bool] = False
    #: whether a graph captured for one mixed batch (prefills, chunks and decodes; token and
    #: request counts padded) replays correctly for any other batch of at most its size: the
    #: kernels take every per-step size from device tensors, none from host ints captured in
    #: the launch (vLLM's "full CUDA graph for any batch" support)
    supports_mixed_graphs: ClassVar[bool] = False
    #: whether it honours ``CommonAttentionMetadata.bidirectional_spans``
    supports_bidirectional_spans: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder[Any]]: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl[Any]]: ...

    @classmethod
    def validate(cls, *, head_size: int, dtype: torch.dtype, block_size: int | None = None) -> None:
        if cls.supported_head_sizes is not None and head_size not in cls.supported_head_sizes:
            raise ValueError(
                f"attention backend {cls.name!r} does not support head_size={head_size}; "
                f"supported: {list(cls.supported_head_sizes)}"
            )
        if dtype not in cls.supported_dtypes:
            raise ValueError(f"attention backend {cls.name!r} does not support dtype={dtype}")
        if block_size is not None and block_size % cls.block_size_multiple:
            raise ValueError(
                f"attention backend {cls.name!r} needs block_size to be a multiple of {cls.block_size_multiple}; "
                f"got block_size={block_size}"
            )
