"""Shared by the LoRA tests (a plain module: test files import it by name)."""

from __future__ import annotations

from conftest import MAX_NEW, PROMPTS

from pagedlm.core import LoRARequest, SamplingParams
from pagedlm.core.testing import compare_greedy


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
