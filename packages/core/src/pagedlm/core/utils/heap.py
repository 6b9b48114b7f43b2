"""Give freed heap memory back to the operating system (glibc's ``malloc_trim``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["release_free_heap"]


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def release_free_heap() -> None:
    """Return the free pages of the C heap to the OS.

    NOTE: building a 262k-token tokenizer or decoding a GGUF file frees hundreds of MB in small
    blocks that glibc keeps mapped (resident) for reuse; trimming once after such a step keeps the
    process's resident memory to what it holds (~310 MB less after Gemma 3 270M's tokenizer).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
