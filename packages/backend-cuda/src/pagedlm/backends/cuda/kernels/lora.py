"""Triton kernels of the batched LoRA update (``lora_shrink`` / ``lora_expand``; contracts in
``pagedlm.core.layers.custom_ops``), registered for platform ``cuda`` by the backend's
``pagedlm_register_ops``.

Both read the step's tokens grouped by slot (``sorted_token_ids``, ``slot_starts``,
``slot_counts``: :class:`pagedlm.core.lora.punica.LoRAStepState`) and launch a fixed grid, ``(token
tiles of the whole step, [output tiles,] max_loras)``: a program whose slot has fewer tokens than
its tile's start returns at once. The grid depends only on the tensors' shapes, and no value is
read on the host, so a decode step's launches can be captured in a CUDA graph and replayed with
the next step's metadata. Each program loads its slot's A (or B) tile once for up to ``BLOCK_M``
tokens of that slot (punica's grouped GEMM), instead of once per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch

__all__ = ["lora_expand", "lora_shrink"]

_BLOCK_M = 16


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ptr, starts_ptr, counts_ptr, K, R, stride_xm, stride_al,
                        stride_ar, stride_om, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None], mask=r_mask[None, :] & k_mask[:, None],
                    other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a.to(x.dtype))
    tl.store(out_ptr + tokens[:, None] * stride_om + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_expand_kernel(s_ptr, b_ptr, y_ptr, sorted_ptr, starts_ptr, counts_ptr, scale_ptr, N, R, stride_sm,
                        stride_bl, stride_bn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    s = tl.load(s_ptr + tokens[:, None] * stride_sm + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :],
                other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    if IEEE:
        acc = tl.dot(s, b.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(s.to(b.dtype), b)
    acc = acc * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot needs every dimension >= 16


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids: torch.Tensor, slot_starts: torch.Tensor,
                slot_counts: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` float32: row ``t`` of slot ``s`` = ``x[t] @ lora_a[s]^T`` (``lora_a [L, R, K]``)."""
    num_tokens, size_in = x.shape
    num_slots, rank, _ = lora_a.shape
    assert x.stride(1) == 1 and lora_a.stride(2) == 1
    out = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    grid = (triton.cdiv(num_tokens, _BLOCK_M), num_slots)
    block_r = _block_r(rank)
    # NOTE: a decode step gives each slot few tokens: the K loop's length is the latency, so it
    # takes wide steps (the tiles stay small: 16 tokens x BLOCK_R ranks)
    block_k = 128 if block_r <= 64 else 64
    launch(_lora_shrink_kernel, grid, x, lora_a, out, sorted_token_ids, slot_starts, slot_counts, size_in, rank,
           x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0), BLOCK_M=_BLOCK_M, BLOCK_R=block_r,
           BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=4)
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, sorted_token_ids: torch.Tensor,
                slot_starts: torch.Tensor, slot_counts: torch.Tensor, scale: torch.Tensor) -> None:
    """In place: ``y[t] += (shrunk[t] @ lora_b[s]^T) * scale[s]`` for the tokens of each slot
    (``y [T, N]`` may be a column slice of a wider output; ``lora_b [L, N, R]``)."""
    num_tokens, size_out = y.shape
    num_slots, _, rank = lora_b.shape
    assert y.stride(1) == 1 and shrunk.stride(1) == 1 and lora_b.stride(2) == 1
    if num_tokens == 0:
        return
    block_n = 64 if size_out <= 1024 else 128
    grid = (triton.cdiv(num_tokens, _BLOCK_M), triton.cdiv(size_out, block_n), num_slots)
    launch(_lora_expand_kernel, grid, shrunk, lora_b, y, sorted_token_ids, slot_starts, slot_counts, scale, size_out,
           rank, shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0), BLOCK_M=_BLOCK_M,
           BLOCK_N=block_n, BLOCK_R=_block_r(rank), IEEE=y.dtype == torch.float32, num_warps=4)
