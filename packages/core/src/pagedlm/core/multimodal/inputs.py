"""What a multimodal prompt becomes: token ids with placeholder runs, one feature per item."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MultiModalFeature:
    """One item (an image) of a prompt, as the engine core and the workers see it.

    ``offset``/``length``: the item's placeholder tokens are ``prompt_token_ids[offset:offset +
    length]``; the encoder's output for the item has ``length`` rows, one per placeholder.
    ``identifier`` is the item's content hash: the encoder cache and the prefix-cache block hashes
    key on it. ``data`` holds the CPU tensors the model's encoder takes (``pixel_values
    [1, 3, H, W]``).
    """

    modality: str
    identifier: str
    offset: int
    length: int
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_extra_keys(features: list[MultiModalFeature], start: int, end: int) -> bytes:
    """The identifiers of the items whose placeholders overlap tokens ``[start, end)``, joined:
    what a prefix-cache block hash covers beyond its token ids (the placeholder ids of two
    different images are equal). ``features`` are in offset order."""
    keys = [f.identifier for f in features if f.offset < end and f.end > start]
    return "|".join(keys).encode() if keys else b""
