/*
 * Q8_0, Q4_K and Q6_K weights times int8-quantized activations, for decode steps (a few x rows):
 * the opt-in fast path of the CPU platform's gguf_mul_mat (pagedlm.backends.cpu.kernels.gguf_ops).
 *
 * Each row of x is quantized per 32 values, as the weights are: q = round(x * 127 / amax) with
 * scale amax / 127 (round to nearest even, the same in the AVX2 and the scalar code). A weight
 * block times an x block is then an exact integer dot product (int8 x int8 summed in int32),
 * scaled once by d_w * d_x and summed over the row's blocks in float32. K-quants: a Q4_K
 * sub-block (32 values, scale ds = d * sc, offset dm = dmin * mn) contributes
 * ds * d_x * sum(q * x_q) - dm * d_x * sum(x_q); a Q6_K group of 16 values (scale d * sc)
 * contributes d * sc * d_x * sum(v * x_q). The AVX2 and scalar builds add the same float32
 * products in the same order, so their results are bit-identical. The weights are never
 * decoded to float32, which is what the exact path spends most of a decode step on; the price
 * is the rounding of x to 8 bits (docs/quantization.md states the agreement with HF).
 *
 * NOTE: the products go through 16-bit lanes (_mm256_madd_epi16 of sign-extended bytes), not
 * _mm256_maddubs_epi16's unsigned-by-signed bytes: that one needs |w| * sign(x) in a signed byte,
 * which a weight of -128 (valid in a GGUF file) overflows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "gguf_common.h"

#define Q8_VALUES 32
#define Q8_BYTES 34
#define MAX_ROWS 4 /* x rows per call of this path */
enum { Q8_0 = 8, Q4_K = 12, Q6_K = 14 };


/* one row of x (K values, K % 32 == 0) -> int16 q [K] (values -127..127), scales d [K / 32] and
 * the sums of each block's q (for the Q4_K offsets) */
static void quantize_row(const float *x, int64_t K, int16_t *q, float *d, int32_t *bsum) {
    for (int64_t b = 0; b < K / Q8_VALUES; b++) {
        const float *p = x + b * Q8_VALUES;
        float amax = 0.0f;
        for (int i = 0; i < Q8_VALUES; i++) {
            float a = fabsf(p[i]);
            amax = a > amax ? a : amax;
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        int32_t sum = 0;
        for (int i = 0; i < Q8_VALUES; i++) {
            q[b * Q8_VALUES + i] = (int16_t)lrintf(p[i] * inv);
            sum += q[b * Q8_VALUES + i];
        }
        bsum[b] = sum;
    }
}


/* 32 weight values as int16 (two registers of 16), against one block of each x row: the AVX2
 * lanes of _mm256_madd_epi16 (lane l sums values 2l, 2l + 1 of each half), as the scalar code does */
#ifdef __AVX2__
static inline void dot32(__m256i w_lo, __m256i w_hi, const int16_t *xq, float scale, __m256 *acc) {
    __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w_lo, _mm256_loadu_si256((const __m256i *)xq)),
                                 _mm256_madd_epi16(w_hi, _mm256_loadu_si256((const __m256i *)(xq + 16))));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(scale), *acc);
}

/* 16 weight values (int16) against 16 values of x, scaled */
static inline void dot16(__m256i w, const int16_t *xq, float scale, __m256 *acc) {
    __m256i s = _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)xq));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(scale), *acc);
}
#endif

/* the scalar twin of _mm256_madd_epi16's lanes: lanes[l] += scale * the sum of the products of
 * values 2l, 2l + 1 (and 16 + 2l, 17 + 2l with two halves) */
static inline void dot_lanes(const int16_t *w, const int16_t *xq, int halves, float scale, float *lanes) {
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int h = 0; h < halves; h++)
            for (int j = 0; j < 2; j++) s += (int32_t)w[16 * h + 2 * l + j] * xq[16 * h + 2 * l + j];
        lanes[l] = fmaf((float)s, scale, lanes[l]);
    }
}

