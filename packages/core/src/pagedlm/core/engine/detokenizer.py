"""Incremental detokenization and stop-string matching for one sequence."""

from __future__ import annotations

from typing import Any

# How many prompt tokens to decode along with the first output tokens, so that the first
# output token's leading space (or byte-fallback join) comes out as in a full decode.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    The text of the new tokens is the difference between decoding a short window that ends at
    the new tokens and the same window without them; the window slides forward once the text it
    yields is complete (no trailing U+FFFD from a half-decoded multi-byte character).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string that matched (text is then truncated) or None."""
        start_len = len(self.text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                self.text += new_text[len(prefix_text) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
        if not self.stop or len(self.text) == start_len:
            return None
        return self._check_stop_strings(start_len)

    def flush(self) -> None:
        """At the end of the sequence: emit text held back for an incomplete character."""
        if self.read_offset < len(self.token_ids):
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset = len(self.token_ids)

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
