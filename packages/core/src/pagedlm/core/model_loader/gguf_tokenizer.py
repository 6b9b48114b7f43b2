"""The tokenizer of a GGUF file, built once from its metadata and cached next to the file.

Gemma 3 files are built by :mod:`gguf_spm_tokenizer` (``tokenizers`` alone: transformers'
conversion of them depends on its release, and some releases get it wrong); other files go through
transformers, which builds a fast tokenizer (vocabulary, merges, special tokens, chat template)
from GGUF metadata. Either takes seconds to tens of seconds for a 262k-token vocabulary. The result is saved with
``save_pretrained`` into ``<file stem>.pagedlm-tokenizer/`` beside the GGUF file (or, where that
directory is not writable, under the pagedlm cache), together with a stamp of the file's size and
mtime and the transformers version; later starts load that directory in well under a second and
rebuild only when the stamp no longer matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from pagedlm.core import envs
from pagedlm.core.logger import init_logger
from pagedlm.core.utils.heap import release_free_heap

logger = init_logger(__name__)

__all__ = ["gguf_tokenizer_cache_dir", "load_gguf_tokenizer"]

_STAMP = "pagedlm-gguf-source.json"
#: bump when the cached layout or its contents change meaning
_FORMAT = 2


def _stamp(path: str) -> dict[str, Any]:
    import transformers

    st = os.stat(path)
    return {"format": _FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "transformers": transformers.__version__}


def _writable_dir(directory: str) -> bool:
    return os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)


def gguf_tokenizer_cache_dir(path: str) -> str:
    """Where the converted tokenizer of ``path`` is (or will be) cached."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    stem = os.path.basename(path)
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    if _writable_dir(parent):
        return os.path.join(parent, f"{stem}.pagedlm-tokenizer")
    digest = hashlib.sha256(path.encode()).hexdigest()[:16]
    return os.path.join(envs.cache_root(), "gguf-tokenizers", f"{stem}-{digest}")


def _cached_is_valid(cache_dir: str, path: str) -> bool:
    try:
        with open(os.path.join(cache_dir, _STAMP)) as f:
            return json.load(f) == _stamp(path)
    except (OSError, ValueError):
        return False


def load_gguf_tokenizer(path: str, **kwargs: Any) -> Any:
    """See :func:`_load_gguf_tokenizer`; the heap the loading freed goes back to the OS."""
    try:
        return _load_gguf_tokenizer(path, **kwargs)
    finally:
        release_free_heap()


def _load_gguf_tokenizer(path: str, **kwargs: Any) -> Any:
    """A transformers fast tokenizer for the GGUF file at ``path`` (cached; see the module doc).

    ``kwargs`` go to ``AutoTokenizer.from_pretrained``. Raises ``ValueError`` naming the file if
    transformers cannot build a tokenizer from its metadata.
    """
    from transformers import AutoTokenizer

    cache_dir = gguf_tokenizer_cache_dir(path)
    if _cached_is_valid(cache_dir, path):
        return AutoTokenizer.from_pretrained(cache_dir, **kwargs)
    logger.info("converting the tokenizer of %s (once; cached in %s)", path, cache_dir)
    try:
        tokenizer = _convert(path, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: could not build a tokenizer from the GGUF metadata ({type(e).__name__}: {e})") from e
    try:
        _save(tokenizer, cache_dir, path)
    except OSError as e:  # a read-only cache must not stop the model from running
        logger.warning("could not cache the tokenizer of %s in %s: %s", path, cache_dir, e)
    return tokenizer


def _convert(path: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    from pagedlm.core.model_loader.gguf_reader import read_gguf
    from pagedlm.core.model_loader.gguf_spm_tokenizer import build_gemma_tokenizer, uses_builtin_builder

    with read_gguf(path) as gguf:
        if uses_builtin_builder(gguf.metadata):
            return build_gemma_tokenizer(gguf.metadata)
    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
                                         **kwargs)


def _save(tokenizer: Any, cache_dir: str, path: str) -> None:
    """Write to a temporary sibling and rename, so a concurrent reader never sees half a cache."""
    os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(cache_dir))
    try:
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, _STAMP), "w") as f:
            json.dump(_stamp(path), f)
        if os.path.isdir(cache_dir):
            shutil.rmtree(cache_dir, ignore_errors=True)
        os.replace(tmp, cache_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
