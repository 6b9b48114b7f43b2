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
#: ``W_KIND`` of :func:`fused_moe_kernel`: weights in the activation dtype; float8_e4m3fn weights
#: with FP8 activations (per-row ``a_scale``, per-channel ``b_scale``); packed integers (``BITS``
#: wide, ``32 // BITS`` per int32 along K) dequantized in the inner loop with group scales
W_PLAIN, W_FP8, W_INT = 0, 1, 2


@triton.jit(do_not_specialize=["num_valid_pairs", "EM"])
def fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    a_scale_ptr, b_scale_ptr, b_zero_ptr,
    N, K, num_valid_pairs, EM,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    stride_se, stride_sn, stride_sk, stride_ze, stride_zn, stride_zk,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr,
    W_KIND: tl.constexpr = 0, BITS: tl.constexpr = 4, GROUP_K: tl.constexpr = 128, HAS_ZP: tl.constexpr = False,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``c[pair, n] = sum_k a[row(pair), k] * b[expert, n, k]``.

    ``b [E, N(*2 when GATED), K]``; with ``GATED`` the tile also computes the up rows ``n + N`` and
    stores ``silu(gate) * up``. ``row(pair)`` is ``pair // TOP_K`` when ``A_PER_TOKEN`` (rows of the
    hidden states), else ``pair``. Rows whose pair index is ``num_valid_pairs`` are padding.

    Quantized weights (``W_KIND``): ``W_FP8``: ``a`` and ``b`` float8_e4m3fn, the float32 dot
    scaled by ``a_scale[row]`` and ``b_scale[expert, n]`` (stride ``stride_se``); ``W_INT``: ``b``
    holds int32 words ``[E, N, K // (32 // BITS)]`` (the strides are the words'), element ``(n, k)``
    the field at bit ``BITS * (k % (32 // BITS))``, dequantized to the activation dtype as
    ``(q - z) * s`` with ``s = b_scale[expert, n, k // GROUP_K]``, ``z`` from ``b_zero`` (same
    indexing, unsigned) or ``2 ** (BITS - 1)``; ``BLOCK_K`` divides ``GROUP_K`` and ``K``.
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
    n64 = offs_n.to(tl.int64)
    dt = c_ptr.dtype.element_ty
    PACK = 32 // BITS
    if W_KIND == 2:
        b_ptrs = b_ptr + expert * stride_be + n64[None, :] * stride_bn + (offs_k // PACK)[:, None] * stride_bk
        shifts = ((offs_k % PACK) * BITS)[:, None]
        s_ptrs = b_scale_ptr + expert * stride_se + n64 * stride_sn
        z_ptrs = b_zero_ptr + expert * stride_ze + n64 * stride_zn
    else:
        b_ptrs = b_ptr + expert * stride_be + n64[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_KIND == 2:
            group = (k0 * BLOCK_K) // GROUP_K
            b = _dequantize_tile(b_ptrs, s_ptrs, z_ptrs, shifts, group, stride_sk, stride_zk, col_ok, dt,
                                 BITS, HAS_ZP)
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST_DOTS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            if W_KIND == 2:
                b_up = _dequantize_tile(b_ptrs + N * stride_bn, s_ptrs + N * stride_sn, z_ptrs + N * stride_zn,
                                        shifts, group, stride_sk, stride_zk, col_ok, dt, BITS, HAS_ZP)
            else:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST_DOTS:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        if W_KIND == 2:
            b_ptrs += (BLOCK_K // PACK) * stride_bk
        else:
            b_ptrs += BLOCK_K * stride_bk
    if W_KIND == 1:
        # FP8: the dots summed the FP8 values' products; both scales applied once
        a_s = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)
        b_s = tl.load(b_scale_ptr + expert * stride_se + n64, mask=col_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
        if GATED:
            b_s_up = tl.load(b_scale_ptr + expert * stride_se + n64 + N, mask=col_ok, other=0.0)
            acc_up = acc_up * a_s[:, None] * b_s_up[None, :]
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


@triton.jit
def _dequantize_tile(b_ptrs, s_ptrs, z_ptrs, shifts, group, stride_sk, stride_zk, col_ok, dt: tl.constexpr,
                     BITS: tl.constexpr, HAS_ZP: tl.constexpr):
    """``[BLOCK_K, BLOCK_N]`` weights in ``dt`` from packed words (one group of scales: the
    block lies inside group ``group``): ``(q - z) * s``, the product rounded once to ``dt``."""
    words = tl.load(b_ptrs, mask=col_ok[None, :], other=0)
    q = (words >> shifts) & ((1 << BITS) - 1)
    s = tl.load(s_ptrs + group * stride_sk, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_ZP:
        z = tl.load(z_ptrs + group * stride_zk, mask=col_ok, other=0)
        q = q - z[None, :]
    else:
        q = q - (1 << (BITS - 1))
    # NOTE: an 8-bit integer times a 16-bit float is exact in float32, so this rounds as the
    # reference's (q - z).to(dtype) * s does
    return (q.to(tl.float32) * s[None, :]).to(dt)


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
                            mul_routed_weight: bool, config: dict[str, int], a_scale: torch.Tensor | None = None,
                            b_scale: torch.Tensor | None = None, b_zero: torch.Tensor | None = None,
                            w_kind: int = W_PLAIN, bits: int = 4, group_k: int = 128) -> None:
    """Launch :func:`fused_moe_kernel` over every tile of ``c [T*top_k, N]``; ``b [E, N or 2N, K]``
    (``[E, N or 2N, K // (32 // bits)]`` int32 words with ``W_INT``; ``K`` is then the unpacked one).
    ``a_scale [rows]``, ``b_scale [E, N or 2N]`` (FP8) or ``[E, N or 2N, K // group_k]`` (packed),
    ``b_zero`` like the latter or None."""
    n = c.shape[1]
    k = b.shape[2] * (32 // bits if w_kind == W_INT else 1)
    em = sorted_token_ids.numel()
    cfg = dict(config)
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    grid = (triton.cdiv(em, block_m) * triton.cdiv(n, block_n),)
    s_strides = (0, 0, 0) if b_scale is None else tuple(b_scale.stride()) + (0,) * (3 - b_scale.dim())
    z_strides = (0, 0, 0) if b_zero is None else tuple(b_zero.stride())
    dot_dtype = c.dtype if w_kind == W_INT else a.dtype
    launch(
        fused_moe_kernel, grid,
        a, b, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        a_scale if a_scale is not None else topk_weights, b_scale if b_scale is not None else topk_weights,
        b_zero if b_zero is not None else sorted_token_ids,
        n, k, c.shape[0], em,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0), *s_strides, *z_strides,
        TOP_K=top_k, A_PER_TOKEN=a_per_token, GATED=gated, MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.pop("BLOCK_K"), GROUP_M=cfg.pop("GROUP_M"),
        DOT_PRECISION="ieee" if dot_dtype == torch.float32 or INTERPRET else "tf32",
        UPCAST_DOTS=INTERPRET and dot_dtype in (torch.bfloat16, torch.float8_e4m3fn),
        W_KIND=w_kind, BITS=bits, GROUP_K=group_k, HAS_ZP=b_zero is not None, **cfg,
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
