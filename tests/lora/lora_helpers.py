"""Shared by the LoRA tests (a plain module: test files import it by name)."""

from __future__ import annotations

from pagedlm.core import LoRARequest, SamplingParams
from pagedlm.core.testing import compare_greedy

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
    "mlp-r16": {"rank": 16, "lora_alpha": 24, "seed": 3,
                "target_modules": ("gate_proj", "up_proj", "down_proj", "q_proj")},
}


def lora_requests(setup) -> dict[str | None, LoRARequest | None]:
    requests: dict[str | None, LoRARequest | None] = {None: None}
    for i, (name, path) in enumerate(setup.adapters.items()):
        requests[name] = LoRARequest(name, i + 1, path)
    return requests


def mixed_batch(setup) -> list[tuple[str | None, int]]:
    """Every (adapter or None, prompt) pair, interleaved so each step mixes adapters."""
    return [(name, i) for i in range(len(PROMPTS)) for name in [None, *setup.adapters]]


def run_and_compare(llm, setup, pairs=None) -> None:
    pairs = pairs or mixed_batch(setup)
    loras = lora_requests(setup)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in pairs], params, use_tqdm=False,
                        lora_request=[loras[name] for name, _ in pairs])
    ours = [list(o.outputs[0].token_ids) for o in outs]
    reference = [setup.reference[pair] for pair in pairs]
    mismatches, _ = compare_greedy(ours, reference)
    assert mismatches == 0, [(pair, o, r.token_ids) for pair, o, r in zip(pairs, ours, reference)
                             if o != r.token_ids]
    # the adapters really change the outputs (else this test could not fail)
    for i in range(len(PROMPTS)):
        distinct = {tuple(setup.reference[name, i].token_ids) for name in [None, *setup.adapters]}
        assert len(distinct) == len(setup.adapters) + 1
