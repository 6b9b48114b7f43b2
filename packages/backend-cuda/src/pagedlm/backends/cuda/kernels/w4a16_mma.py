"""The W4A16 GEMV on tensor cores: up to 8 rows times int4 weights, one launch (CUDA C++, NVRTC).

At batch 1 a 4-bit linear layer is bound by reading its packed weights, but a GEMV that unpacks
each value into a float32 multiply-add spends ~4 instructions per value and runs out of issue
slots before it runs out of bandwidth (docs/quantization.md). Here the dot products run on
``mma.sync.m16n8k16`` (bf16/fp16 in, float32 accumulate) with the activation rows as the 8-wide
operand (its columns past M are computed and dropped), and a weight value costs about 2.2
instructions with the loop's bookkeeping (under 1 in the unpacking itself):

- the weights are stored in the **mma layout** (:func:`mma_repack`): each lane of a warp loads
  one 16-byte word group per 64 values of K and finds in it exactly its four A-fragment
  registers of four mma steps. A fragment register is two values of one row in the 4-bit fields
  ``p`` and ``p + 4`` of a word, so ``(word >> 4p) & 0x000F000F | MAGIC`` is the pair
  ``(128 + q_lo, 128 + q_hi)`` as bf16 (``1024 + q`` as fp16) in one LOP3. In bf16 the pairs
  go into the mma as they are and a second mma of the pairs ``-(128 + z)`` with the same
  activations takes bias and zero point off in the float32 sum; in fp16 one packed fused
  multiply-add subtracts ``1024 + z`` exactly (that bias would cost the float32 sums 10 bits);
- the order of K inside each 64-value block is permuted the same way in weights and activations
  (the mma sums over it), so that a lane's activations are 16 consecutive values: two 16-byte
  loads per block;
- a group's scales (and zero points) are applied once per group and row, to a float32 partial
  sum: ``group_size`` is a multiple of 64 (or per channel). They are read into a ring of
  registers ahead of use, and where ``STAGES`` is a multiple of the group's blocks
  (``GROUP_KB``) the group ends are fixed slots of the unrolled loop;
- each warp streams a K slice of one 16-row tile through a ring of ``STAGES`` 512-byte blocks in
  shared memory (``cp.async``), the slices sized so the grid is about one wave; with PDL the
  first blocks are requested before ``griddepcontrol.wait`` (weights are constant), so they
  load during the previous kernel's tail, and ``griddepcontrol.launch_dependents`` follows the
  wait, so the next kernel's launch overlaps this one (as the Triton kernels' ``pdl_wait``);
- with ``BULK`` (``PAGEDLM_CUDA_W4A16_BULK=1``, sm_90+, opt-in until timed) lane 0 brings each
  block into its slot with one bulk copy completing on the slot's mbarrier, instead of each
  lane's 16-byte ``cp.async``;
- the warps of a block take consecutive K slices of one 16-row tile and are summed through
  shared memory; blocks along K (``SPLIT``) through float32 partials and a per-tile counter (the
  protocol of :func:`.wna16_gemv.split_k_store`: the last block sums the partials in split
  order, deterministic, and resets the counter).

Element ``(k, n)`` of the logical ``[K, N]`` weight, with ``n = 16 nt + 8 rh + g`` and
``k = 64 kb + 16 t + 4 j + 2 ch + h``, is field ``4 h + 2 ch + rh`` of int32 word
``((nt * K / 64 + kb) * 32 + 4 g + t) * 4 + j`` (see :func:`mma_word_and_shift`).

NOTE: CUDA-graph safe as the Triton GEMVs are: the grid depends on the shapes only, the counters
are created by an eager call, every launch leaves them zero, and the kernels are compiled and
loaded when the weights are repacked (:func:`prepare_mma_kernel`), never inside a capture.
"""

from __future__ import annotations

import logging
import os
from functools import cache

import torch

