"""The scheduler's LoRA rule: at most ``max_loras`` distinct adapters among running requests.

Every running request may be scheduled in the same step, so keeping the *running* set within
``max_loras`` adapters keeps every step within the device slots. A waiting request whose adapter
would be one too many is skipped (it keeps its place in the queue) until one of the running
adapters has no request left.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedlm.core.request import Request

__all__ = ["LoRAGate"]


class LoRAGate:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._ids: set[int] = set()

    def begin(self, running: Iterable[Request]) -> None:
        """Start the admission phase of a step with the adapters of ``running``."""
        self._ids = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}

    def admits(self, request: Request) -> bool:
        lora = request.lora_request
        return lora is None or lora.lora_int_id in self._ids or len(self._ids) < self.max_loras

    def admit(self, request: Request) -> None:
        if request.lora_request is not None:
            self._ids.add(request.lora_request.lora_int_id)

    @staticmethod
    def adapter_counts(requests: Iterable[Request]) -> dict[str, int]:
        """Adapter name -> number of ``requests`` using it (the ``lora_requests_info`` metric)."""
        counts: dict[str, int] = {}
        for r in requests:
            if r.lora_request is not None:
                counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
        return counts
