"""pagedlm-models-llava's hook implementations.

NOTE: imported in every process that loads plugins, so it imports nothing heavy; the model and
its processor are named by string and imported only when a checkpoint needs them.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedlm.core.plugins import hookimpl

_ARCH = "LlavaForConditionalGeneration"


@hookimpl
def pagedlm_register_models(register: Callable[[str, str], None]) -> None:
    register(_ARCH, "pagedlm.models.llava.llava:LlavaForConditionalGeneration")


@hookimpl
def pagedlm_register_multimodal_processors(register: Callable[[str, str], None]) -> None:
    register(_ARCH, "pagedlm.models.llava.processing:LlavaMultiModalProcessor")
