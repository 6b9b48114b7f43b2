"""LoRA fixtures: three PEFT adapters (made with the real ``peft`` library) per tiny checkpoint,
and the HF + PEFT greedy references of every (prompt, adapter) pair, built once per session."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

MAX_NEW = 8
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
    [300, 200, 100, 7, 77, 177, 277, 377, 477, 11, 22, 33, 44],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 99, 98],  # shares a block-sized prefix with the first
]
#: name -> make_peft_adapter options: different ranks, rsLoRA, and different target modules
ADAPTERS = {
    "all-r8": {"rank": 8, "lora_alpha": 16, "seed": 1},
    "attn-r4-rslora": {"rank": 4, "lora_alpha": 8, "use_rslora": True, "seed": 2,
                       "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj")},
    "mlp-r16": {"rank": 16, "lora_alpha": 24, "seed": 3, "target_modules": ("gate_proj", "up_proj", "down_proj", "q_proj")},
}


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
