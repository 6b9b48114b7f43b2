"""LoRA fixtures: three PEFT adapters (made with the real ``peft`` library) per tiny checkpoint,
and the HF + PEFT greedy references of every (prompt, adapter) pair, built once per session."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from lora_helpers import ADAPTERS, MAX_NEW, PROMPTS


@dataclass
class LoRASetup:
    model: str
    #: adapter name -> directory
    adapters: dict[str, str]
    #: (adapter name or None, prompt index) -> HF + PEFT greedy result
    reference: dict = field(default_factory=dict)


@pytest.fixture(scope="session")
def lora_setups(tiny_checkpoint_factory, tmp_path_factory) -> dict[str, LoRASetup]:
    from pagedlm.core.testing.lora import hf_peft_greedy, make_peft_adapter

    setups = {}
    for arch in ("llama", "qwen3"):
        model = tiny_checkpoint_factory(arch)
        root = tmp_path_factory.mktemp(f"lora-{arch}")
        adapters = {name: make_peft_adapter(model, root / name, **opts) for name, opts in ADAPTERS.items()}
        setup = LoRASetup(model, adapters)
        for name in [None, *adapters]:
            results = hf_peft_greedy(model, adapters[name] if name else None, PROMPTS, MAX_NEW)
            for i, r in enumerate(results):
                setup.reference[name, i] = r
        setups[arch] = setup
    return setups
