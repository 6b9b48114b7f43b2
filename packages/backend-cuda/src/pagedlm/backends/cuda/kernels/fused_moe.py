"""The ``fused_experts`` op in Triton: a MoE layer's routed experts in two grouped-GEMM launches.

The ``T * top_k`` (token, expert) pairs are sorted by expert and each expert's run padded to the
kernel's ``BLOCK_M`` (core's ``moe_align_block_size``: plain torch, no host synchronisation), so
every block of ``BLOCK_M`` rows belongs to one expert. Then:

1. gate/up: one launch over (row block, column block) tiles; a tile gathers its rows of the
   hidden states (row ``pair // top_k``), multiplies them by its expert's gate *and* up rows
   (two accumulators) and applies SiLU-and-mul in the epilogue: ``act [T*top_k, I]``, one row per
   pair;
2. down: one launch the same way over ``act`` and the experts' down projections; the epilogue
   multiplies each row by its routing weight: ``per_pair [T*top_k, H]``;
3. the ``top_k`` rows of a token are summed (float32 accumulation, one rounding).

Rounding follows the op contract (= core's torch reference): each matmul result is rounded to the
dtype, SiLU and the product rounded as ``silu_and_mul`` does, the weighted rows rounded before the
sum. float32 inputs multiply in IEEE float32 (no TF32), so float32 outputs match the reference to
summation order. The grids are sized from the input shapes (the padded total stays on the
device), so the op launches the same work whatever the routing and a CUDA graph can capture it.

Block sizes come from :func:`get_config` by token count; ``benchmarks/bench_fused_moe.py --sweep``
measures the alternatives on a GPU. The start-up's compile pass (``launch.compile_only``) queues
the variants of every entry of :data:`CONFIGS`, so no batch size compiles one later. Registered
for platform ``cuda`` as ``fused_experts`` by the
backend's ``pagedlm_register_ops`` (:mod:`pagedlm.backends.cuda.plugin`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import _COMPILE_ONLY, launch
from pagedlm.core.layers.fused_moe.reference import moe_align_block_size

__all__ = ["CONFIGS", "fused_experts", "get_config", "invoke_fused_moe_kernel"]

# Triton 3.6's interpreter computes bf16 tl.dot wrongly (garbage, seen on CPU); under it the dots
# take float32 copies of the same bf16 values instead (as paged_attention does). Never set on a GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# NOTE: the pair counts change with every batch; specialising on them (divisibility by 16) would
# compile a second variant at run time. N, K and the strides are the model's, fixed.
@triton.jit(do_not_specialize=["num_valid_pairs", "EM"])
def fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_valid_pairs, EM,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``c[pair, n] = sum_k a[row(pair), k] * b[expert, n, k]``.

    ``b [E, N(*2 when GATED), K]``; with ``GATED`` the tile also computes the up rows ``n + N`` and
    stores ``silu(gate) * up``. ``row(pair)`` is ``pair // TOP_K`` when ``A_PER_TOKEN`` (rows of the
    hidden states), else ``pair``. Rows whose pair index is ``num_valid_pairs`` are padding.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Row blocks in groups of GROUP_M share their column tiles of b while they are in cache.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m)
    row_ok = pair < num_valid_pairs
    pair64 = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    c_ptrs = c_ptr + pair64[:, None] * stride_cm + offs_n[None, :]
    c_mask = row_ok[:, None] & col_ok[None, :]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # not produced by moe_align_block_size below the padded total; zeros, to be safe
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    if A_PER_TOKEN:
        a_rows = pair64 // TOP_K
    else:
        a_rows = pair64
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST_DOTS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST_DOTS:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    dt = c_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dt).to(tl.float32)
        up = acc_up.to(dt).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # F.silu rounds to the dtype first
        out = (act * up).to(dt)
    else:
        out = acc.to(dt)
        if MUL_ROUTED_WEIGHT:
            w = tl.load(topk_weights_ptr + pair64, mask=row_ok, other=0.0)
            out = (out.to(tl.float32) * w[:, None]).to(dt)
    tl.store(c_ptrs, out, mask=c_mask)


#: ``(largest mean number of pairs per expert, config)``, by increasing load. Few pairs per expert
#: (decode): small row blocks, since an expert's weights are read once per row block of its pairs;
#: many (prefill): larger tiles, for reuse. Tuned with ``benchmarks/bench_fused_moe.py --sweep``.
CONFIGS: tuple[tuple[float, dict[str, int]], ...] = (
    (16, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}),
    (64, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}),
    (float("inf"), {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}),
)


def _for_dtype(cfg: dict[str, int], dtype: torch.dtype) -> dict[str, int]:
    # float32: half the K block (twice the bytes per element in the same shared memory)
    return {**cfg, "BLOCK_K": max(32, cfg["BLOCK_K"] // 2), "num_stages": 2} if dtype == torch.float32 else cfg


def get_config(num_tokens: int, num_experts: int, inter: int, hidden: int, top_k: int,
               dtype: torch.dtype) -> dict[str, int]:
    """Block sizes and launch options for a batch of ``num_tokens`` tokens (:data:`CONFIGS`)."""
    pairs_per_expert = num_tokens * top_k / max(1, num_experts)
    cfg = next(c for limit, c in CONFIGS if pairs_per_expert <= limit)
    return _for_dtype(cfg, dtype)


def invoke_fused_moe_kernel(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
                            sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                            num_tokens_post_padded: torch.Tensor, *, top_k: int, a_per_token: bool, gated: bool,
                            mul_routed_weight: bool, config: dict[str, int]) -> None:
    """Launch :func:`fused_moe_kernel` over every tile of ``c [T*top_k, N]``; ``b [E, N or 2N, K]``."""
    n = c.shape[1]
    k = b.shape[2]
    em = sorted_token_ids.numel()
    cfg = dict(config)
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    grid = (triton.cdiv(em, block_m) * triton.cdiv(n, block_n),)
    launch(
        fused_moe_kernel, grid,
        a, b, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, c.shape[0], em,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        TOP_K=top_k, A_PER_TOKEN=a_per_token, GATED=gated, MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.pop("BLOCK_K"), GROUP_M=cfg.pop("GROUP_M"),
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or INTERPRET else "tf32",
        UPCAST_DOTS=INTERPRET and a.dtype == torch.bfloat16, **cfg,
    )


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                  config: dict[str, Any] | None = None) -> torch.Tensor:
    """The ``fused_experts`` op (contract: pagedlm.core.layers.custom_ops): ``hidden_states [T, H]``,
    ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``topk_weights``/``topk_ids [T, top_k]``, ``expert_map``
    (global -> local expert, -1 elsewhere) -> ``[T, H]``. ``config`` overrides :func:`get_config`."""
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return hidden_states.new_empty(0, hidden)
    if hidden_states.stride(1) != 1:
        hidden_states = hidden_states.contiguous()
    for name, w in (("w13", w13), ("w2", w2)):
        if not w.is_contiguous():
            raise ValueError(f"fused_experts: {name} must be contiguous (the layer's parameter), got strides "
                             f"{w.stride()}")
    cfg = config or get_config(num_tokens, num_experts, inter, hidden, top_k, hidden_states.dtype)
    if config is None and _COMPILE_ONLY.get():
        # The start-up's compile pass runs one small batch; queue the variants of every batch size
        # too, so that no later step (prefill chunks, graph capture) waits on a compile.
        for _, other in CONFIGS:
            other = _for_dtype(other, hidden_states.dtype)
            if other != cfg:
                fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, other)
    sorted_token_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg["BLOCK_M"], num_experts, expert_map)
    pairs = num_tokens * top_k
    dtype, device = hidden_states.dtype, hidden_states.device
    weights = topk_weights.to(torch.float32).contiguous()
    act = torch.empty(pairs, inter, dtype=dtype, device=device)
    invoke_fused_moe_kernel(hidden_states, w13, act, weights, sorted_token_ids, expert_ids, num_post, top_k=top_k,
                            a_per_token=True, gated=True, mul_routed_weight=False, config=cfg)
    # NOTE: pairs of another rank's experts are never written: zeros, so they add nothing.
    per_pair = (torch.zeros if expert_map is not None else torch.empty)(pairs, hidden, dtype=dtype, device=device)
    invoke_fused_moe_kernel(act, w2, per_pair, weights, sorted_token_ids, expert_ids, num_post, top_k=top_k,
                            a_per_token=False, gated=False, mul_routed_weight=True, config=cfg)
    if top_k == 1:
        return per_pair
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(dtype)
