"""Attention: the backend interface and the layer facade models use."""

from pagedlm.core.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedlm.core.attention.layer import Attention

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "CommonAttentionMetadata",
]
