"""pagedlm-models-qwen's hook implementations.

NOTE: imported in every process that loads plugins, so it imports nothing heavy; model classes
are named by string and imported only when a checkpoint needs them.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedlm.core.plugins import hookimpl


@hookimpl
def pagedlm_register_models(register: Callable[[str, str], None]) -> None:
    register("Qwen2ForCausalLM", "pagedlm.models.qwen.qwen2:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "pagedlm.models.qwen.qwen3:Qwen3ForCausalLM")
    register("Qwen3MoeForCausalLM", "pagedlm.models.qwen.qwen3_moe:Qwen3MoeForCausalLM")
