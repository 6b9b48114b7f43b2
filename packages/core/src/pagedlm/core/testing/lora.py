"""LoRA test helpers: PEFT adapters made with the real ``peft`` library, and HF + PEFT greedy
references (float32, CPU) to compare pagedlm's LoRA outputs with."""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

from pagedlm.core.testing.hf_reference import HFGreedyResult

__all__ = ["hf_peft_greedy", "make_peft_adapter"]

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, rank: int = 8,
                      lora_alpha: float = 16, target_modules: Sequence[str] = ALL_PROJECTIONS,
                      use_rslora: bool = False, seed: int = 0, b_std: float = 0.2) -> str:
    """A PEFT LoRA adapter of the checkpoint in ``model_dir`` (``get_peft_model`` +
    ``save_pretrained``), with random nonzero B (PEFT starts B at zero, which would change
    nothing) so that the adapter changes the model's outputs. Returns ``out_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=list(target_modules),
                            use_rslora=use_rslora, lora_dropout=0.0)
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, b_std)
        peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


def hf_peft_greedy(model_dir: str | os.PathLike[str], adapter_dir: str | os.PathLike[str] | None,
                   prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[HFGreedyResult]:
    """Greedy tokens of HF transformers with the PEFT adapter in ``adapter_dir`` (None: the base
    model), float32 on the CPU, one prompt at a time, EOS not stopping (``ignore_eos=True``)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    # transformers 5.x calls the KV cache argument ``cache``, 4.x ``past_key_values``
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model = model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompt_token_ids:
            ids = [int(t) for t in prompt]
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            tokens: list[int] = []
            gaps: list[float] = []
            rows = []
            for step in range(max_new_tokens):
                last = out.logits[0, -1].float()
                top = last.topk(2).values
                gaps.append(float(top[0] - top[1]))
                rows.append(torch.log_softmax(last, dim=-1))
                tokens.append(int(last.argmax()))
                if step + 1 < max_new_tokens:
                    out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{cache_arg: out[cache_arg]})
            results.append(HFGreedyResult(prompt_token_ids=ids, token_ids=tokens, top2_gaps=gaps,
                                          logprobs=torch.stack(rows), prompt_logprobs=None))
    return results
