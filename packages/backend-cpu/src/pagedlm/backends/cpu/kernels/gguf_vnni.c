/*
 * Q8_0, Q4_K and Q6_K weights times int8 activations with AVX-512 VNNI (VPDPBUSD: 64 unsigned x
 * signed byte products summed in fours into 16 int32 lanes per instruction): the int8-activation
 * path of gguf_mul_mat for decode steps (1-4 x rows) on CPUs that have it (Intel Ice Lake and
 * later, AMD Zen 4 and later), where gguf_q8_act.c's 16-bit products run at a fraction of the
 * memory bandwidth for the K-quants.
 *
 * The arithmetic is gguf_q8_act.c's: x rounded to int8 per 32 values (scale amax / 127, round half
 * to even), exact integer dot products per block, scaled by the block scales and summed in float32
 * (in another order than gguf_q8_act.c, so results differ from it by float32 rounding only).
 * VPDPBUSD wants one unsigned operand: Q4_K's nibbles are unsigned already; Q6_K's 6-bit values q
 * enter as q (0..63) and the 32 * sum(x) of each 16-value group is subtracted; Q8_0's signed bytes
 * enter as w + 128 (w XOR 0x80) and 128 * sum(x) of each lane's four values is subtracted. Both
 * corrections are exact integers, precomputed once per call from the quantized x.
 *
 * NOTE: built into every build of the library with function-level targets; the Python side calls
 * it only where /proc/cpuinfo lists avx512_vnni (and avx512bw, avx512vl).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "gguf_common.h"

enum { Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
#define MAX_ROWS 4

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#include <immintrin.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
/* inlined into rows(), so a call with M = 1 compiles to a loop with its accumulators in registers */
#define ROW_FN VNNI_TARGET static inline __attribute__((always_inline))

int pagedlm_gguf_vnni_compiled(void) { return 1; }

/* the quantized x rows and what the weight types need of them, per x row m */
typedef struct {
    int8_t *q;       /* [M, K]; for Q4_K each 256 values in the sub-block order 0 2 1 3 4 6 5 7 */
    float *d;        /* [M, K / 32] the block scales */
    int32_t *corr;   /* [M, K / 4] per 4-value lane: Q8_0 128 * sum, Q6_K 8 * its 16-group's sum */
    float *dsum;     /* [M, K / 32] Q4_K: d * sum(q) of the block (the dmin offsets); Q6_K: [M, K / 16] d of the group */
} xrows;

VNNI_TARGET static inline float half(const uint8_t *p) { return _cvtsh_ss((uint16_t)(p[0] | (p[1] << 8))); }

VNNI_TARGET static inline float sum8(__m256 v) { return _mm512_reduce_add_ps(_mm512_zextps256_ps512(v)); }

/* x rows -> xrows (the rounding of gguf_q8_act.c's quantize_row) */
VNNI_TARGET static void quantize(int qtype, const float *x, int64_t K, int64_t M, xrows *xr) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + m * K + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(p[i]) > amax ? fabsf(p[i]) : amax;
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, dx = amax / 127.0f;
            /* Q4_K reads the sub-blocks of a 256 in the order its nibbles come: 0 2 1 3 4 6 5 7 */
            const int64_t j = b % 8, slot = qtype == Q4_K ? (b - j) + (j & 4) + ((j & 1) << 1) + ((j >> 1) & 1) : b;
            int8_t *q = xr->q + m * K + slot * 32;
            int32_t sum = 0, sum16[2] = {0, 0};
            for (int i = 0; i < 32; i++) {
                const int v = (int)lrintf(p[i] * inv);
                q[i] = (int8_t)v;
                sum += v;
                sum16[i / 16] += v;
            }
            xr->d[m * nb + b] = dx;
            if (qtype == Q4_K) xr->dsum[m * nb + b] = dx * (float)sum;
            for (int l = 0; l < 8; l++) {
                int32_t s4 = 0;
                for (int t = 0; t < 4; t++) s4 += q[4 * l + t];
                if (qtype == Q8_0) xr->corr[m * (K / 4) + b * 8 + l] = 128 * s4;
                if (qtype == Q6_K) xr->corr[m * (K / 4) + b * 8 + l] = 8 * sum16[l / 4];
            }
            if (qtype == Q6_K) xr->dsum[m * (K / 16) + 2 * b] = xr->dsum[m * (K / 16) + 2 * b + 1] = dx;
        }
    }
}

