"""``<think>...</think>`` reasoning parsers: DeepSeek-R1 and Qwen3 styles.

DeepSeek-R1's chat template opens ``<think>`` in the prompt, so the output is ``thinking</think>
answer`` (without ``</think>`` yet, everything is thinking). Qwen3 writes both tags itself
(without a ``<think>`` in the output, everything is answer, as with thinking disabled).
"""

from __future__ import annotations

from typing import Any

from pagedlm.core.reasoning.parser import ReasoningParser


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkReasoningParser(ReasoningParser):
    start_tag = "<think>"
    end_tag = "</think>"
    #: the prompt opens the thinking (DeepSeek-R1's template); else the model writes start_tag
    opened_by_prompt = False

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (self.start_tag, self.end_tag) if tag not in vocab]
        if missing:
            raise ValueError(f"reasoning parser {type(self).__name__} needs the tokens {missing} in the tokenizer's "
                             "vocabulary (this model does not write its thinking in those tags)")
        self.start_id = vocab[self.start_tag]
        self.end_id = vocab[self.end_tag]

    def split(self, text: str, *, final: bool = True) -> tuple[str | None, str | None]:
        start = text.find(self.start_tag)
        if start < 0 and not self.opened_by_prompt:
            if not final and self.start_tag.startswith(text.lstrip()):
                return None, None  # could still become "<think>"
            return None, text or None
        body = text[start + len(self.start_tag):] if start >= 0 else text
        end = body.find(self.end_tag)
        if end < 0:
            if not final:
                body = body[: len(body) - _held_back(body, self.end_tag)]
            return body, None
        content = body[end + len(self.end_tag):]
        return body[:end], content or None

    def is_reasoning_end(self, prompt_token_ids: list[int]) -> bool:
        ids = prompt_token_ids
        last_start = max((i for i, t in enumerate(ids) if t == self.start_id), default=-1)
        last_end = max((i for i, t in enumerate(ids) if t == self.end_id), default=-1)
        return last_end > last_start

    def reasoning_end_index(self, token_ids: list[int]) -> int | None:
        for i, t in enumerate(token_ids):
            if t == self.end_id:
                return i
        return None


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    opened_by_prompt = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    pass
