"""``EngineClient``: what a server needs from an engine, and all it may use.

``AsyncLLM`` implements it. The HTTP server types against this protocol only, so any engine
with these members (another front end, a test double) can serve, and the server never reaches
into the engine's parts (processor, config objects, core client).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pagedlm.core.config import ModelConfig, VllmConfig
    from pagedlm.core.engine.async_client import EngineDeadError
    from pagedlm.core.engine.processor import PromptType
    from pagedlm.core.metrics import EngineStatsSnapshot
    from pagedlm.core.outputs import PoolingRequestOutput, RequestOutput
    from pagedlm.core.pooling_params import PoolingParams
    from pagedlm.core.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    # -- the model -------------------------------------------------------------------------------
    @property
    def vllm_config(self) -> VllmConfig:
        """The engine's final configuration (read it, never change it); vLLM's EngineClient has it."""

    @property
    def model_config(self) -> ModelConfig:
        """The served model (final: read it, never change it)."""

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) one request may hold."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self) -> Any | None:
        """The HF tokenizer, or None when the engine runs without one (skip_tokenizer_init)."""

    # -- prompts ---------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, *, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids; raises ValueError for a malformed or empty prompt."""

    def validate_prompt(self, token_ids: list[int], params: SamplingParams, *, has_mm_data: bool = False) -> None:
        """Raise ValueError (naming the parameter) if the engine would refuse this request.
        ``has_mm_data``: the prompt comes with images, so its placeholder tokens are expected."""

    def validate_prompt_embeds(self, embeds: Any, params: SamplingParams) -> Any:
        """The ``[T, hidden]`` tensor a ``{"prompt_embeds": embeds}`` prompt would queue; raises
        ValueError as ``generate`` would."""

    @property
    def mm_processor(self) -> Any | None:
        """The model's multimodal processor (renders and expands prompts with images), or None
        for a text-only model."""

    # -- requests --------------------------------------------------------------------------------
    def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                 add_special_tokens: bool = True, lora_request: Any = None,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; leaving early aborts it. ``lora_request``:
        the ``LoRARequest`` of its adapter (None: the base model)."""

    async def add_lora(self, lora_request: Any) -> bool:
        """Check (and register) a LoRA adapter; ``ValueError`` for one the engine cannot run."""

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget a LoRA adapter; False if it was not known."""

    def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str, *,
               priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's output for one prompt (one final ``PoolingRequestOutput``)."""

    @property
    def scheduling_policy(self) -> str:
        """"fcfs" or "priority": a nonzero request ``priority`` needs "priority"."""

    def abort(self, request_id: str) -> None:
        """Stop a request now (synchronous: callable from ``finally`` blocks)."""

    # -- sleep mode ------------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Free the device memory (needs enable_sleep_mode); ValueError/RuntimeError when refused."""

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def is_sleeping(self) -> bool: ...

    # -- health and statistics -------------------------------------------------------------------
    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine cannot serve any more, or None while it can."""

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine cannot serve."""

    @property
    def num_gpu_blocks(self) -> int:
        """KV-cache blocks allocated at start-up."""

    @property
    def latest_stats(self) -> EngineStatsSnapshot | None:
        """The engine core's latest statistics snapshot (None before the first one)."""

    def shutdown(self) -> None: ...