/* hsum's order over the 8 lanes */
static inline float lanes_sum(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* y[m * ldy] for m < M: weight row `row` (K / 32 blocks) against the quantized x rows */
static void dot_row_q8(const uint8_t *row, int64_t nblocks, const int16_t *q, const float *d, int64_t M,
                       int64_t K, float *y, int64_t ldy) {
#ifdef __AVX2__
    __m256 acc[MAX_ROWS];
    for (int m = 0; m < MAX_ROWS; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *blk = row + b * Q8_BYTES;
        const float dw = half_to_float(blk);
        __m256i w_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        __m256i w_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        for (int64_t m = 0; m < M; m++) dot32(w_lo, w_hi, q + m * K + b * Q8_VALUES, dw * d[m * nblocks + b], acc + m);
    }
    for (int64_t m = 0; m < M; m++) y[m * ldy] = hsum(acc[m]);
#else
    float lanes[MAX_ROWS * 8] = {0};
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *blk = row + b * Q8_BYTES;
        int16_t wv[32];
        for (int i = 0; i < 32; i++) wv[i] = (int8_t)blk[2 + i];
        for (int64_t m = 0; m < M; m++)
            dot_lanes(wv, q + m * K + b * Q8_VALUES, 2, half_to_float(blk) * d[m * nblocks + b], lanes + 8 * m);
    }
    for (int64_t m = 0; m < M; m++) y[m * ldy] = lanes_sum(lanes + 8 * m);
#endif
}


/* one Q4_K block (256 values) against the matching 8 x blocks of every row */
static void block_q4k(const uint8_t *blk, const int16_t *q, const float *d, const int32_t *bsum, int64_t M,
                      int64_t nb32, int64_t b0, void *acc_, float *corr) {
    const float dw = half_to_float(blk), dmin = half_to_float(blk + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k4_scale_min(blk + 4, j, &sc, &mn);
        const float ds = dw * (float)sc, dm = dmin * (float)mn;
        const uint8_t *qs = blk + 16 + 32 * (j / 2);
#ifdef __AVX2__
        __m256i u = _mm256_loadu_si256((const __m256i *)qs);
        u = (j & 1) ? _mm256_srli_epi16(u, 4) : u;
        u = _mm256_and_si256(u, _mm256_set1_epi8(0x0F));
        __m256i w_lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
        __m256i w_hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
#else
        int16_t w[32];
        for (int l = 0; l < 32; l++) w[l] = (int16_t)((j & 1) ? (qs[l] >> 4) : (qs[l] & 0x0F));
#endif
        for (int64_t m = 0; m < M; m++) {
            const int64_t xb = m * nb32 + b0 + j;
            const float dx = d[xb];
#ifdef __AVX2__
            dot32(w_lo, w_hi, q + xb * Q8_VALUES, ds * dx, (__m256 *)acc_ + m);
#else
            dot_lanes(w, q + xb * Q8_VALUES, 2, ds * dx, (float *)acc_ + 8 * m);
#endif
            corr[m] += (dm * dx) * (float)bsum[xb];
        }
    }
}

/* one Q6_K block (256 values) against the matching 8 x blocks of every row */
static void block_q6k(const uint8_t *blk, const int16_t *q, const float *d, int64_t M, int64_t nb32, int64_t b0,
                      void *acc_) {
    const float dw = half_to_float(blk + 208);
    const int8_t *scales = (const int8_t *)(blk + 192);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        for (int k = 0; k < 4; k++) {
            const int j = 4 * h + k;                       /* the 32-value block within the 256 */
            const float s0 = dw * (float)scales[2 * j], s1 = dw * (float)scales[2 * j + 1];
#ifdef __AVX2__
            __m256i low = _mm256_loadu_si256((const __m256i *)(ql + 32 * (k & 1)));
            low = _mm256_and_si256(k < 2 ? low : _mm256_srli_epi16(low, 4), _mm256_set1_epi8(0x0F));
            __m256i high = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)qh), 2 * k),
                                            _mm256_set1_epi8(3));
            __m256i v = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
            __m256i w_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
            __m256i w_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
