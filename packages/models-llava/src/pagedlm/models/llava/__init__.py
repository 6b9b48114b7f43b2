"""pagedlm-models-llava: LLaVA vision-language models for pagedlm.

The engine finds the classes through the plugin registry (``plugin.py``).

NOTE: the classes are exported lazily (PEP 562). Loading the plugin imports this package
first, in every process, and that must not pull in torch or the modeling code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedlm.models.llava.llava import LlavaForConditionalGeneration
    from pagedlm.models.llava.processing import LlavaMultiModalProcessor

__all__ = ["LlavaForConditionalGeneration", "LlavaMultiModalProcessor"]


def __getattr__(name: str) -> Any:
    if name == "LlavaForConditionalGeneration":
        from pagedlm.models.llava import llava

        return llava.LlavaForConditionalGeneration
    if name == "LlavaMultiModalProcessor":
        from pagedlm.models.llava import processing

        return processing.LlavaMultiModalProcessor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
