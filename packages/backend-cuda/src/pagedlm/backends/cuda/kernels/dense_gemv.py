"""The ``unquantized_gemm`` op: a decode-shaped (``T <= 4`` rows) bf16/fp16 GEMV in one launch.

At batch 1 a full-precision linear layer is a matrix-vector product whose cost is reading the
weights once. cuBLAS's GEMV-shaped kernels read Llama-3.1-8B's large projections (gate_up, down)
at ~4.1 TB/s on an H200, but its qkv and o projections (50 and 33.5 MB) at ~3.2 TB/s, plus a
split-K reduce launch each; this kernel streams the weights in a single launch instead:

- ``weight [N, K]`` row-major; program ``(n, split)`` owns ``BLOCK_N`` rows of W (output columns)
  and walks its K range in ``BLOCK_K`` steps. A step's tile is loaded as ``[BLOCK_N, BLOCK_K //
  VEC, VEC]`` with ``VEC`` values (16 bytes) per vector, coalesced along K; the product with the
  ``[T, BLOCK_K]`` chunk of x is summed over each vector's values inside the thread that loaded it,
  into one float32 accumulator ``[BLOCK_N, BLOCK_K // VEC]`` per row of x (VEC times smaller
  than the tile's products), reduced over K once at the end;
- x's chunk gets the tile's register layout when ``BLOCK_K >= VEC * 32 * num_warps`` (1024 at 4
  warps); smaller steps convert it through shared memory once per step (the chunk, not the
  tile: see the loop's NOTE);
- no ``tl.dot``: at one row a 16-row tensor-core tile would be 16x padding, and the kernel is
  bound by memory anyway;
- weights are read once, so they load with ``evict_first`` (they should not push x, the split-K
  partials or the next layer's inputs out of L2); x is tiny and read by every program (cached);
- rows of W past N read row N - 1 and rows of x past T read row T - 1 (their results are never
  stored), so the weight loads need no mask unless K is not a multiple of ``BLOCK_K``;
- with programmatic dependent launch (:mod:`.launch`), each program asks L2 for its first
  step's weight tiles before it waits for the previous kernel (weights are constant), so that
  read overlaps the end of the norm, split combine or SiLU-and-mul before it;
- optional split-K over the grid's second axis, reduced in the same launch by
  :func:`.wna16_gemv.split_k_store` (a counter per output tile; the tile's last program sums the
  partials in split order, so results are deterministic); the bias goes into split 0's partial.

Configurations ``(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)`` come from
:data:`DEFAULT_CONFIGS`, keyed by the weight's ``(N, K)`` and the row count rounded up to a power of
two (1, 2, 4), :data:`PDL_CONFIGS` first where kernels launch with PDL. A shape (or row count)
that is not in the tables, or whose entry is None, runs
``F.linear`` (cuBLAS): the table is to list only where the kernel measured faster.
``packages/backend-cuda/benchmarks/bench_dense_gemv.py`` sweeps the configurations on a GPU and
prints a replacement table; the one below is its measurement on an H200.

Inputs that take ``F.linear`` anyway: another dtype (float32), a weight that is not contiguous or
not of x's dtype, x rows with a stride along K, more than :data:`GEMV_MAX_ROWS` rows (or none),
an empty weight, and whatever F.linear would refuse (mismatched shapes or devices: it raises).

NOTE: CUDA-graph safe: no host synchronisation, and a grid that depends on the shapes only. The
split-K counters are :func:`.wna16_gemv.split_k_counters`' (shared with the W4A16 GEMV: one stream
at a time runs these kernels on a device; a first call inside a capture takes no split).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch, pdl_options, pdl_wait, prefetch_rows_l2
from pagedlm.backends.cuda.kernels.wna16_gemv import split_k_counters, split_k_store

__all__ = [
    "DEFAULT_CONFIGS", "GEMV_MAX_ROWS", "PDL_CONFIGS", "GemvConfig", "dense_gemv", "gemv_config", "unquantized_gemm",
]

#: the kernel takes at most this many rows; more run F.linear
GEMV_MAX_ROWS = 4
_DTYPES = (torch.bfloat16, torch.float16)
#: under Triton's interpreter (tests on a CPU) the kernel runs on CPU tensors too
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class GemvConfig(NamedTuple):
    """One launch configuration: rows of W per program, K values per step, K splits (reduced in
    the launch), warps per program, software-pipeline stages of the K loop (1: none)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


