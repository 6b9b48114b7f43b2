"""Tokenizer loading (through transformers) and the helpers the front end needs."""

from __future__ import annotations

from typing import Any

from pagedlm.core.logger import init_logger

logger = init_logger(__name__)


def get_tokenizer(path: str, *, trust_remote_code: bool = False, revision: str | None = None,
                  architectures: list[str] | None = None) -> Any:
    """The tokenizer of an HF directory, or of a ``.gguf`` file (built from its metadata, cached).

    When it has no chat template and the model class of ``architectures`` declares a
    ``default_chat_template`` (its family's format, e.g. Gemma's), that one is set, and logged.
    """
    from transformers import AutoTokenizer

    from pagedlm.core.model_loader.gguf_loader import is_gguf_file

    if is_gguf_file(path):
        from pagedlm.core.model_loader.gguf_tokenizer import load_gguf_tokenizer

        tokenizer = load_gguf_tokenizer(path)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"could not load a tokenizer from {path!r} ({e}); pass tokenizer=DIR, or "
                "skip_tokenizer_init=True to run token-id prompts only"
            ) from e
    if architectures and not getattr(tokenizer, "chat_template", None):
        _use_family_chat_template(tokenizer, architectures)
    return tokenizer


def _use_family_chat_template(tokenizer: Any, architectures: list[str]) -> None:
    from pagedlm.core.model_loader.registry import get_model_class

    try:
        model_cls = get_model_class(architectures)
    except ValueError:
        return  # no model class: the engine reports that itself
    template = getattr(model_cls, "default_chat_template", None)
    if template:
        logger.info("the tokenizer has no chat template; using %s's default (its family's chat format)",
                    model_cls.__name__)
        tokenizer.chat_template = template
