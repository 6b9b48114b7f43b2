"""Batches of more than :data:`.w4a16_mma.CHUNKED_MAX_ROWS` rows times mma-layout int4 weights:
the weights dequantized into a dense ``[n, K]`` scratch matrix, column chunk by column chunk, each
chunk one cuBLAS matmul.

Why not a GEMM that dequantizes tile by tile: the mma layout (:mod:`.w4a16_mma`) is made for the
GEMV's warps, 512 contiguous bytes per 16-row x 64-value block in the order of the mma's
fragments. A Triton GEMM tile ``[BLOCK_K, BLOCK_N]`` gathers each of its values' words from all
over those blocks (each word loaded once per field it holds), and a 128-token prefill of
Llama-3.1-8B took 1.33 ms a linear layer that way (H100, 2026-12-07: 171 ms for the prompt, where
the decode step after it took 2.2 ms). Here each program reads whole blocks, coalesced, and writes
their values where a dense weight has them; the matmul is cuBLAS's. The chunks keep the scratch
matrix under :data:`SCRATCH_BYTES` (an 8B model's LM head would take 1 GiB).

Measured on an H100 (2026-12-07, ``.diag``-style CUDA-graph timing, Llama-3.1-8B's four linears,
g128): one layer at 16 / 64 / 128 / 512 rows took 2321 / 4370 / 3803 / 9560 us in the Triton
GEMM and 908 / 908 / 934 / 1087 us this way, bf16 cuBLAS 152 / 156 / 171 / 328 us: the
dequantization's 2-byte stores (~0.5 TB/s) were most of it; the 16-byte stores of the kernel below
came after and are not timed yet.

NOTE: values are ``(q - z) * s`` rounded once to the activation dtype, as the Triton GEMM's tile
dequantization rounds them, so the same weights give that kernel's products up to the order of
the float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["SCRATCH_BYTES", "mma_dequantize", "mma_dequantized_matmul"]

#: the largest dense chunk of a weight dequantized at once
SCRATCH_BYTES = 64 << 20
#: K blocks (of 64 values) a program dequantizes, at most
_BLOCKS_PER_PROGRAM = 4


@triton.jit
def _mma_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, tile0,
                        GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, KB: tl.constexpr):
    """Program ``(i, j)``: the 16 rows ``n`` of tile ``tile0 + i`` over K blocks ``[j KB, j KB + KB)``
    into ``out [rows of the chunk, K]`` (row ``n - 16 tile0``). A block is 128 words, word
    ``(g * 4 + t) * 4 + jj`` holding in field ``4 h + 2 ch + rh`` the value of row ``8 rh + g``
    and column ``16 t + 4 jj + 2 ch + h`` (``w4a16_mma.mma_word_and_shift``): the blocks are read
    as they lie (16-byte loads), their fields permuted into a ``[16, 64 KB]`` row-major tile in
    registers (through shared memory), and the rows stored contiguously (16-byte stores; stored
    where each value was unpacked, a 2-byte store each, the kernel wrote at ~0.5 TB/s on an H100)."""
    nt = tile0 + tl.program_id(0)
    kb0 = tl.program_id(1) * KB
    words = tl.load(qw_ptr + (nt * (K // 64) + kb0) * 128 + tl.arange(0, KB * 128))  # the KB blocks, contiguous
    f = tl.arange(0, 8)
    q = (words[:, None] >> (4 * f)[None, :]) & 15  # [(kb, g, t, jj), (h, ch, rh)]
    q = tl.permute(tl.reshape(q, (KB, 8, 4, 4, 2, 2, 2)), (6, 1, 0, 2, 3, 5, 4))  # (rh, g, kb, t, jj, ch, h)
    q = tl.reshape(q, (16, KB * 64))
    n = nt * 16 + tl.arange(0, 16)[:, None]
    k = kb0 * 64 + tl.arange(0, KB * 64)[None, :]
    group = k // GROUP_SIZE  # a constexpr divisor: a shift for the powers of two
    s = tl.load(s_ptr + group * N + n).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + group * N + n)
    else:
        z = 8
    value = ((q - z).to(tl.float32) * s).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (n - tile0 * 16).to(tl.int64) * K + k, value)


def mma_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                   n0: int = 0, rows: int | None = None) -> torch.Tensor:
    """Rows ``[n0, n0 + rows)`` of the dense weight ``[N, K]`` (``scales``' dtype) of an
    mma-layout int4 ``qweight`` (``[K // 8, N]``) with ``scales``/``zeros`` ``[K // G, N]``
    (``zeros`` None: symmetric, 8). ``n0`` and ``rows`` are multiples of 16."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    rows = n - n0 if rows is None else rows
    assert n0 % 16 == 0 and rows % 16 == 0 and n0 + rows <= n and k % 64 == 0
    kb = _BLOCKS_PER_PROGRAM
    while (k // 64) % kb:
        kb //= 2
    out = torch.empty(rows, k, dtype=scales.dtype, device=qweight.device)
    if rows:
        _mma_dequant_kernel[(rows // 16, k // (64 * kb))](
            qweight, scales, zeros if zeros is not None else qweight, out, n, k, n0 // 16,
            GROUP_SIZE=group_size, HAS_ZEROS=zeros is not None, KB=kb, num_warps=4)
    return out


def mma_dequantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight) -> [M, N]`` in x's dtype: the weight dequantized in chunks of
    at most :data:`SCRATCH_BYTES`, each multiplied by cuBLAS (``x`` and ``scales`` of one dtype)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    chunk = max(16, SCRATCH_BYTES // (k * x.element_size()) // 16 * 16)
    if chunk >= n:
        return x @ mma_dequantize(qweight, scales, zeros, group_size).t()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for n0 in range(0, n, chunk):
        rows = min(chunk, n - n0)
        out[:, n0:n0 + rows] = x @ mma_dequantize(qweight, scales, zeros, group_size, n0, rows).t()
    return out
