"""Logits processors for tests and examples (vLLM ships ``DummyLogitsProcessor`` in
``vllm.test_utils``; these are importable by name in every worker process:
``LLM(logits_processors=["pagedlm.core.testing.logits_processors:DummyLogitsProcessor"])``)."""

from __future__ import annotations

from typing import Any

import torch

from pagedlm.core.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    RequestLogitsProcessor,
    process_dict_updates,
)
from pagedlm.core.sampling_params import SamplingParams


class DummyLogitsProcessor(LogitsProcessor):
    """Masks every token but ``extra_args["target_token"]`` in the rows of requests that set it."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, int] = {}
        #: every BatchUpdate received (tests read them; None entries are steps without changes)
        self.updates: list[BatchUpdate | None] = []

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or target < 0):
            raise ValueError(f"extra_args['target_token']={target!r} must be a token id")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _prompt, _output: (params.extra_args or {}).get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long, device=logits.device)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


class TopOneLogitsProcessor(LogitsProcessor):
    """Argmax-invariant: keeps only each row's largest logit in the rows of requests with
    ``extra_args["top_one"]``, so their random sampling draws the greedy token."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, bool] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update,
                             lambda params, _p, _o: True if (params.extra_args or {}).get("top_one") else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = torch.tensor(list(self.rows), dtype=torch.long, device=logits.device)
        sub = logits[rows]
        top = sub.argmax(dim=-1, keepdim=True)
        masked = torch.full_like(sub, float("-inf")).scatter_(1, top, sub.gather(1, top))
        logits[rows] = masked
        return logits


class _RepeatLast:
    """Per-request: forces the last output token again (the first output is left alone)."""

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if output_ids:
            value = logits[output_ids[-1]].item()
            logits[:] = float("-inf")
            logits[output_ids[-1]] = value
        return logits


class _ForcePromptToken:
    """Per-request, with the prompt: forces the prompt's first token every step."""

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[prompt_ids[0]] = 0.0
        return out  # a new row: the adapter writes it back


class RepeatAdapterLogitsProcessor(AdapterLogitsProcessor):
    """Wraps per-request functions: ``extra_args["repeat"]`` repeats the first output token;
    ``extra_args["echo_first"]`` emits the prompt's first token again and again."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        extra = params.extra_args or {}
        if extra.get("repeat"):
            return _RepeatLast()
        if extra.get("echo_first"):
            return _ForcePromptToken()
        return None


class _ForceTokens:
    """Per-request: output ``token_ids`` one after the other, then ``end_id`` (None: then the
    model's own tokens)."""

    def __init__(self, token_ids: list[int], end_id: int | None) -> None:
        self.token_ids = token_ids
        self.end_id = end_id

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        position = len(output_ids)
        forced = self.token_ids[position] if position < len(self.token_ids) else self.end_id
        if forced is None:
            return logits
        logits[:] = float("-inf")
        logits[forced] = 0.0
        return logits


class ForcedTextLogitsProcessor(AdapterLogitsProcessor):
    """A fake model's output: ``extra_args["forced_text"]`` (``vllm_xargs`` on the server) is written
    token by token (as the model's tokenizer encodes it), then the end-of-sequence token;
    ``extra_args["forced_prefix"]`` is written and the model goes on by itself. Tests of output
    parsers (tool calls, reasoning) use it to make a random model write a given text."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        from pagedlm.core.engine.tokenizer import get_tokenizer

        self.tokenizer = get_tokenizer(vllm_config.model_config.tokenizer)

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        extra = params.extra_args or {}
        text = extra.get("forced_text", extra.get("forced_prefix"))
        if text is None:
            return None
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return _ForceTokens(list(ids), int(self.tokenizer.eos_token_id) if "forced_text" in extra else None)
