"""pagedlm-models-qwen: Qwen2, Qwen3 and Qwen3-MoE for pagedlm.

The engine finds these classes through the plugin registry (``plugin.py``).

NOTE: the classes are exported lazily (PEP 562). Loading the plugin imports this package
first, in every process, and that must not pull in torch or the modeling code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedlm.models.qwen.qwen2 import Qwen2ForCausalLM
    from pagedlm.models.qwen.qwen3 import Qwen3ForCausalLM
    from pagedlm.models.qwen.qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]

_MODULES = {"Qwen2ForCausalLM": "pagedlm.models.qwen.qwen2", "Qwen3ForCausalLM": "pagedlm.models.qwen.qwen3",
            "Qwen3MoeForCausalLM": "pagedlm.models.qwen.qwen3_moe"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
