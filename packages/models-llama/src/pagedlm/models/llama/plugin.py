"""pagedlm-models-llama's hook implementations.

NOTE: imported in every process that loads plugins, so it imports nothing heavy; model classes
are named by string and imported only when a checkpoint needs them.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedlm.core.plugins import hookimpl

_MODULE = "pagedlm.models.llama.modeling"


@hookimpl
def pagedlm_register_models(register: Callable[[str, str], None]) -> None:
    register("LlamaForCausalLM", f"{_MODULE}:LlamaForCausalLM")
    register("MistralForCausalLM", f"{_MODULE}:MistralForCausalLM")
    register("MixtralForCausalLM", "pagedlm.models.llama.mixtral:MixtralForCausalLM")
