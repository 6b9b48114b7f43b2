"""Tokenizer loading (through transformers) and the helpers the front end needs."""

from __future__ import annotations

from typing import Any


def get_tokenizer(path: str, *, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """The tokenizer of an HF directory, or of a ``.gguf`` file (built from its metadata, cached)."""
    from transformers import AutoTokenizer

    from pagedlm.core.model_loader.gguf_loader import is_gguf_file

    if is_gguf_file(path):
        from pagedlm.core.model_loader.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({e}); pass tokenizer=DIR, or "
            "skip_tokenizer_init=True to run token-id prompts only"
        ) from e
