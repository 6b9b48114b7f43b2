/*
 * Q8_0, Q4_K and Q6_K weights times int8 activations on AMX tiles (AMX-INT8: Intel Sapphire Rapids
 * and later): the opt-in int8-activation path of gguf_mul_mat (pagedlm.backends.cpu.kernels.gguf_ops)
 * for any number of x rows, where the CPU has AMX.
 *
 * The arithmetic is gguf_q8_act.c's: each x row is rounded to int8 per 32 values (scale amax / 127,
 * round half to even) and a weight block times an x block is an exact integer dot product, scaled
 * once by the two blocks' scales and summed over the blocks in float32. Here the integer dots of 16
 * weight rows x 16 x rows come from one tile multiply (TDPBSSD: signed x signed bytes, so a Q8_0
 * weight of -128 is exact) per 32-value block (16 for Q6_K's 16-value scales):
 *   A tile (16 x 32 bytes): 16 weight rows' values of the block, read in place from the GGUF rows
 *     (Q8_0: the block's 32 bytes, at the row stride) or from the rows' super-block unpacked to one
 *     byte per value (Q4_K nibbles, Q6_K 6-bit values minus 32);
 *   B tile (8 x 64 bytes): the block of 16 x rows in the tiles' 4-byte interleave,
 *     B[j][4 m + t] = xq[m][4 j + t], laid out that way once when x is quantized;
 *   C tile (16 x 16 int32): stored, converted and added to float32 sums acc[n][m] with the scale
 *     d_w[n] * d_x[m] (Q4_K also subtracts dmin * mn * d_x[m] * sum(xq[m] of the block)).
 * A row's result depends only on its own values, never on the other rows of the batch.
 *
 * NOTE: AMX state is per thread: every thread that runs tiles loads the tile configuration first,
 * and the process must have asked the kernel for the tile data (pagedlm_gguf_amx_init).
 * NOTE: built into every build of the library with function-level targets, so the other builds'
 * code is unchanged; the Python side calls it only where /proc/cpuinfo lists amx_int8.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_common.h"

enum { Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
#define TILE 16          /* weight rows (and x rows) per tile */
#define XBLK 512         /* bytes of one 32-value block of 16 x rows in the B layout */
#define M_CHUNK 256      /* x rows whose int8 blocks stay in a core's L2 while every weight tile passes */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#include <immintrin.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <omp.h>

#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,amx-tile,amx-int8")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles: 0 and 5 C (16 x 16 int32); 1 A (16 x 32 bytes) and 2 B (8 x 64) for 32-value blocks; 3 and 6
 * A (16 x 16), 4 and 7 B (4 x 64) for the two 16-value halves of a Q6_K block */
AMX_TARGET static void load_tile_config(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = 16; c.colsb[0] = 64;
    c.rows[1] = 16; c.colsb[1] = 32;
    c.rows[2] = 8;  c.colsb[2] = 64;
    c.rows[3] = 16; c.colsb[3] = 16;
    c.rows[4] = 4;  c.colsb[4] = 64;
    c.rows[5] = 16; c.colsb[5] = 64;
    c.rows[6] = 16; c.colsb[6] = 16;
    c.rows[7] = 4;  c.colsb[7] = 64;
    _tile_loadconfig(&c);
}

/* 0 when this process may use AMX tiles (asks the kernel once), else -1 */
int pagedlm_gguf_amx_init(void) {
    static int state = 1; /* 1: not asked yet */
    if (state == 1) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
    return state;
}

/*
 * x rows [m0, m0 + rows) -> int8 blocks in the B layout (16-row tiles, zero rows past the end), the
 * blocks' scales d [tile][block][16] and d * sum(q) [tile][block][16]. The rounding is
 * gguf_q8_act.c's quantize_row: q = lrintf(x * (127 / amax)) (the vector conversion rounds half to
 * even as lrintf does under the default mode), d = amax / 127.
 */
