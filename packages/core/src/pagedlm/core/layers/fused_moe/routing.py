"""Routing: which ``top_k`` experts each token goes to, and with what weights.

``fused_topk`` is the softmax router of Qwen2/3-MoE and Mixtral (HF's arithmetic): the router
logits are computed in the model dtype (a plain linear layer), the softmax over all experts in
float32, the ``top_k`` largest probabilities picked by ``torch.topk`` (its tie order), and with
``renormalize`` divided by their sum, so they add up to 1 (Qwen3-MoE's ``norm_topk_prob``;
Mixtral always renormalises its top 2).

NOTE: weights stay float32 and are applied to each expert's output in float32 (see the
``fused_experts`` op contract). HF's Qwen3-MoE rounds them to the model dtype first and sums the
experts' outputs in the model dtype; in float32 the two are the same computation, in bf16 ours
rounds less.
"""

from __future__ import annotations

import torch

__all__ = ["fused_topk"]


def fused_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``gating_output [T, E]`` (router logits, any float dtype) -> ``(topk_weights [T, topk]
    float32, topk_ids [T, topk] int32)``, the ids in descending order of probability.

    ``hidden_states`` is taken for vLLM's signature (and the token count) only.
    """
    if gating_output.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"router logits for {gating_output.shape[0]} tokens, hidden states for "
                         f"{hidden_states.shape[0]}")
    if not 0 < topk <= gating_output.shape[-1]:
        raise ValueError(f"top_k={topk} must be in 1..{gating_output.shape[-1]} (the number of experts)")
    probs = torch.softmax(gating_output, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)
