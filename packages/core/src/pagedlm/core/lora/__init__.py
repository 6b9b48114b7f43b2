"""Multi-LoRA: many PEFT adapters served from one base model in one batch (docs/lora.md).

``LoRARequest`` names a request's adapter; the workers keep adapters in ``max_loras`` device
slots (:mod:`.manager`) and add each row's low-rank update to the adapted layers (:mod:`.layers`,
:mod:`.punica`); the scheduler keeps a step within the slots (:mod:`.scheduling`).
"""

from pagedlm.core.lora.request import LoRARequest

__all__ = ["LoRARequest"]