AMX_TARGET static void quantize_tiles(const float *x, int64_t K, int64_t rows, int8_t *xq, float *d, float *ds) {
    const int64_t nb = K / 32, tiles = (rows + TILE - 1) / TILE;
    memset(xq, 0, (size_t)(tiles * nb * XBLK));
    memset(d, 0, (size_t)(tiles * nb * TILE) * sizeof(float));
    memset(ds, 0, (size_t)(tiles * nb * TILE) * sizeof(float));
    for (int64_t m = 0; m < rows; m++) {
        const int64_t t = m / TILE, lane = m % TILE;
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + m * K + 32 * b;
            __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m512 s = _mm512_set1_ps(inv);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, s)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, s));
            int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            int32_t words[8];
            _mm_storeu_si128((__m128i *)words, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(words + 4), _mm512_cvtepi32_epi8(q1));
            int32_t *blk = (int32_t *)(xq + (t * nb + b) * XBLK);
            for (int j = 0; j < 8; j++) blk[j * TILE + lane] = words[j];
            d[(t * nb + b) * TILE + lane] = amax / 127.0f;
            ds[(t * nb + b) * TILE + lane] = (amax / 127.0f) * (float)sum;
        }
    }
}

/* acc[n] (16 x rows) += C[n] * (dx * sw[n]) for the 16 weight rows of the C tile in `c` */
AMX_TARGET static inline void add_scaled(const int32_t *c, __m512 dx, const float *sw, __m512 *acc) {
    for (int n = 0; n < TILE; n++) {
        __m512 cf = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + TILE * n));
        acc[n] = _mm512_fmadd_ps(cf, _mm512_mul_ps(dx, _mm512_set1_ps(sw[n])), acc[n]);
    }
}

/* 16 rows of Q4_K super-block `sb` -> values 0..15, one byte each (a [16][256] buffer), and the
 * 8 sub-blocks' scales d * sc and offsets dmin * mn */
AMX_TARGET static void unpack_q4k(const uint8_t *w, int64_t row_bytes, int64_t sb, uint8_t *vals, float *sc,
                                  float *mn) {
    for (int n = 0; n < TILE; n++) {
        const uint8_t *blk = w + n * row_bytes + sb * 144;
        const float dw = half_to_float(blk), dmin = half_to_float(blk + 2);
        for (int j = 0; j < 8; j++) {
            int s, m;
            k4_scale_min(blk + 4, j, &s, &m);
            sc[8 * n + j] = dw * (float)s;
            mn[8 * n + j] = dmin * (float)m;
        }
        for (int p = 0; p < 4; p++) {
            __m256i u = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * p));
            _mm256_storeu_si256((__m256i *)(vals + 256 * n + 64 * p), _mm256_and_si256(u, _mm256_set1_epi8(0x0F)));
            _mm256_storeu_si256((__m256i *)(vals + 256 * n + 64 * p + 32),
                                _mm256_and_si256(_mm256_srli_epi16(u, 4), _mm256_set1_epi8(0x0F)));
        }
    }
}

/* 16 rows of Q6_K super-block `sb` -> values -32..31, one byte each, and the 16 scales d * sc */
AMX_TARGET static void unpack_q6k(const uint8_t *w, int64_t row_bytes, int64_t sb, int8_t *vals, float *sc) {
    for (int n = 0; n < TILE; n++) {
        const uint8_t *blk = w + n * row_bytes + sb * 210;
        const float dw = half_to_float(blk + 208);
        for (int g = 0; g < 16; g++) sc[16 * n + g] = dw * (float)((const int8_t *)(blk + 192))[g];
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            for (int k = 0; k < 4; k++) {
                __m256i low = _mm256_loadu_si256((const __m256i *)(ql + 32 * (k & 1)));
                low = _mm256_and_si256(k < 2 ? low : _mm256_srli_epi16(low, 4), _mm256_set1_epi8(0x0F));
                __m256i high = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)qh), 2 * k),
                                                _mm256_set1_epi8(3));
                __m256i v = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
                _mm256_storeu_si256((__m256i *)(vals + 256 * n + 32 * (4 * h + k)), v);
            }
        }
    }
}