ROW_FN void row_q8(const uint8_t *row, int64_t K, const xrows *xr, int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    __m512 acc[MAX_ROWS];
    __m256 acc1[MAX_ROWS];
    for (int m = 0; m < MAX_ROWS; m++) acc[m] = _mm512_setzero_ps(), acc1[m] = _mm256_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *b0 = row + b * 34, *b1 = b0 + 34;
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                       _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
        w = _mm512_xor_si512(w, flip);
        const float dw0 = half(b0), dw1 = half(b1);
        for (int64_t m = 0; m < M; m++) {
            const __m512i xq = _mm512_loadu_si512(xr->q + m * K + b * 32);
            __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
            dp = _mm512_sub_epi32(dp, _mm512_loadu_si512(xr->corr + m * (K / 4) + b * 8));
            const float *dx = xr->d + m * nb + b;
            const __m512 s = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(dw0 * dx[0])),
                                                                 _mm256_castps_pd(_mm256_set1_ps(dw1 * dx[1])), 1));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), s, acc[m]);
        }
    }
    if (b < nb) { /* an odd last block */
        const uint8_t *b0 = row + b * 34;
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b0 + 2)), _mm256_set1_epi8((char)0x80));
        const float dw0 = half(b0);
        for (int64_t m = 0; m < M; m++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(xr->q + m * K + b * 32));
            __m256i dp = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xq);
            dp = _mm256_sub_epi32(dp, _mm256_loadu_si256((const __m256i *)(xr->corr + m * (K / 4) + b * 8)));
            acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_set1_ps(dw0 * xr->d[m * nb + b]), acc1[m]);
        }
    }
    for (int64_t m = 0; m < M; m++) y[m * ldy] = _mm512_reduce_add_ps(acc[m]) + sum8(acc1[m]);
}

/* Q4_K's 12 scale bytes -> 8 six-bit scales (bytes 0-7 of out) and 8 mins (bytes 8-15), k4_scale_min's
 * values four at a time: sub-blocks 0-3 keep the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
 * 4-7 take a nibble of bytes 8-11 and the top 2 bits of bytes 0-3 (scales) or 4-7 (mins) */
static void q4k_scales(const uint8_t *s, uint32_t out[4]) {
    uint32_t u[3];
    memcpy(u, s, 12);
    out[0] = u[0] & 0x3F3F3F3Fu;
    out[1] = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    out[2] = u[1] & 0x3F3F3F3Fu;
    out[3] = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);
}

ROW_FN void row_q4k(const uint8_t *row, int64_t K, const xrows *xr, int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    __m512 acc[MAX_ROWS];
    __m256 corr[MAX_ROWS];
    for (int m = 0; m < MAX_ROWS; m++) acc[m] = _mm512_setzero_ps(), corr[m] = _mm256_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    /* lanes 0-7 take sub-block a's scale, 8-15 b's, for (a, b) = (0, 2), (1, 3), (4, 6), (5, 7) */
    const __m512i pick02 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i pick13 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i pick46 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i pick57 = _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5);
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *blk = row + sb * 144;
        uint32_t scmn[4];
        q4k_scales(blk + 4, scmn);
        const __m128i both = _mm_loadu_si128((const __m128i *)scmn);
        const __m256 d = _mm256_set1_ps(half(blk)), dmin = _mm256_set1_ps(half(blk + 2));
        const __m256 scf = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both)));
        const __m256 mnf = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8))));
        const __m512i q0 = _mm512_loadu_si512(blk + 16), q1 = _mm512_loadu_si512(blk + 80);
        const __m512i w02 = _mm512_and_si512(q0, low4), w13 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), low4);
        const __m512i w46 = _mm512_and_si512(q1, low4), w57 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), low4);
        for (int64_t m = 0; m < M; m++) {
            const int8_t *xq = xr->q + m * K + sb * 256;
            const __m256 dx = _mm256_loadu_ps(xr->d + m * nb + sb * 8);
            const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(scf, dx)); /* d * sc_j * dx_j, j = 0..7 */
            __m512 a = acc[m];
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w02,
                                                                       _mm512_loadu_si512(xq))),
                                _mm512_permutexvar_ps(pick02, s), a);
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w13,
                                                                       _mm512_loadu_si512(xq + 64))),
                                _mm512_permutexvar_ps(pick13, s), a);
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w46,
                                                                       _mm512_loadu_si512(xq + 128))),
                                _mm512_permutexvar_ps(pick46, s), a);
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w57,
                                                                       _mm512_loadu_si512(xq + 192))),
                                _mm512_permutexvar_ps(pick57, s), a);
            acc[m] = a;
            /* the offsets: dmin * mn_j * dx_j * sum(q) of x block j */
            corr[m] = _mm256_fmadd_ps(mnf, _mm256_loadu_ps(xr->dsum + m * nb + sb * 8), corr[m]);
        }
    }
    for (int64_t m = 0; m < M; m++) y[m * ldy] = _mm512_reduce_add_ps(acc[m]) - sum8(corr[m]);
}