from pagedlm.backends.cuda.kernels.fp8_gemm import num_sms
from pagedlm.backends.cuda.kernels.launch import pdl_options
from pagedlm.backends.cuda.kernels.wna16_gemv import split_k_counters

__all__ = ["CHUNKED_MAX_ROWS", "MMA_MAX_ROWS", "mma_config", "mma_layout_supported", "mma_repack", "mma_unpack",
           "mma_word_and_shift", "prepare_mma_kernel", "w4a16_mma_gemv"]

logger = logging.getLogger(__name__)

#: the kernel's rows: the mma's N dimension
MMA_MAX_ROWS = 8
#: rows up to which a batch runs the kernel once per 8 rows (re-reading the weights each time);
#: past it, dense chunks and cuBLAS (:mod:`.w4a16_dequant`). One layer of Llama-3.1-8B at 8 rows
#: took 59 us, the dequantized path at 16 rows 908 us (H100, 2026-12-07, its 2-byte stores; a
#: third of that expected with its 16-byte stores), bf16 cuBLAS 152 us; ``bench_quant.py
#: --sweep-batch`` measures the crossover
CHUNKED_MAX_ROWS = 32

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

#if FP16
#define MAGIC 0x64006400u
#define MMA_TYPE "f16"
#else
#define MAGIC 0x43004300u
#define MMA_TYPE "bf16"
#endif

// 16 bytes global -> shared, bypassing L1 and registers (the weights are read once)
__device__ __forceinline__ void cp_async16(uint4* dst, const uint4* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src));
}

#if BULK
// Hopper's bulk copy engine (TMA, one lane issues a whole block) and its completion barriers
__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bulk_block(uint4* dst, const uint4* src, unsigned long long* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 512;" :: "r"(smem(bar)) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 512, [%2];"
                 :: "r"(smem(dst)), "l"(src), "r"(smem(bar)) : "memory");
}

__device__ __forceinline__ void bulk_wait(unsigned long long* bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem(bar)), "r"(parity) : "memory");
    }
}
#endif

__device__ __forceinline__ uint4 ld_x(const u16* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// (word & 0x000F000F) | MAGIC: the pair (MAGIC + field 0, MAGIC + field 4), exact
__device__ __forceinline__ u32 fields(u32 w) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(w), "r"(0x000F000Fu), "r"(MAGIC));
    return d;
}

// a * 1 + neg_zero: the pair minus (MAGIC + z), exact (small integers)
__device__ __forceinline__ u32 unbias(u32 a, u32 neg_zero) {
    u32 d;
#if FP16
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(0x3C003C00u), "r"(neg_zero));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(0x3F803F80u), "r"(neg_zero));
#endif
    return d;
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// (a 16-bit value in the low half)
__device__ __forceinline__ float to_float(u32 v) {
#if FP16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)v));
    return f;
#else
    return __uint_as_float(v << 16);
#endif
}

__device__ __forceinline__ u16 from_float(float v) {
    u16 r;
#if FP16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
#endif
    return r;
}

// the negated bias operand of a zero point z: -(MAGIC + z) in both halves
__device__ __forceinline__ u32 neg_zero(int z) {
    return (MAGIC | (u32)z | ((u32)z << 16)) ^ 0x80008000u;
}

// Block (tile nt, split s): rows [16 nt, 16 nt + 16) of the output; warp w takes the K blocks of 64
// [kb0, kb0 + kb_per_warp) with kb0 = (s * WARPS + w) * kb_per_warp (clipped to K), streamed
// through a ring of STAGES blocks of 512 bytes in shared memory (one commit group each, so the
// wait for the oldest is a constant count).
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
w4a16_mma_gemv(const uint4* __restrict__ qw, const u16* __restrict__ scales, const int* __restrict__ zeros,
               const u16* __restrict__ x, u16* __restrict__ out, float* __restrict__ part,
               int* __restrict__ counters, int M, int N, int K, int stride_xm, int stride_om, int group_size,
               int kb_per_warp) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nt = blockIdx.x, split = blockIdx.y;
    const int kbt = K >> 6;
    const int kb0 = (split * WARPS + warp) * kb_per_warp;
    const int kb_end = min(kb0 + kb_per_warp, kbt);
    const int n_lo = nt * 16 + g;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    __shared__ uint4 ring[WARPS][STAGES][32];
