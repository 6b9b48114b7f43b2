"""Incremental detokenization and stop-string matching for one sequence."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# How many prompt tokens to decode along with the first output tokens, so that the first
# output token's leading space (or byte-fallback join) comes out as in a full decode.
_PROMPT_CONTEXT_TOKENS = 5

#: token ids -> text
Decode = Callable[[list[int]], str]


def make_decode(tokenizer: Any, skip_special_tokens: bool) -> Decode:
    """``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`` as a
    function of the ids, as directly as the tokenizer allows.

    A fast HF tokenizer whose decoding is transformers' own is decoded by its backend
    ``tokenizers.Tokenizer``: the same text without transformers' Python around each call
    (about 2.5x faster per call, and detokenization decodes every token of every request).
    Any other tokenizer (or one whose class changes decoding) goes through ``decode``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _decodes_like_its_backend(tokenizer):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    return decode


def _decodes_like_its_backend(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode(ids, clean_up_tokenization_spaces=False)`` is exactly
    ``tokenizer.backend_tokenizer.decode(ids)``: transformers' fast tokenizer classes, with
    neither ``decode`` nor ``_decode`` overridden."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    cls = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast)
            and getattr(cls, "_decode", None) is PreTrainedTokenizerFast._decode
            and getattr(cls, "decode", None) in (PreTrainedTokenizerBase.decode, PreTrainedTokenizerFast.decode))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    The text of the new tokens is the difference between decoding a short window that ends at
    the new tokens and the same window without them; the window slides forward once the text it
    yields is complete (no trailing U+FFFD from a half-decoded multi-byte character). Each token
    costs one decode of the window (plus one of the new window's head when it slides), whatever
    the length of the sequence. ``token_texts`` (a dict shared by every sequence of one decode
    function) remembers the text of single tokens: a head of one token, the common case once
    every token yields text, is then decoded once per distinct token instead of once per step.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, decode: Decode | None = None,
                 token_texts: dict[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._decode = decode or make_decode(tokenizer, skip_special_tokens)
        #: token id -> decode([token id]), shared by the sequences decoded the same way
        self._token_texts: dict[int, str] = {} if token_texts is None else token_texts
        #: the window: the tokens of the last piece of text (``window[:read]``, whose decoded text
        #: is ``_prefix_text``) followed by the tokens that have not produced text yet
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._prefix_text: str | None = None  # decoded when first needed
        self.text = ""
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string that matched (text is then truncated) or None."""
        decode, window = self._decode, self._window
        pieces = []
        for token_id in new_token_ids:
            window.append(token_id)
            prefix_text = self._prefix_text
            if prefix_text is None:
                prefix_text = self._prefix_text = self._head_text()
            new_text = decode(window)
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                pieces.append(new_text[len(prefix_text) :])
                # Slide: the tokens that produced this piece start the next window.
                del window[: self._read]
                self._read = len(window)
                self._prefix_text = None
        if not pieces:
            return None
        start_len = len(self.text)
        self._append(pieces[0] if len(pieces) == 1 else "".join(pieces))
        if not self.stop:
            return None
        return self._check_stop_strings(start_len)

    def _head_text(self) -> str:
        """The text of ``window[:read]`` (the tokens of the last piece)."""
        if self._read != 1:
            return self._decode(self._window[: self._read])
        token_id = self._window[0]
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decode([token_id])
        return text

    def _append(self, piece: str) -> None:
        # NOTE: the attribute lets go of the text first, so that ``+=`` on the only reference
        # extends it in place (CPython) instead of copying the whole text for every token.
        text = self.text
        self.text = ""
        text += piece
        self.text = text

    def flush(self) -> None:
        """At the end of the sequence: emit text held back for an incomplete character."""
        window = self._window
        if self._read < len(window):
            prefix_text = self._prefix_text
            if prefix_text is None:
                prefix_text = self._head_text()
            new_text = self._decode(window)
            self._append(new_text[len(prefix_text) :])
            window.clear()
            self._read = 0
            self._prefix_text = ""

    def _check_stop_strings(self, start_len: int) -> str | None:
        # Only text that could contain a stop string not seen before needs searching.
        search_from = max(0, start_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.include_stop_str_in_output else self.text[:idx]
        return stop