/*
 * One tile of 16 weight rows (rows of `row_bytes`, `w` the first) against `tiles` x tiles: y rows
 * [16 t, 16 t + 16) of columns n0..n0 + nrows. `vals` is a [16][256] byte buffer, `acc` a
 * [tiles][16] array of 16-float registers.
 */
AMX_TARGET static void weight_tile(int qtype, const uint8_t *w, int64_t row_bytes, int64_t K, const int8_t *xq,
                                   const float *d, const float *ds, int64_t tiles, int64_t rows, uint8_t *vals,
                                   __m512 *acc, float *y, int64_t ldy, int64_t nrows) {
    const int64_t nb = K / 32;
    int32_t c[TILE * TILE] __attribute__((aligned(64)));
    int32_t c1[TILE * TILE] __attribute__((aligned(64)));
    float sw[TILE * 16], mw[TILE * 8], col[TILE], col1[TILE];
    for (int64_t i = 0; i < tiles * TILE; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int j = (int)(b % 8);
        if (qtype == Q8_0) {
            for (int n = 0; n < TILE; n++) col[n] = half_to_float(w + n * row_bytes + b * 34);
            _tile_loadd(1, w + b * 34 + 2, row_bytes);
        } else if (qtype == Q4_K) {
            if (j == 0) unpack_q4k(w, row_bytes, b / 8, vals, sw, mw);
            for (int n = 0; n < TILE; n++) { col[n] = sw[8 * n + j]; col1[n] = mw[8 * n + j]; }
            _tile_loadd(1, vals + 32 * j, 256);
        } else {
            if (j == 0) unpack_q6k(w, row_bytes, b / 8, (int8_t *)vals, sw);
            for (int n = 0; n < TILE; n++) { col[n] = sw[16 * n + 2 * j]; col1[n] = sw[16 * n + 2 * j + 1]; }
            _tile_loadd(3, vals + 32 * j, 256);
            _tile_loadd(6, vals + 32 * j + 16, 256);
        }
        for (int64_t t = 0; t < tiles; t++) {
            const int8_t *xb = xq + (t * nb + b) * XBLK;
            const __m512 dx = _mm512_loadu_ps(d + (t * nb + b) * TILE);
            __m512 *a = acc + t * TILE;
            _tile_zero(0);
            if (qtype == Q6_K) {
                /* the two 16-value halves have their own scales: a K = 16 dot each */
                _tile_zero(5);
                _tile_loadd(4, xb, 64);
                _tile_loadd(7, xb + 4 * 64, 64);
                _tile_dpbssd(0, 3, 4);
                _tile_dpbssd(5, 6, 7);
                _tile_stored(0, c, 64);
                _tile_stored(5, c1, 64);
                add_scaled(c, dx, col, a);
                add_scaled(c1, dx, col1, a);
            } else {
                _tile_loadd(2, xb, 64);
                _tile_dpbssd(0, 1, 2);
                _tile_stored(0, c, 64);
                add_scaled(c, dx, col, a);
                if (qtype == Q4_K) {
                    const __m512 dsx = _mm512_loadu_ps(ds + (t * nb + b) * TILE);
                    for (int n = 0; n < TILE; n++) a[n] = _mm512_fnmadd_ps(dsx, _mm512_set1_ps(col1[n]), a[n]);
                }
            }
        }
    }
    for (int64_t t = 0; t < tiles; t++) {
        float out[TILE * TILE];
        for (int n = 0; n < TILE; n++) _mm512_storeu_ps(out + TILE * n, acc[t * TILE + n]);
        for (int m = 0; m < TILE && t * TILE + m < rows; m++)
            for (int64_t n = 0; n < nrows; n++) y[(t * TILE + m) * ldy + n] = out[TILE * n + m];
    }
}

/*
 * y [M, N] (row stride ldy) = x [M, K] float32 contiguous @ W^T, W of N rows of Q8_0, Q4_K or Q6_K
 * blocks, x rounded to int8 per 32 values. Returns 0; -1 for another type or K not a multiple of
 * the block; -2 without scratch memory; -3 when the process may not use AMX.
 */
