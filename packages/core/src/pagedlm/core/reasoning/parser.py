"""The reasoning-parser interface and its lookup by name."""

from __future__ import annotations

from typing import Any


class ReasoningParser:
    """Splits a reasoning model's output into (reasoning, content), whole or while it streams,
    and says in token ids where the thinking ends (so structured outputs can start there).

    Built as ``Cls(tokenizer)``. Subclasses implement :meth:`split`, :meth:`is_reasoning_end`
    and :meth:`reasoning_end_index`.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def split(self, text: str, *, final: bool = True) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of the output so far (None: none of that part). With
        ``final=False`` (a stream), text that may still turn into a tag is withheld from both, so
        that each part only grows as text arrives."""
        raise NotImplementedError

    def is_reasoning_end(self, prompt_token_ids: list[int]) -> bool:
        """Whether the thinking is over before the output starts (e.g. the chat template closed
        it: thinking disabled)."""
        raise NotImplementedError

    def reasoning_end_index(self, token_ids: list[int]) -> int | None:
        """Index in ``token_ids`` (newly generated tokens) of the token that ends the thinking."""
        raise NotImplementedError


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The class registered as ``name``; ``ValueError`` listing the names otherwise."""
    from pagedlm.core.plugins import get_plugins, resolve_class_path

    parsers = get_plugins().reasoning_parsers()
    if name not in parsers:
        raise ValueError(f"reasoning_parser={name!r} is not registered; registered: {', '.join(sorted(parsers))}")
    return resolve_class_path(parsers[name])
