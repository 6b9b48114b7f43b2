"""Core's torch implementation of the ``fused_experts`` op (the reference every platform's kernel
is checked against), and the expert-sorted token layout fused kernels work on.

:func:`fused_experts` runs the routed experts of a batch without a Python loop over tokens or
experts: the ``T * top_k`` (token, expert) pairs are sorted by expert, each expert's rows form one
contiguous group, and the gate/up and down projections are one grouped matmul each
(``torch.nn.functional.grouped_mm``; on torch releases without it, one batched matmul over the
experts' groups padded to the largest). The rounding steps are those of a per-expert
``linear -> silu_and_mul -> linear`` in the model dtype (HF's), then the routing weights are
applied in float32 and the ``top_k`` outputs of a token summed in float32.

:func:`moe_align_block_size` is the layout of vLLM's fused-MoE kernels: the pairs sorted by
expert with each expert's run padded to a multiple of the kernel's block size, so every block
of rows belongs to one expert. It is plain torch with no host synchronisation (every size is
bounded from the input's shape), so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["combine_pairs", "expert_groups", "fused_experts", "grouped_linear", "moe_align_block_size"]

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _check_shapes(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
    num_experts, two_i, hidden = w13.shape
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise ValueError(f"hidden_states {tuple(hidden_states.shape)} must be [T, {hidden}] for w13 "
                         f"{tuple(w13.shape)}")
    if two_i % 2 or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} must be [{num_experts}, {hidden}, {two_i // 2}] for w13 "
                         f"{tuple(w13.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [T={hidden_states.shape[0]}, top_k]")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x [N, K]`` (rows grouped by expert, ``counts [E]`` rows each) -> ``[N, out]``: group ``e``
    times ``weight[e] [out, K]`` transposed, as ``F.linear`` per group."""
    if _grouped_mm is not None:
        return _grouped_mm(x, weight.transpose(1, 2), offs=ends)
    # NOTE: torch < 2.9 has no grouped matmul: pad every group to the largest and run one bmm.
    num_experts = weight.shape[0]
    longest = int(counts.max()) if counts.numel() else 0
    starts = ends.long() - counts
    rank = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(starts, counts)
    group = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts)
    padded = x.new_zeros(num_experts, longest, x.shape[1])
    padded[group, rank] = x
    out = torch.bmm(padded, weight.transpose(1, 2))
    return out[group, rank]


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' weighted output (the ``fused_experts`` op contract, layers.custom_ops).

    ``hidden_states [T, H]``, ``w13 [E, 2I, H]`` (each expert's gate rows, then its up rows),
    ``w2 [E, H, I]``, ``topk_weights [T, K]`` (float32), ``topk_ids [T, K]`` (global expert ids;
    with ``expert_map [E_global]``, those mapped to -1 live on another rank and contribute
    nothing) -> ``[T, H]`` in ``hidden_states``' dtype.
    """
    _check_shapes(hidden_states, w13, w2, topk_weights, topk_ids)
    inter = w13.shape[1] // 2
    rows, counts, ends = expert_groups(topk_ids, expert_map, w13.shape[0])
    x = hidden_states.index_select(0, rows // topk_ids.shape[1])
    gate_up = grouped_linear(x, w13, counts, ends)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = grouped_linear(act, w2, counts, ends)
    return combine_pairs(down, rows, topk_weights)


def expert_groups(topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of this rank grouped by local expert: ``(rows [N] flat pair
    indices t * K + k, expert by expert; counts [E] pairs per expert; ends [E] int32 cumulative)``.
    Pairs of other ranks' experts (``expert_map`` -1) are left out."""
    flat_ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        flat_ids = expert_map.to(flat_ids.device).long()[flat_ids]
    # Pairs of other ranks' experts sort last, into a bucket no group reads.
    bucket = torch.where(flat_ids >= 0, flat_ids, num_experts)
    order = torch.argsort(bucket, stable=True)
    counts = torch.bincount(bucket, minlength=num_experts + 1)[:num_experts]
    rows = order[: int(counts.sum())]
    return rows, counts, torch.cumsum(counts, 0).to(torch.int32)


def combine_pairs(down: torch.Tensor, rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``down [N, H]`` (the experts' outputs of pairs ``rows``) -> ``[T, H]``: each row times its
    routing weight in float32, rounded to the dtype, the ``top_k`` rows of a token summed in float32."""
    num_tokens, top_k = topk_weights.shape
    dtype, hidden = down.dtype, down.shape[1]
    weighted = (down.float() * topk_weights.reshape(-1)[rows].float().unsqueeze(1)).to(dtype)
    per_pair = torch.zeros(num_tokens * top_k, hidden, dtype=dtype, device=down.device)
    per_pair[rows] = weighted
    return per_pair.view(num_tokens, top_k, hidden).float().sum(dim=1).to(dtype)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs sorted by expert, each expert's run padded to ``block_size``.

    ``topk_ids [T, K]`` global expert ids; ``num_experts`` local experts; ``expert_map`` as in
    :func:`fused_experts` (pairs of other ranks' experts are left out). Returns

    - ``sorted_token_ids [T*K + E*(block_size-1)] int32``: flat pair indices ``t * K + k``,
      expert by expert (ascending pair index within an expert), each run padded with ``T*K``
      (an invalid index) to a multiple of ``block_size``; the tail past the padded total is
      padding too;
    - ``expert_ids [len(sorted_token_ids) / block_size] int32``: the local expert of each block,
      -1 for blocks past the padded total;
    - ``num_tokens_post_padded [1] int32``: the padded total (a device tensor: no host sync).
    """
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        flat_ids = expert_map.to(device).long()[flat_ids]
    bucket = torch.where(flat_ids >= 0, flat_ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_size - 1) // block_size * block_size
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = torch.cat([padded_ends.new_zeros(1), padded_ends])  # [E + 1]: bucket E starts at the end
    starts = torch.cumsum(counts, 0) - counts
    order = torch.sort(bucket, stable=True).indices
    sorted_bucket = bucket[order]
    rank_in_run = torch.arange(num_pairs, device=device) - starts[sorted_bucket]
    max_len = num_pairs + num_experts * (block_size - 1)
    max_len = -(-max_len // block_size) * block_size
    # Pairs of other ranks land in one extra slot past the end, dropped below.
    dest = torch.where(sorted_bucket < num_experts, padded_starts[sorted_bucket] + rank_in_run, max_len)
    sorted_token_ids = torch.full((max_len + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_len, block_size, device=device)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_token_ids[:max_len], expert_ids, padded_ends[-1:].to(torch.int32)