ROW_FN void row_q6k(const uint8_t *row, int64_t K, const xrows *xr, int64_t M, float *y, int64_t ldy) {
    __m512 acc[MAX_ROWS];
    for (int m = 0; m < MAX_ROWS; m++) acc[m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);
    /* the 2-bit highs of the first and the second 32 values of each pair of blocks */
    const __m512i shift_a = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift_b = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *blk = row + sb * 210;
        const float d = half(blk + 208);
        const int8_t *scales = (const int8_t *)(blk + 192);
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
            const __m512i hi_a = _mm512_and_si512(_mm512_srlv_epi16(hz, shift_a), two);
            const __m512i hi_b = _mm512_and_si512(_mm512_srlv_epi16(hz, shift_b), two);
            const __m512i wa = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(hi_a, 4));
            const __m512i wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                               _mm512_slli_epi16(hi_b, 4));
            /* d * the group scales of blocks (4h, 4h + 1) and (4h + 2, 4h + 3), four groups each */
            int32_t s4a, s4b;
            memcpy(&s4a, scales + 8 * h, 4);
            memcpy(&s4b, scales + 8 * h + 4, 4);
            const __m128 sa = _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(s4a))));
            const __m128 sbv = _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(s4b))));
            for (int64_t m = 0; m < M; m++) {
                const int64_t v0 = sb * 256 + 128 * h; /* the first value of this half */
                const int8_t *xq = xr->q + m * K + v0;
                const int32_t *cr = xr->corr + m * (K / 4) + v0 / 4;
                const float *dx = xr->dsum + m * (K / 16) + v0 / 16;
                __m512i dpa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, _mm512_loadu_si512(xq));
                __m512i dpb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb, _mm512_loadu_si512(xq + 64));
                dpa = _mm512_sub_epi32(dpa, _mm512_loadu_si512(cr));
                dpb = _mm512_sub_epi32(dpb, _mm512_loadu_si512(cr + 16));
                const __m512 fa = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(sa, _mm_loadu_ps(dx))));
                const __m512 fb = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(sbv, _mm_loadu_ps(dx + 4))));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dpa), fa, acc[m]);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dpb), fb, acc[m]);
            }
        }
    }
    for (int64_t m = 0; m < M; m++) y[m * ldy] = _mm512_reduce_add_ps(acc[m]);
}

ROW_FN void rows(int qtype, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const xrows *xr, int64_t M,
                float *y, int64_t ldy, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        if (qtype == Q8_0) row_q8(row, K, xr, M, y + n, ldy);
        else if (qtype == Q4_K) row_q4k(row, K, xr, M, y + n, ldy);
        else row_q6k(row, K, xr, M, y + n, ldy);
    }
}

/*
 * y [M, N] (row stride ldy) = x [M, K] float32 contiguous @ W^T for W of N rows of Q8_0, Q4_K or
 * Q6_K blocks, x quantized to int8 per 32 values. Returns 0; -1 for another type, M outside [1, 4]
 * or K not a multiple of the block; -2 when scratch memory cannot be allocated.
 */
VNNI_TARGET int pagedlm_gguf_mul_mat_vnni(int qtype, const uint8_t *w, int64_t N, int64_t K, const float *x,
                                          int64_t M, float *y, int64_t ldy, int nthreads) {
    int64_t row_bytes;
    if (qtype == Q8_0 && K % 32 == 0) row_bytes = K / 32 * 34;
    else if (qtype == Q4_K && K % 256 == 0) row_bytes = K / 256 * 144;
    else if (qtype == Q6_K && K % 256 == 0) row_bytes = K / 256 * 210;
    else return -1;
    if (M < 1 || M > MAX_ROWS) return -1;
    xrows xr;
    xr.q = (int8_t *)malloc((size_t)(M * K));
    xr.d = (float *)malloc((size_t)(M * (K / 32)) * sizeof(float));
    xr.corr = (int32_t *)malloc((size_t)(M * (K / 4)) * sizeof(int32_t));
    xr.dsum = (float *)malloc((size_t)(M * (K / 16)) * sizeof(float));
    if (xr.q == NULL || xr.d == NULL || xr.corr == NULL || xr.dsum == NULL) {
        free(xr.q); free(xr.d); free(xr.corr); free(xr.dsum);
        return -2;
    }
    quantize(qtype, x, K, M, &xr);
    /* a parallel region per call costs more than it saves below a few hundred KiB of weights */
    if (nthreads < 1 || N * row_bytes < (1 << 18)) nthreads = 1;
    if (M == 1) rows(qtype, w, row_bytes, N, K, &xr, 1, y, ldy, nthreads);  /* a decode step's one row */
    else rows(qtype, w, row_bytes, N, K, &xr, M, y, ldy, nthreads);
    free(xr.q); free(xr.d); free(xr.corr); free(xr.dsum);
    return 0;
}

#else

int pagedlm_gguf_vnni_compiled(void) { return 0; }

int pagedlm_gguf_mul_mat_vnni(int qtype, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                              int64_t ldy, int nthreads) {
    (void)qtype; (void)w; (void)N; (void)K; (void)x; (void)M; (void)y; (void)ldy; (void)nthreads;
    return -3;
}

#endif
