"""Processor: user prompt + SamplingParams -> validated, tokenized EngineCoreRequest."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pagedlm.core.config import VllmConfig
from pagedlm.core.request import EngineCoreRequest
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.core.text import utf8_problem

#: a string, ``{"prompt": str}``, ``{"prompt_token_ids": [int, ...]}`` or, with
#: ``enable_prompt_embeds``, ``{"prompt_embeds": tensor [T, hidden]}`` (vLLM's prompt types)
PromptType = str | Mapping[str, Any]


def check_priority(priority: object, policy: str) -> None:
    """A request's ``priority``: an integer, and nonzero only under the priority policy (as vLLM)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority={priority!r} must be an integer (lower values are scheduled first)")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority={priority} was given but priority scheduling is not enabled "
                         f"(scheduling_policy={policy!r}); start the engine with scheduling_policy='priority' "
                         "(--scheduling-policy priority) or leave priority at 0")


class Processor:
    def __init__(self, vllm_config: VllmConfig, tokenizer: Any | None) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.max_model_len = vllm_config.max_model_len
        self.scheduling_policy = vllm_config.scheduler_config.policy
        self.vocab_size = self.model_config.vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        from pagedlm.core.sample.logits_processor import configured_logits_processor_classes

        # NOTE: resolved here too (the workers build them), so a bad name fails at start-up and
        # every request's parameters are checked by each processor's validate_params.
        self.logits_processor_classes = configured_logits_processor_classes(self.model_config)
        from pagedlm.core.multimodal.registry import create_processor

        #: a multimodal model's input processor (HF's processors load on first use); None otherwise
        self.mm_processor = create_processor(self.model_config)
        soc = vllm_config.structured_outputs_config
        if soc.backend != "auto":  # a bad name fails at start-up, not with the first request
            from pagedlm.core.structured_output.manager import resolve_backend_class

            resolve_backend_class(soc.backend)
        if soc.reasoning_parser:
            from pagedlm.core.reasoning import get_reasoning_parser

            get_reasoning_parser(soc.reasoning_parser)

    def tokenize_prompt(self, prompt: PromptType, *, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids)."""
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, Mapping) and "prompt_embeds" in prompt:
            raise ValueError("a prompt given as embeddings ({'prompt_embeds': tensor}) has no token ids")
        elif isinstance(prompt, Mapping):
            text = prompt.get("prompt")
            token_ids = prompt.get("prompt_token_ids")
            if text is None and token_ids is None:
                raise ValueError("prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")
        else:
            raise ValueError(
                f"prompt of type {type(prompt).__name__} is not supported: pass a string, "
                "{'prompt': str} or {'prompt_token_ids': [int, ...]}"
            )
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if not text:
                raise ValueError("prompt is empty: it must contain at least one character")
            if (problem := utf8_problem(text)) is not None:
                raise ValueError(f"prompt {problem}")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine runs with skip_tokenizer_init=True")
            token_ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        else:
            if not isinstance(token_ids, (list, tuple)) or (
                    set(map(type, token_ids)) - {int}  # (C speed; the slow check for int subclasses only)
                    and not all(isinstance(t, int) for t in token_ids)):
                raise ValueError("prompt_token_ids must be a list of integers")
            token_ids = list(token_ids)
        return text, token_ids

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        lora_request: Any = None,
        priority: int = 0,
    ) -> tuple[EngineCoreRequest, str | None]:
        """``lora_request`` must have passed the engine's ``LoRARegistry.check``."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        check_priority(priority, self.scheduling_policy)
        embeds = mm_features = None
        if isinstance(prompt, Mapping) and "prompt_embeds" in prompt:
            embeds = self._prompt_embeds(prompt, params)
            text, token_ids = None, [0] * int(embeds.shape[0])  # placeholders: the runner reads the embeddings
        elif isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
            from pagedlm.core.multimodal.prompt import process_multimodal_prompt

            text, token_ids, mm_features = process_multimodal_prompt(self.mm_processor, self.model_config, prompt,
                                                                     add_special_tokens=add_special_tokens)
        else:
            text, token_ids = self.tokenize_prompt(prompt, add_special_tokens=add_special_tokens)
        self.validate(token_ids, params, has_mm_data=mm_features is not None)
        for cls in self.logits_processor_classes:
            cls.validate_params(params)
        params = params.clone()
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.eos_token_ids
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
        if self.tokenizer is None:
            params.detokenize = False
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            prompt_embeds=embeds,
            lora_request=lora_request,
            mm_features=mm_features,
            priority=priority,
        )
        return request, text

    def _prompt_embeds(self, prompt: Mapping[str, Any], params: SamplingParams) -> Any:
        """The ``[T, hidden]`` embeddings of an embeddings prompt, on the CPU in the model dtype."""
        import torch

        from pagedlm.core.platforms import HOST

        if not self.model_config.enable_prompt_embeds:
            raise ValueError("prompt_embeds prompts need LLM(enable_prompt_embeds=True) (--enable-prompt-embeds)")
        if set(prompt) - {"prompt_embeds", "cache_salt"}:
            raise ValueError(f"a prompt_embeds prompt takes no other fields; got {sorted(prompt)}")
        embeds = prompt["prompt_embeds"]
        if not isinstance(embeds, torch.Tensor):
            raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds.squeeze(0)
        hidden = self.model_config.hidden_size
        if embeds.dim() != 2 or embeds.shape[1] != hidden or not embeds.is_floating_point():
            raise ValueError(f"prompt_embeds must be a float tensor of shape [num_tokens, hidden_size={hidden}], "
                             f"got {embeds.dtype} {tuple(embeds.shape)}")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported for prompts given as embeddings (they have no ids)")
        dtype = self.model_config.dtype if isinstance(self.model_config.dtype, torch.dtype) else embeds.dtype
        return embeds.detach().to(device=HOST, dtype=dtype).contiguous()

    def validate(self, token_ids: list[int], params: SamplingParams, *, has_mm_data: bool = False) -> None:
        num = len(token_ids)
        if self.mm_processor is not None and not has_mm_data:
            self.mm_processor.check_text_only(token_ids)
        if num == 0:
            raise ValueError("prompt is empty: it must contain at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if num >= self.max_model_len:
            raise ValueError(
                f"prompt is {num} tokens long but max_model_len={self.max_model_len} leaves no room for "
                f"output; the prompt must be at most {self.max_model_len - 1} tokens"
            )
        if params.max_tokens is not None and num + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num} tokens) + max_tokens ({params.max_tokens}) = {num + params.max_tokens} exceeds "
                f"max_model_len={self.max_model_len}; lower max_tokens to at most {self.max_model_len - num}"
            )
        params.verify_for_model(self.vocab_size)
        if params.structured_outputs is not None:
            from pagedlm.core.structured_output.manager import validate_structured_outputs

            validate_structured_outputs(self.vllm_config, params.structured_outputs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init=True")
