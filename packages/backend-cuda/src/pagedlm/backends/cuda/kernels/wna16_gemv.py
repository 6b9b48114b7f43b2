"""The decode-shaped ``wna16_gemm``: a few rows (``M <= 4``) times packed int4/int8 weights, one launch.

At batch 1 a quantized linear layer is a matrix-vector product whose cost is reading the packed
weights, so the kernel is built to stream them:

- no ``tl.dot`` (a 16-row tensor-core tile would be 16x padding): each program reads a
  ``[KW, BLOCK_N]`` slab of int32 words per step, coalesced along N, and unpacks each of its
  ``32 // bits`` fields with a multiply-add per value into a ``[BLOCK_M, KW, BLOCK_N]`` float32
  accumulator, reduced over K once at the end;
- integer-to-float without conversion instructions (a quarter-rate op): a field masked in place
  and OR-ed into the mantissa of ``2**23`` is the float ``2**23 + q * 2**off`` (``off`` its bit
  offset), so one float subtraction gives ``(q - z) * 2**off`` exactly and the activation is
  pre-multiplied by ``2**-off`` (exact). Fields that reach bit 23 are read from the word shifted
  down once;
- the loads of the next steps can be in flight while a step is unpacked (``NUM_STAGES``: Triton's
  async copies through shared memory; one stage, the default, measured fastest);
- group scales (and zero points) are constant over the ``32 // bits`` values of a word whenever
  the group size is a multiple of it (every layout core produces), so without ``g_idx`` they are
  applied once per word instead of once per value; with ``g_idx`` (act-order) per value;
- split-K for parallelism, reduced in the same launch: each program stores its float32 partial
  tile, counts itself in a per-tile counter (an acquire-release atomic), and the last of a tile's
  programs sums the partials in split order (deterministic) into the output and resets the
  counter. :func:`split_k_counters` holds the counters: zeroed once per device, and every launch
  leaves them zero, so no memset runs per call.

Both kernels of ``quant_gemm`` use :func:`split_k_store` for their split-K epilogue.

NOTE: CUDA-graph safe: no host synchronisation, a grid that depends on the shapes only, and the
counters are allocated (zeroed) at the first call, which is an eager one (start-up compiles and
profiles before capturing); a first call inside a capture takes no split instead. One stream at a
time may run these kernels on a device (the counters are shared).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch, pdl_options, pdl_wait

__all__ = ["gemv_config", "split_k_counters", "split_k_store", "wna16_gemv", "GEMV_MAX_ROWS"]

#: ``wna16_gemm`` takes this kernel for at most this many rows
GEMV_MAX_ROWS = 4
#: output tiles one launch may split (counters per device: 256 KiB)
MAX_SPLIT_TILES = 1 << 16
_MAGIC = 0x4B000000  # the bits of float32 2**23
_MAGIC_F = tl.constexpr(8388608.0)

_counters: dict[torch.device, torch.Tensor] = {}


def split_k_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's zeroed tile counters, or None (use no split) when ``tiles`` exceeds them or
    they would have to be created inside a CUDA-graph capture (a captured memset never runs for
    the eager calls after it)."""
    if tiles > MAX_SPLIT_TILES:
        return None
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _counters[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counters


@triton.jit
def split_k_store(acc, out_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_om, tile, pid_k,
                  SPLIT_K: tl.constexpr):
    """Write output tile ``acc [BLOCK_M, BLOCK_N]`` (float32) of rows ``rm`` and columns ``rn``:
    directly without split; else as split ``pid_k``'s partial, the tile's last program summing
    ``part [SPLIT_K, M, N]`` into ``out`` and zeroing ``count_ptr[tile]``."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        offs = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + pid_k * M * N + offs, acc, mask=mask)
        # every thread's partial is stored before the (release) count is taken
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(SPLIT_K):
                # .cg: from L2, where the other programs' stores are (L1 is not coherent)
                total += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _load_step(qw_ptr, s_ptr, z_ptr, kw, rn, N, k_end, n_ok, GROUP_SIZE: tl.constexpr, PACK: tl.constexpr,
               HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, EVEN: tl.constexpr):
    """Word rows ``kw [1, KW, 1]`` x columns ``rn``: the packed words and, without ``g_idx``,
    their groups' float32 scales and zero points (with ``g_idx``, whose scales are read per value,
    and without zero points, unused placeholders the compiler drops)."""
    tile_ok = ((kw < k_end // PACK) | EVEN) & n_ok
    words = tl.load(qw_ptr + kw * N + rn, mask=tile_ok, other=0)  # [1, KW, BLOCK_N]
    s = words.to(tl.float32)
    z = s
    if not HAS_G_IDX:
        # one group per word (GROUP_SIZE is a multiple of PACK). NOTE: a constexpr, so this is a
        # shift (or a multiply-high): a runtime divisor cost 38 of a step's 728 instructions
        # (sm_90 SASS, Triton 3.9)
        g = (kw * PACK) // GROUP_SIZE
        s = tl.load(s_ptr + g * N + rn, mask=tile_ok, other=0.0).to(tl.float32)
        z = s
        if HAS_ZEROS:
            z = tl.load(z_ptr + g * N + rn, mask=tile_ok, other=0).to(tl.float32)
    return words, s, z


@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_om, k_per_split, magic,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Program ``(n, split)``: rows ``[0, M)`` x columns ``[n * BLOCK_N, ...)`` over the K range
    ``[split * k_per_split, ...)``, in steps of ``KW`` packed words (``KW * 32 // BITS`` values)."""
    pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = 1 << (BITS - 1)  # the symmetric zero point
    # fields whose bits stay below the exponent (bit 23) are read in place; the others after
    # one shift of the word by HI_SHIFT = 32 - 23, which leaves none of them at bit 0. NOTE: a
    # field at bit 0 of a shifted word compiles to a bit-field extract (SHF + SGXT) per value
    # instead of the one LOP3 every other field takes
    DIRECT: tl.constexpr = 23 // BITS
    HI_SHIFT: tl.constexpr = 9
    # everything is [rows, word rows, columns]: broadcasts only along size-1 axes, so the
    # values stay in the registers they were loaded into
    rm = tl.arange(0, BLOCK_M)[:, None, None]
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, None, :]
    rw = tl.arange(0, KW)[None, :, None]
    # EVEN: M == BLOCK_M, N a multiple of BLOCK_N and K of a step, so no load needs a mask (a
    # masked 16-bit load costs a PRMT to zero its register first)
    m_ok = (rm < M) | EVEN
    n_ok = (rn < N) | EVEN
    acc = tl.zeros((BLOCK_M, KW, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    STEP: tl.constexpr = KW * PACK
    if PREFETCH:
        # the next step's words, scales and zero points are loaded into registers before this
        # step is unpacked, so a warp's own loads are in flight during its arithmetic; the last
        # step reloads itself (clamped: an in-bounds address, no mask)
        words_next, s_next, z_next = _load_step(qw_ptr, s_ptr, z_ptr, k_start // PACK + rw, rn, N, k_end, n_ok,
                                                GROUP_SIZE, PACK, HAS_ZEROS, HAS_G_IDX, EVEN)
    # NUM_STAGES > 1: the word and scale loads of the next steps are in flight (async copies
    # through shared memory) while this one is unpacked
    for k0 in tl.range(k_start, k_end, STEP, num_stages=NUM_STAGES):
        kw = k0 // PACK + rw  # word rows [1, KW, 1]
        w_ok = (kw < k_end // PACK) | EVEN
        tile_ok = w_ok & n_ok
        if PREFETCH:
            words, s, z = words_next, s_next, z_next
            k_next = k0 + STEP
            if EVEN:
                k_next = tl.minimum(k_next, k_end - STEP)
            words_next, s_next, z_next = _load_step(qw_ptr, s_ptr, z_ptr, k_next // PACK + rw, rn, N, k_end, n_ok,
                                                    GROUP_SIZE, PACK, HAS_ZEROS, HAS_G_IDX, EVEN)
        else:
            words, s, z = _load_step(qw_ptr, s_ptr, z_ptr, kw, rn, N, k_end, n_ok,
                                     GROUP_SIZE, PACK, HAS_ZEROS, HAS_G_IDX, EVEN)
        hi = words >> HI_SHIFT
        part = tl.zeros((BLOCK_M, KW, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_M, KW, 1), dtype=tl.float32)
        for f in tl.static_range(PACK):
            # bit offset of field f in the word it is read from (the word, or the shifted one)
            OFF = f * BITS - HI_SHIFT * (f >= DIRECT)
            k = kw * PACK + f
            x = tl.load(x_ptr + rm * stride_xm + k, mask=m_ok & w_ok, other=0.0).to(tl.float32)  # [BLOCK_M, KW, 1]
            if f < DIRECT:
                bits = words & (MASK << OFF)
            else:
                bits = hi & (MASK << OFF)
            # NOTE: `magic` (2**23's bits) is an argument, not a constant: in a register it lets
            # ptxas fuse the mask and the OR into one LOP3 (which takes a single immediate); as a
            # constant they stay two, 113 of a step's 728 instructions (sm_90 SASS, Triton 3.6)
            field = (bits | magic).to(tl.float32, bitcast=True)  # 2**23 + q * 2**OFF
            # field * 2**-OFF - 2**(23 - OFF) is q exactly (a power-of-two product, an exact
            # difference), so one multiply-add gives q minus its zero point and x stays unscaled
            scale = 1.0 / (1 << OFF)
            base = _MAGIC_F * scale
            if HAS_G_IDX:
                gk = tl.load(g_ptr + k, mask=w_ok, other=0)
                sk = tl.load(s_ptr + gk * N + rn, mask=tile_ok, other=0.0).to(tl.float32)
                if HAS_ZEROS:
                    zk = tl.load(z_ptr + gk * N + rn, mask=tile_ok, other=0).to(tl.float32)
                    w = (field * scale - (base + zk)) * sk
                else:
                    w = (field * scale - (base + HALF)) * sk
                acc += x * w
            elif HAS_ZEROS:
                # sum x * q here, and x * z through the row sums after the fields
                part += x * (field * scale - base)
                x_sum += x
            else:
                part += x * (field * scale - (base + HALF))
        if not HAS_G_IDX:
            if HAS_ZEROS:
                part -= x_sum * z
            acc += part * s
    rm2 = tl.arange(0, BLOCK_M)
    rn2 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    split_k_store(tl.sum(acc, axis=1), out_ptr, part_ptr, count_ptr, rm2, rn2, M, N, stride_om, pid_n, pid_k,
                  SPLIT_K)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter runs: a small "GPU", so the split path runs too
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_config(m: int, n: int, k: int, bits: int, num_sms: int, *, block_n: int = 64, cells: int = 32,
                programs_per_sm: int = 8) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, KW, k_per_split, SPLIT_K)``: ``cells`` (rows x word rows) x ``block_n``
    columns per step (32 x 64: 8 KiB of weights at one row), split along K until the grid has
    about ``programs_per_sm`` programs per SM, each split keeping at least two steps. The keyword
    arguments are for tuning (``bench_quant.py --sweep-gemv``; the defaults are its best on the
    Llama-3.1-8B shapes at 4 bits, H200, 2026-12-01: 20-28 % faster than 16 x 128 at 4 per SM)."""
    block_m = triton.next_power_of_2(m)
    block_n = block_n if n >= block_n else max(16, triton.next_power_of_2(n))
    kw = max(1, cells // block_m)
    step = kw * (32 // bits)
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(programs_per_sm * num_sms, tiles), k // (2 * step)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), step) * step
    return block_m, block_n, kw, k_per_split, triton.cdiv(k, k_per_split)


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               g_idx: torch.Tensor | None, bits: int, group_size: int, *, num_warps: int = 4,
               num_stages: int | None = None, prefetch: bool = False, **tuning: int) -> torch.Tensor:
    """``wna16_gemm`` for ``x [M <= GEMV_MAX_ROWS, K]`` (contiguous rows): ``[M, N]`` in x's dtype.
    ``num_warps``, ``num_stages`` (default 1; more than 1 with ``g_idx`` would hold ~100 KiB of
    per-value scale gathers in shared memory), ``prefetch`` (the next step's words loaded into
    registers before this one is unpacked; off until a GPU run times it) and ``tuning``
    (:func:`gemv_config`'s keywords) are for tuning runs. NOTE: one stage measured faster than
    three (the sweep's best: the split-K grid keeps enough loads in flight without the async-copy
    pipeline)."""
    m, k = x.shape
    n = qweight.shape[1]
    pack = 32 // bits
    if g_idx is None and group_size % pack:
        raise ValueError(f"group_size={group_size} is not a multiple of the {pack} values of a packed word")
    block_m, block_n, kw, k_per_split, split = gemv_config(m, n, k, bits, _num_sms(x.device), **tuning)
    tiles = triton.cdiv(n, block_n)
    counters = split_k_counters(x.device, tiles) if split > 1 else None
    if split > 1 and counters is None:
        k_per_split, split = k, 1
    num_stages = 1 if num_stages is None else num_stages
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    launch(_gemv_kernel, (tiles, split),
           x, qweight, scales, zeros if zeros is not None else scales, g_idx if g_idx is not None else qweight,
           out, part, counters if counters is not None else qweight,
           m, n, k, x.stride(0), out.stride(0), k_per_split, _MAGIC,
           # (act-order reads each value's group from g_idx: one variant for every group size)
           GROUP_SIZE=group_size if g_idx is None else pack,
           BITS=bits, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None, SPLIT_K=split,
           BLOCK_M=block_m, BLOCK_N=block_n, KW=kw, NUM_STAGES=num_stages, num_warps=num_warps,
           EVEN=m == block_m and n % block_n == 0 and k % (kw * pack) == 0, PREFETCH=prefetch,
           **pdl_options(x.device))
    return out