AMX_TARGET int pagedlm_gguf_mul_mat_amx(int qtype, const uint8_t *w, int64_t N, int64_t K, const float *x,
                                        int64_t M, float *y, int64_t ldy, int nthreads) {
    int64_t row_bytes;
    if (qtype == Q8_0 && K % 32 == 0) row_bytes = K / 32 * 34;
    else if (qtype == Q4_K && K % 256 == 0) row_bytes = K / 256 * 144;
    else if (qtype == Q6_K && K % 256 == 0) row_bytes = K / 256 * 210;
    else return -1;
    if (M < 1) return M == 0 ? 0 : -1;
    if (pagedlm_gguf_amx_init() != 0) return -3;
    const int64_t nb = K / 32, chunk_tiles = M_CHUNK / TILE;
    const int64_t all_tiles = (M + TILE - 1) / TILE;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)(all_tiles * nb * XBLK));
    float *d = (float *)malloc((size_t)(all_tiles * nb * TILE) * sizeof(float));
    float *ds = (float *)malloc((size_t)(all_tiles * nb * TILE) * sizeof(float));
    if (xq == NULL || d == NULL || ds == NULL) {
        free(xq); free(d); free(ds);
        return -2;
    }
    quantize_tiles(x, K, M, xq, d, ds);
    const int64_t ntiles = (N + TILE - 1) / TILE;
    if (nthreads < 1 || ntiles < 2) nthreads = 1;
    /* per thread: the unpacked super-block, the float32 sums and the last tile's rows zero-padded */
    const size_t per_thread = TILE * 256 + (size_t)(chunk_tiles * TILE) * sizeof(__m512) +
                              ((size_t)(TILE * row_bytes) + 63) / 64 * 64;
    uint8_t *scratch = (uint8_t *)aligned_alloc(64, per_thread * (size_t)nthreads);
    if (scratch == NULL) {
        free(xq); free(d); free(ds);
        return -2;
    }
#pragma omp parallel num_threads(nthreads)
    {
        load_tile_config();
        uint8_t *vals = scratch + per_thread * (size_t)omp_get_thread_num();
        __m512 *acc = (__m512 *)(vals + TILE * 256);
        uint8_t *tail = (uint8_t *)(acc + chunk_tiles * TILE);
        for (int64_t t0 = 0; t0 < all_tiles; t0 += chunk_tiles) {
            const int64_t tiles = all_tiles - t0 < chunk_tiles ? all_tiles - t0 : chunk_tiles;
            const int64_t rows = M - t0 * TILE < tiles * TILE ? M - t0 * TILE : tiles * TILE;
#pragma omp for schedule(static)
            for (int64_t nt = 0; nt < ntiles; nt++) {
                const int64_t n0 = nt * TILE, nrows = N - n0 < TILE ? N - n0 : TILE;
                const uint8_t *wt = w + n0 * row_bytes;
                if (nrows < TILE) {
                    memset(tail, 0, (size_t)(TILE * row_bytes));
                    memcpy(tail, wt, (size_t)(nrows * row_bytes));
                    wt = tail;
                }
                weight_tile(qtype, wt, row_bytes, K, xq + t0 * nb * XBLK, d + t0 * nb * TILE, ds + t0 * nb * TILE,
                            tiles, rows, vals, acc, y + t0 * TILE * ldy + n0, ldy, nrows);
            }
        }
        _tile_release();
    }
    free(scratch);
    free(xq);
    free(d);
    free(ds);
    return 0;
}

#else

int pagedlm_gguf_amx_init(void) { return -1; }

int pagedlm_gguf_mul_mat_amx(int qtype, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                             int64_t ldy, int nthreads) {
    (void)qtype; (void)w; (void)N; (void)K; (void)x; (void)M; (void)y; (void)ldy; (void)nthreads;
    return -3;
}

#endif