#if BULK
    __shared__ unsigned long long full[WARPS][STAGES];  // a block has landed in the slot
#endif
    if (kb0 < kb_end) {
        const uint4* wp = qw + ((size_t)nt * kbt + kb0) * 32 + lane;
        const int count = kb_end - kb0;
#if BULK
        // lane 0 copies each 512-byte block with one bulk request (the copy engine, not 32 lanes'
        // 16-byte copies through the load/store unit); the slot's barrier says when it landed
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < STAGES; ++i)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem(&full[warp][i])) : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#pragma unroll
            for (int i = 0; i < STAGES; ++i)
                if (i < count) bulk_block(ring[warp][i], wp + i * 32, &full[warp][i]);
        }
        __syncwarp();
#else
#pragma unroll
        for (int i = 0; i < STAGES; ++i) {
            if (i < count) cp_async16(&ring[warp][i][lane], wp + i * 32);
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
#endif
        const int group_kb = group_size >> 6;
        const int grp = kb0 / group_kb;
#if !GROUP_KB
        int group_left = min((grp + 1) * group_kb, kb_end) - kb0;  // blocks until the group's end
#endif
        // A group's scales (and zero points) are read RING groups ahead of their use (each is a
        // DRAM read of its own, which would otherwise stall the warp once a group) into a ring of
        // registers: with static group ends slot group s of the unrolled loop owns entry s, else
        // the ring shifts. The offsets stop at the slice's last group (a repeat read is harmless).
#if GROUP_KB
#define RING (STAGES / GROUP_KB)
#else
#define RING 3
#endif
        const int last_at = (kb_end - 1) / group_kb * N + n_lo;
        int ahead = grp * N + n_lo;  // NOTE: K / 64 * N < 2^31 for any model
        u32 sc[RING][2];
#if HAS_ZEROS
        int zp[RING][2];
#endif
#pragma unroll
        for (int d = 0; d < RING; ++d) {
            if (d) ahead = min(ahead + N, last_at);
            sc[d][0] = scales[ahead];
            sc[d][1] = scales[ahead + 8];
#if HAS_ZEROS
            zp[d][0] = zeros[ahead];
            zp[d][1] = zeros[ahead + 8];
#endif
        }
#if HAS_ZEROS
        u32 z_lo = neg_zero(zp[0][0]), z_hi = neg_zero(zp[0][1]);
#else
        const u32 z_lo = neg_zero(8), z_hi = neg_zero(8);
#endif
#if PDL
        // everything above read weights only; the activations may come from the kernel before.
        // Then the next kernel may launch (its own wait holds it until this grid has finished),
        // so its launch and its constant loads overlap this kernel's stream.
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
        // NOTE: lanes past the M rows read row M - 1: their mma columns are never stored
        const u16* xp = x + (size_t)min(g, M - 1) * stride_xm + (size_t)kb0 * 64 + t * 16;
        const uint4* wnext = wp + STAGES * 32;
        // two accumulator sets (the weights' and the zero points' mma steps, or even and odd
        // steps for fp16): shorter dependency chains
        float even[4] = {0.f, 0.f, 0.f, 0.f}, odd[4] = {0.f, 0.f, 0.f, 0.f};
        for (int i0 = 0; i0 < count; i0 += STAGES) {
#pragma unroll
            for (int slot = 0; slot < STAGES; ++slot) {
                const int i = i0 + slot;
                if (i >= count) break;
#if BULK
                bulk_wait(&full[warp][slot], (u32)(i / STAGES) & 1u);
                const uint4 wi = ring[warp][slot][lane];
                // NOTE: every lane has read the slot before lane 0 refills it, and the copy
                // engine's write is ordered after those reads (a proxy fence)
                __syncwarp();
                if (lane == 0 && i + STAGES < count) {
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                    bulk_block(ring[warp][slot], wnext, &full[warp][slot]);
                }
#else
                asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1) : "memory");
                // NOTE: a lane reads back only what it copied, so its own wait suffices, and its
                // next copy into this slot is ordered after this read
                const uint4 wi = ring[warp][slot][lane];
                if (i + STAGES < count) cp_async16(&ring[warp][slot][lane], wnext);
                asm volatile("cp.async.commit_group;" ::: "memory");
#endif
                wnext += 32;
                // the activations: 2 KiB a row, L1-resident after the first warps of the SM
                const uint4 xa = ld_x(xp), xb = ld_x(xp + 8);
                xp += 64;
                const u32 b[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                const u32 q[4] = {wi.x, wi.y, wi.z, wi.w};
#if GROUP_KB
                if (slot % GROUP_KB == 0) {  // a group's first step: its mma add to zeros (RZ)
#pragma unroll
                    for (int c = 0; c < 4; ++c) even[c] = odd[c] = 0.f;
#if HAS_ZEROS
                    z_lo = neg_zero(zp[slot / GROUP_KB][0]);
                    z_hi = neg_zero(zp[slot / GROUP_KB][1]);
#endif
                }
#endif
#pragma unroll
                for (int j = 0; j < 4; ++j) {
#if FP16
                    mma(j & 1 ? odd : even, unbias(fields(q[j]), z_lo), unbias(fields(q[j] >> 4), z_hi),
                        unbias(fields(q[j] >> 8), z_lo), unbias(fields(q[j] >> 12), z_hi), b[2 * j], b[2 * j + 1]);
#else
                    // the pairs 128 + q as they are, and -(128 + z) times the same activations
                    // as a second mma: 1 instruction where unbiasing the pairs takes 4
                    mma(even, fields(q[j]), fields(q[j] >> 4), fields(q[j] >> 8), fields(q[j] >> 12),
                        b[2 * j], b[2 * j + 1]);
                    mma(odd, z_lo, z_hi, z_lo, z_hi, b[2 * j], b[2 * j + 1]);
#endif
                }
#if GROUP_KB
                // slices start at a group and STAGES is a multiple of GROUP_KB: the group ends
                // are fixed slots of the unrolled loop (neither a branch nor predicated code)
                if ((slot + 1) % GROUP_KB == 0) {
                    const int r = slot / GROUP_KB;  // this slot group's ring entry
#else
                if (--group_left == 0) {  // the group's (or the slice's) last block
                    const int r = 0;  // the ring shifts
#endif
                    const float s_lo = to_float(sc[r][0]), s_hi = to_float(sc[r][1]);
                    acc[0] += s_lo * (even[0] + odd[0]);
                    acc[1] += s_lo * (even[1] + odd[1]);
                    acc[2] += s_hi * (even[2] + odd[2]);
                    acc[3] += s_hi * (even[3] + odd[3]);
                    ahead = min(ahead + N, last_at);  // the group RING ahead
#if GROUP_KB
                    sc[r][0] = scales[ahead];
                    sc[r][1] = scales[ahead + 8];
#if HAS_ZEROS
                    zp[r][0] = zeros[ahead];
                    zp[r][1] = zeros[ahead + 8];
#endif
#else
#pragma unroll
                    for (int c = 0; c < 4; ++c) even[c] = odd[c] = 0.f;
                    group_left = min(group_kb, count - i - 1);
#pragma unroll
                    for (int d = 0; d + 1 < RING; ++d) {
                        sc[d][0] = sc[d + 1][0];
                        sc[d][1] = sc[d + 1][1];
#if HAS_ZEROS
                        zp[d][0] = zp[d + 1][0];
                        zp[d][1] = zp[d + 1][1];
#endif
                    }
                    sc[RING - 1][0] = scales[ahead];
                    sc[RING - 1][1] = scales[ahead + 8];
#if HAS_ZEROS
                    zp[RING - 1][0] = zeros[ahead];
                    zp[RING - 1][1] = zeros[ahead + 8];
                    z_lo = neg_zero(zp[0][0]);
                    z_hi = neg_zero(zp[0][1]);
#endif
#endif
                }
            }
        }
    }