#: (N, K) -> {rows rounded up to 1, 2 or 4: the configuration, or None for F.linear}
#: NOTE: measured on an H200 (2026-12-02, ``bench_dense_gemv.py --rows 1``, in CUDA graphs, bf16):
#: only one row, the shapes where the kernel beat cuBLAS by 3 % or more; Llama-3.1-8B's gate_up
#: (28672 x 4096) stays on cuBLAS (56.4 us, 4.17 TB/s, against the kernel's best 59.1 us).
DEFAULT_CONFIGS: dict[tuple[int, int], dict[int, GemvConfig | None]] = {
    # Llama-3.1-8B qkv: 15.7 -> 14.6 us (3.20 -> 3.45 TB/s; the full sweep)
    (6144, 4096): {1: GemvConfig(4, 512, 1, 4, 1)},
    # Llama-3.1-8B o: 13.4 -> 10.9 us (2.51 -> 3.09 TB/s; the full sweep)
    (4096, 4096): {1: GemvConfig(4, 1024, 1, 4, 1)},
    # Llama-3.1-8B down: 32.0 -> 30.0 us (3.67 -> 3.92 TB/s; the quick sweep)
    (4096, 14336): {1: GemvConfig(4, 1024, 1, 2, 1)},
}


#: entries that hold only under programmatic dependent launch (:func:`.launch.pdl_enabled`),
#: checked before :data:`DEFAULT_CONFIGS`: with the early start and the L2 prefetch of its first
#: tiles, the kernel beat cuBLAS in a decode step where it lost as a lone launch.
#: NOTE: measured on an H200 (2026-12-04, ``pagedlm bench latency --model-config llama-3.1-8b
#: --load-format dummy --batch-size 1``, in CUDA graphs, alternating on one machine): with
#: Llama-3.1-8B's gate_up on this entry a token took 4.23 and 4.23 ms, on cuBLAS 4.36 and 4.40.
PDL_CONFIGS: dict[tuple[int, int], dict[int, GemvConfig | None]] = {
    (28672, 4096): {1: GemvConfig(4, 1024, 1, 4, 1)},
}

#: with PDL, each program asks L2 for its first step's weight tiles before it waits for the
#: previous kernel (``False``: it only waits; an A/B switch for benchmarks)
PREFETCH_FIRST_STEP = True


def gemv_config(t: int, n: int, k: int, pdl: bool = False) -> GemvConfig | None:
    """The table's configuration for ``t`` rows times a ``[n, k]`` weight, or None (F.linear);
    ``pdl``: kernels launch with PDL (:data:`PDL_CONFIGS` first)."""
    if not 1 <= t <= GEMV_MAX_ROWS:
        return None
    rows = triton.next_power_of_2(t)
    if pdl and rows in PDL_CONFIGS.get((n, k), {}):
        return PDL_CONFIGS[(n, k)][rows]
    entry = DEFAULT_CONFIGS.get((n, k))
    return None if entry is None else entry.get(rows)


