"""Content hashes of multimodal items: equal items (pixel for pixel) share encoder outputs and
prefix-cache blocks; different ones never do."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def hash_image(image: Any) -> str:
    """SHA-256 of a PIL image's mode, size and pixels (hex)."""
    hasher = hashlib.sha256(f"image {image.mode} {image.size}".encode())
    hasher.update(image.tobytes())
    return hasher.hexdigest()


def hash_tensor(tensor: Any) -> str:
    """SHA-256 of a CPU tensor's dtype, shape and bytes (hex): precomputed item embeddings."""
    hasher = hashlib.sha256(f"tensor {tensor.dtype} {tuple(tensor.shape)}".encode())
    hasher.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()
