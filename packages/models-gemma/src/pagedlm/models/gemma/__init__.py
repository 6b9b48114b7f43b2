"""pagedlm-models-gemma: Gemma 3 (text) for pagedlm, and Gemma 3 270M as the default model.

The engine finds the model class through the plugin registry (``plugin.py``).

NOTE: the classes are exported lazily (PEP 562). Loading the plugin imports this package
first, in every process, and that must not pull in torch or the modeling code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedlm.models.gemma.gemma3 import Gemma3ForCausalLM

__all__ = ["Gemma3ForCausalLM"]

_MODULES = {"Gemma3ForCausalLM": "pagedlm.models.gemma.gemma3"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
