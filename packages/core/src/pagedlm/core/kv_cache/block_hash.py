"""Chained content hashes of full KV-cache blocks (the keys of the prefix cache).

The hash of block ``i`` covers the hash of block ``i - 1`` and the token ids of block ``i``, so
two blocks hash equal only if the whole token prefix up to and including them is equal — which is
exactly when their K/V contents are equal (K/V at a position depend on every earlier token).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedlm.core.multimodal.inputs import block_extra_keys

if TYPE_CHECKING:
    from pagedlm.core.request import Request

# The parent of a sequence's first block. Using a digest-sized seed instead of an empty prefix
# makes every hashed message the same shape (parent digest + tokens), so a first block can never
# collide with a later block by having its tokens spell out some parent digest.
_ROOT_PARENT_HASH = b"\x00" * hashlib.sha256().digest_size


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """Return the chained hash of one block.

    ``parent_hash`` is the previous block's hash, or None for a sequence's first block.
    Token ids are packed as int64 (machine byte order — hashes never leave the process).
    ``extra_keys``: what else the block's K/V depend on (the hashes of the images whose
    placeholders it holds).
    """
    hasher = hashlib.sha256(_ROOT_PARENT_HASH if parent_hash is None else parent_hash)
    hasher.update(array("q", token_ids).tobytes())
    if extra_keys:
        hasher.update(extra_keys)
    return hasher.digest()


def update_block_hashes(request: Request, block_size: int) -> None:
    """Extend ``request.block_hashes`` to cover every full block of ``request.all_token_ids``.

    Incremental: hashes already present are trusted and never recomputed, so calling this every
    step costs only the blocks that became full since the last call.
    """
    block_hashes = request.block_hashes
    token_ids = request.all_token_ids
    num_full_blocks = len(token_ids) // block_size
    num_hashed_blocks = len(block_hashes)
    if num_hashed_blocks >= num_full_blocks:
        return
    # NOTE: a prompt given as embeddings seeds the chain with their digest (placeholder ids).
    parent_hash = block_hashes[-1] if block_hashes else getattr(request, "block_hash_seed", None)
    mm_features = getattr(request, "mm_features", None)
    for block_idx in range(num_hashed_blocks, num_full_blocks):
        start = block_idx * block_size
        extra = block_extra_keys(mm_features, start, start + block_size) if mm_features else b""
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size], extra)
        block_hashes.append(parent_hash)
