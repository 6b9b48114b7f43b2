"""The front end's adapter checks: each adapter is read (header only) and checked against the
model's adaptable modules once, before any request uses it, so a bad adapter is a ``ValueError``
for its caller and never reaches a worker's step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedlm.core.config import LoRAConfig
from pagedlm.core.lora.peft import load_peft_adapter
from pagedlm.core.lora.request import LoRARequest

__all__ = ["LoRARegistry", "as_lora_requests"]


class LoRARegistry:
    """Adapters checked so far, by ``lora_int_id``. ``targets`` (HF module path -> [in, out],
    merged over the ranks' ``Worker.lora_targets``) is set by the engine front end."""

    def __init__(self, lora_config: LoRAConfig | None) -> None:
        self.lora_config = lora_config
        self.targets: dict[str, list[int]] | None = None
        self.checked: dict[int, LoRARequest] = {}

    def set_targets(self, per_rank: Iterable[dict[str, list[int]]]) -> None:
        merged: dict[str, list[int]] = {}
        for table in per_rank:
            merged.update(table)
        self.targets = merged

    def needs_check(self, lora_request: LoRARequest | None) -> bool:
        """Whether ``lora_request`` must go through :meth:`check` before it is used."""
        if lora_request is None:
            return False
        known = self.checked.get(lora_request.lora_int_id) if isinstance(lora_request, LoRARequest) else None
        return known is None or known.lora_path != lora_request.lora_path or known.lora_name != lora_request.lora_name

    def check(self, lora_request: Any) -> bool:
        """``ValueError`` unless ``lora_request`` is an adapter this model can run; True when it
        had not been checked before."""
        if self.lora_config is None:
            raise ValueError("lora_request needs LoRA enabled: pass enable_lora=True (pagedlm serve --enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        known = self.checked.get(lora_request.lora_int_id)
        if known is not None:
            if known.lora_name != lora_request.lora_name or known.lora_path != lora_request.lora_path:
                raise ValueError(f"lora_int_id={lora_request.lora_int_id} already names adapter {known.lora_name!r} "
                                 f"({known.lora_path}); give {lora_request.lora_name!r} another lora_int_id")
            return False
        assert self.targets is not None, "set_targets before checking adapters"
        load_peft_adapter(lora_request, self.targets, self.lora_config.max_lora_rank, read_tensors=False)
        self.checked[lora_request.lora_int_id] = lora_request
        return True

    def forget(self, lora_int_id: int) -> bool:
        return self.checked.pop(lora_int_id, None) is not None


def as_lora_requests(lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt from ``generate``'s ``lora_request`` argument: one
    ``LoRARequest`` for all, or a list with one entry per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"lora_request has {len(lora_request)} entries but there are {num_prompts} prompts; "
                             "pass one LoRARequest (or None) or one per prompt")
        bad = [type(r).__name__ for r in lora_request if r is not None and not isinstance(r, LoRARequest)]
        if bad:
            raise ValueError(f"lora_request entries must be LoRARequest or None, got {bad[0]}")
        return list(lora_request)
    raise ValueError(f"lora_request must be a LoRARequest, a list of them, or None; got {type(lora_request).__name__}")
