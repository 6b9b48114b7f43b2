"""What every engine config class shares: the dtype names users may give, and freezing.

``pagedlm.core.config`` (the engine's ``VllmConfig`` and its parts) and
``pagedlm.core.feature_configs`` (the options of optional features) build on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_STR_TO_DTYPE = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Freezable:
    """Fields that become read-only once :meth:`freeze` ran.

    NOTE: the flag lives in the instance ``__dict__``, so copies and pickles (the config reaches
    engine and worker processes pickled) stay frozen. Values that are themselves mutable
    (``hf_config``, dicts) are not frozen: treat them as read-only too.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {type(self).__name__}.{name}: the configuration is frozen once VllmConfig.finalize() "
                "has run (in the front end, before any engine process starts); set it before finalize(), or "
                "build a new config"
            )
        object.__setattr__(self, name, value)

    def freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    @property
    def frozen(self) -> bool:
        return self.__dict__.get("_frozen", False)