#if PDL
    // (a warp without K blocks: before any output store or counter, as the others)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    // C fragment: acc[c] is output row g + 8 (c >> 1), activation row 2 t + (c & 1)
    __shared__ float red[WARPS][4][32];
    __shared__ int last;
#pragma unroll
    for (int c = 0; c < 4; ++c) red[warp][c][lane] = acc[c];
    __syncthreads();
    const int n0 = nt * 16;
    for (int e = threadIdx.x; e < 16 * M; e += WARPS * 32) {
        const int r = e & 15, m = e >> 4;
        const int src = (r & 7) * 4 + (m >> 1), c = (r >> 3) * 2 + (m & 1);
        float v = 0.f;
#pragma unroll
        for (int ww = 0; ww < WARPS; ++ww) v += red[ww][c][src];
        if (gridDim.y == 1) out[(size_t)m * stride_om + n0 + r] = from_float(v);
        else part[((size_t)split * M + m) * N + n0 + r] = v;
    }
    if (gridDim.y == 1 || counters == nullptr) return;  // no counters: the caller sums the partials
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + nt, 1) == (int)gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int e = threadIdx.x; e < 16 * M; e += WARPS * 32) {
        const int r = e & 15, m = e >> 4;
        float v = 0.f;
        for (int s = 0; s < (int)gridDim.y; ++s) v += ld_cg(part + ((size_t)s * M + m) * N + n0 + r);
        out[(size_t)m * stride_om + n0 + r] = from_float(v);
    }
    if (threadIdx.x == 0) atomicExch(counters + nt, 0);
}
"""


def mma_layout_supported(bits: int, group_size: int, has_g_idx: bool, k: int, n: int, dtype: torch.dtype,
                         device: torch.device) -> bool:
    """Whether a ``wna16_gemm`` weight of these properties is stored in the mma layout (and read
    by this kernel). NOTE: a function of its arguments and of the process alone, so the repack at
    load time and every later call agree."""
    return (bits == 4 and not has_g_idx and k % 64 == 0 and n % 16 == 0 and group_size % 64 == 0
            and dtype in (torch.bfloat16, torch.float16) and device.type == "cuda" and _mma_available(device))


@cache
def _mma_available(device: torch.device) -> bool:
    # PAGEDLM_CUDA_W4A16_MMA=0: the Triton kernels and GPTQ's layout instead (A/B measurements)
    if os.environ.get("PAGEDLM_CUDA_W4A16_MMA", "1") == "0" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        _kernel(device, False, False, 4, 4, 2, False)
    except Exception as e:  # noqa: BLE001 - no NVRTC, or it cannot compile: the Triton kernels stay
        logger.warning("W4A16 tensor-core GEMV unavailable (%s); using the Triton GEMV", e)
        return False
    return True


#: resident warps per SM a kernel is compiled for (64 registers a thread allow 32 of 64)
WARPS_PER_SM = 32


@cache
def bulk_copies(device: torch.device) -> bool:
    """Whether the GEMV streams its weight blocks with Hopper's bulk copies (one lane a block,
    the copy engine, an mbarrier a ring slot) instead of each lane's 16-byte ``cp.async``:
    ``PAGEDLM_CUDA_W4A16_BULK=1`` on sm_90 and later; off by default until timed on a GPU."""
    value = os.environ.get("PAGEDLM_CUDA_W4A16_BULK", "0")
    if value not in ("0", "1"):
        raise ValueError(f"PAGEDLM_CUDA_W4A16_BULK={value!r}: expected 0 or 1")
    return value == "1" and torch.cuda.get_device_capability(device) >= (9, 0)


@cache
def _kernel(device: torch.device, fp16: bool, has_zeros: bool, warps: int, stages: int, group_kb: int,
            bulk: bool):
    from pagedlm.backends.cuda.nvrtc import Kernel, compile_cubin

    major, minor = torch.cuda.get_device_capability(device)
    defines = {"FP16": fp16, "HAS_ZEROS": has_zeros, "WARPS": warps, "STAGES": stages, "GROUP_KB": group_kb,
               "MIN_BLOCKS": max(1, WARPS_PER_SM // warps), "PDL": pdl_options(device)["USE_PDL"], "BULK": bulk}
    kernel = Kernel(compile_cubin(_SOURCE, "w4a16_mma_gemv", major * 10 + minor, defines), "w4a16_mma_gemv", device)
    kernel.prefer_shared_memory()
    return kernel


def prepare_mma_kernel(device: torch.device, n: int, k: int, group_size: int, dtype: torch.dtype,
                       has_zeros: bool) -> None:
    """Build the kernel variant an ``[*, k] x [k, n]`` product will launch (NVRTC and the module
    load must not run inside a CUDA-graph capture)."""
    _, warps, _, stages, group_kb = mma_config(n, k, group_size, num_sms(device))
    _kernel(device, dtype == torch.float16, has_zeros, warps, stages, group_kb, bulk_copies(device))


def mma_word_and_shift(k: torch.Tensor, n: torch.Tensor, k_total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For logical weight elements ``(k, n)`` (broadcast int tensors): the index of the int32 word
    of the mma layout holding each, and the bit offset of its 4-bit field."""
    nt, rh, g = n >> 4, (n >> 3) & 1, n & 7
    kb, t, j, ch, h = k >> 6, (k >> 4) & 3, (k >> 2) & 3, (k >> 1) & 1, k & 1
    word = ((nt * (k_total // 64) + kb) * 32 + g * 4 + t) * 4 + j
    return word, 4 * (4 * h + 2 * ch + rh)


def mma_repack(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight [K // 8, N]`` int32 of the reference (GPTQ, K-major) layout -> the same values in
    the mma layout (same shape and dtype). Pure torch (runs on any device); the fields go through
    one byte each, so the temporaries are about 4 bytes per weight (gate/up of an 8B model: ~0.5 GB),
    not the 32 an int64 unpack would take."""
    kw, n = qweight.shape
    k = kw * 8
    q = torch.empty(kw, 8, n, dtype=torch.uint8, device=qweight.device)
    for f in range(8):
        q[:, f] = ((qweight >> (4 * f)) & 15).to(torch.uint8)  # [K, N] once viewed: k = 8 kw + f
    # k = (kb, t, j, ch, h), n = (nt, rh, g) -> words (nt, kb, g, t, j), fields (h, ch, rh)
    q = q.view(k // 64, 4, 4, 2, 2, n // 16, 2, 8).permute(5, 0, 7, 1, 2, 4, 3, 6).reshape(-1, 8)
    words = torch.zeros(q.shape[0], dtype=torch.int64, device=qweight.device)
    for f in range(8):
        words |= q[:, f].to(torch.int64) << (4 * f)
    return (words - ((words >> 31) << 32)).to(torch.int32).view(kw, n)  # wrap to int32's range


def mma_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The logical ``[K, N]`` 4-bit values (int32) of an mma-layout ``[K // 8, N]`` tensor."""
    kw, n = packed.shape
    k = kw * 8
    word, shift = mma_word_and_shift(torch.arange(k, device=packed.device)[:, None],
                                     torch.arange(n, device=packed.device)[None, :], k)
    return (packed.reshape(-1)[word] >> shift) & 15


def mma_config(n: int, k: int, group_size: int, sms: int, *, warps: int | None = None, stages: int = 4,
               warps_per_sm: int | None = None) -> tuple[int, int, int, int, int]:
    """``(kb_per_warp, WARPS, SPLIT, STAGES, GROUP_KB)``: K is cut into as many slices (one a
    warp) as keep the grid near ``warps_per_sm`` warps per SM (one wave, each warp streaming its
    slice through ``stages`` in-flight blocks), ``warps`` slices to a block, ``SPLIT`` blocks along
    K. ``GROUP_KB`` is the group's K blocks where ``stages`` is a multiple of them (the slices are
    then whole groups and the kernel applies the scales at fixed loop slots), else 0 (a count).

    Defaults (``bench_quant.py --sweep-mma``, Llama-3.1-8B at one row, H100, 2026-12-07): 4 stages;
    at most 512 row tiles (q/k/v, o, down) 8 warps a block sized for 16 warps per SM, more tiles
    (gate/up) 4 warps sized for 32: 60.0 us a layer against 66.7 for the best single setting and
    68.5 for the Triton GEMV; after the kernel's later changes 51.6 us, each product within 0.3 us
    of its best setting."""
    tiles, kbt = n // 16, k // 64
    few_tiles = tiles <= 512
    warps = warps or (8 if few_tiles else 4)
    warps_per_sm = warps_per_sm or (16 if few_tiles else 32)
    slices = max(1, min(kbt, sms * warps_per_sm // tiles))
    kb = -(-kbt // slices)
    group_kb = group_size // 64 if stages % (group_size // 64) == 0 else 0
    if group_kb:
        kb = -(-kb // group_kb) * group_kb
    slices = -(-kbt // kb)
    warps = min(warps, slices)
    return kb, warps, -(-slices // warps), stages, group_kb


def w4a16_mma_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group_size: int, **tuning: int) -> torch.Tensor:
    """``x [M, K]`` (bf16/fp16) times the mma-layout int4 ``qweight`` (``[K // 8, N]``) with
    ``scales [K // G, N]`` (x's dtype) and ``zeros [K // G, N]`` int32 or None (symmetric: 8):
    ``[M, N]`` in x's dtype; one launch per :data:`MMA_MAX_ROWS` rows. ``tuning``:
    :func:`mma_config`'s keywords, and ``bulk`` (see :func:`bulk_copies`)."""
    bulk = tuning.pop("bulk", None)
    bulk = bulk_copies(x.device) if bulk is None else bool(bulk)
    m, k = x.shape
    n = qweight.shape[1]
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # 16-byte activation loads
    kb, warps, split, stages, group_kb = mma_config(n, k, group_size, num_sms(x.device), **tuning)
    tiles = n // 16
    counters = split_k_counters(x.device, tiles) if split > 1 else None
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    part = torch.empty(split * min(m, MMA_MAX_ROWS) * n, dtype=torch.float32, device=x.device) if split > 1 else None
    kernel = _kernel(x.device, x.dtype == torch.float16, zeros is not None, warps, stages, group_kb, bulk)
    for r0 in range(0, m, MMA_MAX_ROWS):
        rows = min(MMA_MAX_ROWS, m - r0)
        # NOTE: row chunks run in stream order, so one partial buffer and the counters serve all
        kernel((tiles, split, 1), warps * 32, qweight, scales, zeros, x[r0:r0 + rows], out[r0:r0 + rows], part,
               counters, rows, n, k, x.stride(0), out.stride(0), group_size, kb,
               pdl=pdl_options(x.device)["USE_PDL"])
        if split > 1 and counters is None:  # (a first call inside a graph capture: no counters yet)
            out[r0:r0 + rows] = part[:split * rows * n].view(split, rows, n).sum(dim=0)
    return out
