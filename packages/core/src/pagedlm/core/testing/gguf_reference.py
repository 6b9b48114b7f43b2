"""HF transformers on a GGUF file as the reference: its own loader and dequantization, greedy
decoding with its KV cache, one prompt at a time (the real-model tests of Gemma 3 270M)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pagedlm.core.testing.hf_reference import HFGreedyResult

__all__ = ["GEMMA3_270M_PROMPTS", "hf_gguf_greedy", "load_hf_gguf_model"]

#: prose, code, a short list and a long list whose 550+ tokens exceed the 512-token sliding window
GEMMA3_270M_PROMPTS = [
    "The history of the printing press begins in",
    'def is_prime(n: int) -> bool:\n    """Return True if n is a prime number."""\n',
    "Things to pack for a weekend camping trip:\n1. A tent\n2.",
    "Numbers and their squares:\n" + "".join(f"{i} squared is {i * i}.\n" for i in range(1, 61)),
]


def load_hf_gguf_model(path: str, *, config: Any = None, device: str = "cpu") -> Any:
    """HF's float32 model of the GGUF file at ``path`` (eager attention), on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(os.path.abspath(path))
    extra = {"config": config} if config is not None else {}
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager", **extra)
    return model.to(device).eval()


def hf_gguf_greedy(model: Any, prompts: Sequence[Sequence[int]], max_new: int) -> list[HFGreedyResult]:
    """Greedy decoding with HF's KV cache, one prompt at a time, recording top-2 gaps and the
    log-softmax rows; the logits of the last position only (all rows of a 262k vocabulary would
    cost more than the whole decode)."""
    import torch

    device = next(model.parameters()).device
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(input_ids=torch.tensor([list(prompt)], device=device), use_cache=True, logits_to_keep=1)
            cache_key = "cache" if "cache" in out else "past_key_values"
            tokens, gaps, rows = [], [], []
            last = out.logits[0, -1].float()
            for step in range(max_new):
                top = last.topk(2).values
                gaps.append(float(top[0] - top[1]))
                rows.append(torch.log_softmax(last, dim=-1).cpu())
                tokens.append(int(last.argmax()))
                if step + 1 == max_new:
                    break
                out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), use_cache=True,
                            **{cache_key: out[cache_key]})
                last = out.logits[0, -1].float()
            results.append(HFGreedyResult(list(prompt), tokens, gaps, torch.stack(rows), None))
    return results
