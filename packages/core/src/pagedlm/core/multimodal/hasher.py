"""Content hashes of multimodal items: equal items (pixel for pixel) share encoder outputs and
prefix-cache blocks; different ones never do."""

from __future__ import annotations

import hashlib
from typing import Any


def hash_image(image: Any) -> str:
    """SHA-256 of a PIL image's mode, size and pixels (hex)."""
    hasher = hashlib.sha256(f"image {image.mode} {image.size}".encode())
    hasher.update(image.tobytes())
    return hasher.hexdigest()
