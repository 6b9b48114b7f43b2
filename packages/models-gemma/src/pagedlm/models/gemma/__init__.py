"""pagedlm-models-gemma: Gemma 3 (text, and with images) for pagedlm, and Gemma 3 270M as the default model.

The engine finds the model class through the plugin registry (``plugin.py``).

NOTE: the classes are exported lazily (PEP 562). Loading the plugin imports this package
first, in every process, and that must not pull in torch or the modeling code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedlm.models.gemma.gemma3 import Gemma3ForCausalLM
    from pagedlm.models.gemma.gemma3_mm import Gemma3ForConditionalGeneration
    from pagedlm.models.gemma.processing import Gemma3MultiModalProcessor

__all__ = ["Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma3MultiModalProcessor"]

_MODULES = {"Gemma3ForCausalLM": "pagedlm.models.gemma.gemma3",
            "Gemma3ForConditionalGeneration": "pagedlm.models.gemma.gemma3_mm",
            "Gemma3MultiModalProcessor": "pagedlm.models.gemma.processing"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
