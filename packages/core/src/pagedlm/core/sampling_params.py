"""``SamplingParams``: how to sample one request (vLLM-compatible names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from pagedlm.core.structured_output.params import StructuredOutputsParams
from pagedlm.core.text import utf8_problem

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries all tokens/text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # only the finished output is returned


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    #: sample only among these token ids (vLLM's whitelist; logprobs still describe the model)
    allowed_token_ids: list[int] | None = None
    #: with ``logprobs``: return the logprobs of these ids at each generated position, in place of
    #: the top ``logprobs`` (vLLM's; for scoring a fixed label set that may rank low)
    logprob_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: custom arguments for custom logits processors (vLLM's ``extra_args``; ``vllm_xargs`` on
    #: the server); pagedlm itself reads none of them
    extra_args: dict[str, Any] | None = None
    #: grammar-constrained output (JSON Schema, regex, choice, EBNF grammar); see
    #: ``pagedlm.core.structured_output``
    structured_outputs: StructuredOutputsParams | None = None
    #: vLLM's older name of ``structured_outputs`` (moved there by ``__post_init__``)
    guided_decoding: StructuredOutputsParams | None = None
    # Filled by the engine: eos ids of the model, applied unless ignore_eos.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        # NOTE: an empty list means "not set" for both, as in vLLM
        self.allowed_token_ids = list(self.allowed_token_ids) if self.allowed_token_ids else None
        self.logprob_token_ids = list(self.logprob_token_ids) if self.logprob_token_ids else None
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("pass structured_outputs or its older name guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if 0 <= self.temperature < _SAMPLING_EPS:
            # Greedy: make the other knobs inert, as vLLM does.
            self.temperature = 0.0
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid: must be {allowed}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            # NOTE: every range check below is False for NaN, which would slip through them
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "a finite number")
        if self.logit_bias and any(not math.isfinite(float(b)) for b in self.logit_bias.values()):
            raise bad("logit_bias", "a map of token ids to finite numbers")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", "-1 (disabled) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "None or an integer >= 0")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "None or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "None or an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        for s in self.stop:
            if (problem := utf8_problem(s)) is not None:
                raise ValueError(f"stop {problem}")
        for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
            ids = getattr(self, name) or []
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise bad(name, "a list of non-negative token ids")
        if self.logprob_token_ids is not None:
            if self.logprobs is None:
                raise ValueError(f"logprob_token_ids={self.logprob_token_ids!r} needs logprobs set (e.g. logprobs=0): "
                                 "it names which logprobs to return at each generated position")
            if len(set(self.logprob_token_ids)) < len(self.logprob_token_ids):
                raise bad("logprob_token_ids", "a list of distinct token ids")
        if self.extra_args is not None and not (isinstance(self.extra_args, dict)
                                                and all(isinstance(k, str) for k in self.extra_args)):
            raise bad("extra_args", "None or a dict with string keys")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_logprob_columns(self) -> int | None:
        """How many logprobs each generated position returns besides the sampled token's: the
        ``logprob_token_ids`` when given, else the top ``logprobs``; None without logprobs."""
        if self.logprobs is None:
            return None
        return len(self.logprob_token_ids) if self.logprob_token_ids else self.logprobs

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)

    def verify_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids in range."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {})),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("logprob_token_ids", self.logprob_token_ids or [])):
            bad_ids = [t for t in ids if not 0 <= int(t) < vocab_size]
            if bad_ids:
                raise ValueError(f"{name} contains token ids {bad_ids[:5]} outside the vocabulary [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name}={value} exceeds the vocabulary size {vocab_size}")
