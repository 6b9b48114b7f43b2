"""Checks on text given by users before it reaches a tokenizer or a stop-string matcher."""

from __future__ import annotations


def utf8_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (a lone UTF-16 surrogate), or None if it can.

    JSON's ``"\\ud800"`` escapes and Python strings may hold surrogates that are not part of a
    pair; tokenizers refuse them with a TypeError and encoders with a UnicodeEncodeError, so they
    are named here as bad input instead.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"contains a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}) at character {e.start}, "
                "which is not valid Unicode text and cannot be encoded as UTF-8")
    return None
