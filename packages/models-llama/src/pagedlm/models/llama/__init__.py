"""pagedlm-models-llama: Llama, Mistral and Mixtral for pagedlm.

The engine finds these classes through the plugin registry (``plugin.py``).

NOTE: the classes are exported lazily (PEP 562). Loading the plugin imports this package
first, in every process, and that must not pull in torch or the modeling code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedlm.models.llama.mixtral import MixtralForCausalLM
    from pagedlm.models.llama.modeling import LlamaForCausalLM, MistralForCausalLM

__all__ = ["LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "MixtralForCausalLM":
        from pagedlm.models.llama import mixtral

        return mixtral.MixtralForCausalLM
    if name in __all__:
        from pagedlm.models.llama import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