@triton.jit
def _load_x(x_row, k, k_ok, EVEN_K: tl.constexpr):
    """One row's chunk ``x_row[k]`` (``[1, KB, VEC]``) in float32."""
    if EVEN_K:
        x = tl.load(x_row + k)
    else:
        x = tl.load(x_row + k, mask=k_ok, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, THREADS: tl.constexpr,
):
    """Program ``(n, split)``: ``out[:M, n * BLOCK_N + j] = x @ W[n * BLOCK_N + j]`` over the K
    range ``[split * k_per_split, ...)``. ``BLOCK_M`` (1, 2 or 4) rows of x, each with an
    accumulator of its own (a 4-D ``[rows, N, KB, VEC]`` product made Triton route the weight tile
    through shared memory at every step)."""
    tl.static_assert(BLOCK_M <= 4)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KB: tl.constexpr = BLOCK_K // VEC
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # out-of-range rows re-read the last row (results dropped by the store's mask): no load masks
    # along N or M. Row offsets in int64: N * K may pass 2**31 (an LM head).
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None, None] * stride_wn  # [BLOCK_N, 1, 1]
    x_row0 = x_ptr
    x_row1 = x_ptr + tl.minimum(1, M - 1) * stride_xm
    x_row2 = x_ptr + tl.minimum(2, M - 1) * stride_xm
    x_row3 = x_ptr + tl.minimum(3, M - 1) * stride_xm
    # [vectors, values]: each thread loads whole VEC-value (16-byte) vectors along K
    rk = (tl.arange(0, KB)[:, None] * VEC + tl.arange(0, VEC)[None, :])[None, :, :]  # [1, KB, VEC]
    acc0 = tl.zeros((BLOCK_N, KB), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, KB), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, KB), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, KB), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH:
        # NOTE: the weights are constant through a forward, so they may be read before pdl_wait:
        # the first step's tiles stream into L2 while the previous kernel (a norm, the attention's
        # split combine, SiLU-and-mul) finishes
        first = tl.minimum(k_end - k_start, BLOCK_K) * (16 // VEC)  # bytes of the first step
        prefetch_rows_l2(w_ptr, pid_n * BLOCK_N, N - 1, stride_wn, k_start, first // 16 * 16, BLOCK_N, THREADS)
    pdl_wait(USE_PDL)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + rk
        k_ok = k < k_end
        # NOTE: x before W. Triton gives x's small chunk a layout of its own (fewer values per
        # thread) and converts one of the two operands through shared memory; it keeps the
        # layout of the load it meets last, so this order converts the chunk of x, not the tile
        # of W (Triton 3.9, seen in the compiled TTGIR: the other order moves the whole tile).
        x0 = _load_x(x_row0, k, k_ok, EVEN_K)
        if BLOCK_M > 1:
            x1 = _load_x(x_row1, k, k_ok, EVEN_K)
        if BLOCK_M > 2:
            x2 = _load_x(x_row2, k, k_ok, EVEN_K)
            x3 = _load_x(x_row3, k, k_ok, EVEN_K)
        if EVEN_K:
            w = tl.load(w_rows + k, eviction_policy="evict_first")  # [BLOCK_N, KB, VEC]
        else:
            w = tl.load(w_rows + k, mask=k_ok, other=0.0, eviction_policy="evict_first")
        w = w.to(tl.float32)
        # the sums over a vector's values stay in the thread that loaded it
        acc0 += tl.sum(w * x0, axis=2)
        if BLOCK_M > 1:
            acc1 += tl.sum(w * x1, axis=2)
        if BLOCK_M > 2:
            acc2 += tl.sum(w * x2, axis=2)
            acc3 += tl.sum(w * x3, axis=2)
    # the rows' sums over K stacked into the [BLOCK_M, BLOCK_N] output tile
    rm = tl.arange(0, BLOCK_M)[:, None]
    out = tl.where(rm == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if BLOCK_M > 1:
        out = tl.where(rm == 1, tl.sum(acc1, axis=1)[None, :], out)
    if BLOCK_M > 2:
        out = tl.where(rm == 2, tl.sum(acc2, axis=1)[None, :], out)
        out = tl.where(rm == 3, tl.sum(acc3, axis=1)[None, :], out)
    if HAS_BIAS:
        bias = tl.load(b_ptr + tl.minimum(rn, N - 1)).to(tl.float32)
        # once per output: into split 0's partial (the reduction adds the others to it)
        out += tl.where(pid_k == 0, bias, 0.0)[None, :]
    split_k_store(out, out_ptr, part_ptr, count_ptr, tl.arange(0, BLOCK_M), rn, M, N, stride_om, pid_n, pid_k,
                  SPLIT_K)


def _gemv_eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel can take these inputs (metadata only: no host synchronisation)."""
    if x.dim() != 2 or x.dtype not in _DTYPES or weight.dtype != x.dtype or not 1 <= x.shape[0] <= GEMV_MAX_ROWS:
        return False
    if x.device.type != "cuda" and not _INTERPRET:
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or weight.device != x.device or x.stride(1) != 1:
        return False
    n, k = weight.shape
    if k != x.shape[1] or n == 0 or k == 0:
        return False  # F.linear raises for the mismatch, and has nothing to stream for empty weights
    return bias is None or (bias.dtype == x.dtype and bias.shape == (n,) and bias.stride(0) == 1
                            and bias.device == x.device)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel with ``config``, for inputs :func:`_gemv_eligible`
    accepts: ``[T, N]`` in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    block_k = config.block_k
    # whole steps per split; fewer splits than asked for when K is short
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, config.block_n)
    counters = split_k_counters(x.device, tiles) if split > 1 else None
    if split > 1 and counters is None:
        k_per_split, split = k, 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    pdl = pdl_options(x.device)
    size = x.element_size()
    # the bulk prefetch takes 16-byte aligned rows and split starts
    aligned = weight.data_ptr() % 16 == 0 and weight.stride(0) * size % 16 == 0 and k_per_split * size % 16 == 0
    launch(_dense_gemv_kernel, (tiles, split),
           x, weight, bias if bias is not None else weight, out, part, counters if counters is not None else out,
           m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
           HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_K=k % block_k == 0,
           BLOCK_M=triton.next_power_of_2(m), BLOCK_N=config.block_n, BLOCK_K=block_k, VEC=16 // x.element_size(),
           NUM_STAGES=config.num_stages, PREFETCH=pdl["USE_PDL"] and PREFETCH_FIRST_STEP and aligned,
           THREADS=32 * config.num_warps, num_warps=config.num_warps, **pdl)
    return out


def unquantized_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     _config: GemvConfig | None = None) -> torch.Tensor:
    """See the op's contract in ``pagedlm.core.layers.custom_ops``: the GEMV for the shapes
    :func:`gemv_config` lists, ``F.linear`` otherwise. ``_config`` (tests, benchmarks) replaces
    the table's choice for inputs the kernel can take."""
    if _gemv_eligible(x, weight, bias):
        if _config is not None:
            config = _config
        else:
            pdl = pdl_options(x.device)["USE_PDL"]
            config = gemv_config(x.shape[0], weight.shape[0], weight.shape[1], pdl)
        if config is not None:
            return dense_gemv(x, weight, bias, config)
    return F.linear(x, weight, bias)