#else
            int16_t w[32];
            for (int l = 0; l < 32; l++) {
                int lo = k < 2 ? (ql[32 * (k & 1) + l] & 0x0F) : (ql[32 * (k & 1) + l] >> 4);
                w[l] = (int16_t)((lo | (((qh[l] >> (2 * k)) & 3) << 4)) - 32);
            }
#endif
            for (int64_t m = 0; m < M; m++) {
                const int64_t xb = m * nb32 + b0 + j;
                const float dx = d[xb];
                const int16_t *xq = q + xb * Q8_VALUES;
#ifdef __AVX2__
                dot16(w_lo, xq, s0 * dx, (__m256 *)acc_ + m);
                dot16(w_hi, xq + 16, s1 * dx, (__m256 *)acc_ + m);
#else
                dot_lanes(w, xq, 1, s0 * dx, (float *)acc_ + 8 * m);
                dot_lanes(w + 16, xq + 16, 1, s1 * dx, (float *)acc_ + 8 * m);
#endif
            }
        }
    }
}

/* y[m * ldy] for m < M: one K-quant weight row (K / 256 blocks) against the quantized x rows */
static void dot_row_k(int qtype, const uint8_t *row, int64_t K, const int16_t *q, const float *d,
                      const int32_t *bsum, int64_t M, float *y, int64_t ldy) {
    const int64_t nb32 = K / Q8_VALUES, bytes = qtype == Q4_K ? 144 : 210;
    float corr[MAX_ROWS] = {0};
#ifdef __AVX2__
    __m256 acc[MAX_ROWS];
    for (int m = 0; m < MAX_ROWS; m++) acc[m] = _mm256_setzero_ps();
#else
    float acc[MAX_ROWS * 8] = {0};
#endif
    for (int64_t b = 0; b < K / 256; b++) {
        if (qtype == Q4_K)
            block_q4k(row + b * bytes, q, d, bsum, M, nb32, 8 * b, acc, corr);
        else
            block_q6k(row + b * bytes, q, d, M, nb32, 8 * b, acc);
    }
    for (int64_t m = 0; m < M; m++) {
#ifdef __AVX2__
        y[m * ldy] = hsum(acc[m]) - corr[m];
#else
        y[m * ldy] = lanes_sum(acc + 8 * m) - corr[m];
#endif
    }
}

/*
 * y [M, N] (row stride ldy) = x [M, K] float32 contiguous @ W^T for W of N rows of Q8_0, Q4_K or
 * Q6_K blocks, x quantized to int8 per 32 values. Returns 0; -1 for another type, M outside
 * [1, 4] or K not a multiple of the block; -2 when scratch memory cannot be allocated.
 */
int pagedlm_gguf_mul_mat_q8_act(int qtype, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                                float *y, int64_t ldy, int nthreads) {
    int64_t row_bytes;
    if (qtype == Q8_0 && K % Q8_VALUES == 0) row_bytes = K / Q8_VALUES * Q8_BYTES;
    else if (qtype == Q4_K && K % 256 == 0) row_bytes = K / 256 * 144;
    else if (qtype == Q6_K && K % 256 == 0) row_bytes = K / 256 * 210;
    else return -1;
    if (M < 1 || M > MAX_ROWS) return -1;
    const int64_t nb32 = K / Q8_VALUES;
    int16_t *q = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    float *d = (float *)malloc((size_t)(M * nb32) * sizeof(float));
    int32_t *bsum = (int32_t *)malloc((size_t)(M * nb32) * sizeof(int32_t));
    if (q == NULL || d == NULL || bsum == NULL) {
        free(q);
        free(d);
        free(bsum);
        return -2;
    }
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, q + m * K, d + m * nb32, bsum + m * nb32);
    /* a parallel region per call costs more than it saves below a few hundred KiB of weights */
    if (nthreads < 1 || N * row_bytes < (1 << 18)) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        if (qtype == Q8_0)
            dot_row_q8(w + n * row_bytes, nb32, q, d, M, K, y + n, ldy);
        else
            dot_row_k(qtype, w + n * row_bytes, K, q, d, bsum, M, y + n, ldy);
    }
    free(q);
    free(d);
    free(bsum);
    return 0;
}
