/*
 * Q8_0 weights times int8-quantized activations, for decode steps (a few x rows): the opt-in fast
 * path of the CPU platform's gguf_mul_mat (pagedlm.backends.cpu.kernels.gguf_ops).
 *
 * Each row of x is quantized per 32 values, as the weights are: q = round(x * 127 / amax) with
 * scale amax / 127 (round to nearest even, the same in the AVX2 and the scalar code). A weight
 * block times an x block is then an exact integer dot product (int8 x int8 summed in int32),
 * scaled once by d_w * d_x and summed over the row's blocks in float32. The weights are never
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

#define Q8_VALUES 32
#define Q8_BYTES 34
#define MAX_ROWS 4 /* x rows per call of this path */

static inline float q8_half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* one row of x (K values, K % 32 == 0) -> int16 q [K] (values -127..127) and scales d [K / 32] */
static void quantize_row(const float *x, int64_t K, int16_t *q, float *d) {
    for (int64_t b = 0; b < K / Q8_VALUES; b++) {
        const float *p = x + b * Q8_VALUES;
        float amax = 0.0f;
        for (int i = 0; i < Q8_VALUES; i++) {
            float a = fabsf(p[i]);
            amax = a > amax ? a : amax;
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int i = 0; i < Q8_VALUES; i++) q[b * Q8_VALUES + i] = (int16_t)lrintf(p[i] * inv);
    }
}

#ifdef __AVX2__
static inline float q8_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* y[m * ldy] for m < M: weight row `row` (K / 32 blocks) against the quantized x rows */
static void dot_row_q8(const uint8_t *row, int64_t nblocks, const int16_t *q, const float *d, int64_t M,
                       int64_t K, float *y, int64_t ldy) {
#ifdef __AVX2__
    __m256 acc[MAX_ROWS];
    for (int m = 0; m < MAX_ROWS; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *blk = row + b * Q8_BYTES;
        const float dw = q8_half_to_float(blk);
        __m256i w_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        __m256i w_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        for (int64_t m = 0; m < M; m++) {
            const int16_t *xq = q + m * K + b * Q8_VALUES;
            __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w_lo, _mm256_loadu_si256((const __m256i *)xq)),
                                         _mm256_madd_epi16(w_hi, _mm256_loadu_si256((const __m256i *)(xq + 16))));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * d[m * nblocks + b]), acc[m]);
        }
    }
    for (int64_t m = 0; m < M; m++) y[m * ldy] = q8_hsum(acc[m]);
#else
    for (int64_t m = 0; m < M; m++) {
        /* the AVX2 code's order: 8 lanes, each summing its pairs of products per block */
        float lanes[8] = {0};
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *blk = row + b * Q8_BYTES;
            const float scale = q8_half_to_float(blk) * d[m * nblocks + b];
            const int16_t *xq = q + m * K + b * Q8_VALUES;
            for (int l = 0; l < 8; l++) {
                int32_t s = 0;
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 2; j++) {
                        int i = h * 16 + 2 * l + j;
                        s += (int32_t)(int8_t)blk[2 + i] * xq[i];
                    }
                lanes[l] = fmaf((float)s, scale, lanes[l]);
            }
        }
        /* q8_hsum's order */
        float a = lanes[0] + lanes[4], b1 = lanes[1] + lanes[5], c = lanes[2] + lanes[6], e = lanes[3] + lanes[7];
        y[m * ldy] = (a + c) + (b1 + e);
    }
#endif
}

/*
 * y [M, N] (row stride ldy) = x [M, K] float32 contiguous @ W^T for W of N rows of K / 32 Q8_0
 * blocks, x quantized to int8 per 32 values. Returns 0; -1 for M outside [1, 4] or K not a
 * multiple of 32; -2 when scratch memory cannot be allocated.
 */
int pagedlm_gguf_mul_mat_q8_act(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                                int64_t ldy, int nthreads) {
    if (M < 1 || M > MAX_ROWS || K % Q8_VALUES) return -1;
    const int64_t nblocks = K / Q8_VALUES, row_bytes = nblocks * Q8_BYTES;
    int16_t *q = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    float *d = (float *)malloc((size_t)(M * nblocks) * sizeof(float));
    if (q == NULL || d == NULL) {
        free(q);
        free(d);
        return -2;
    }
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, q + m * K, d + m * nblocks);
    /* rows of about 1 KiB or less: a parallel region per call costs more than it saves below a few
     * hundred of them */
    if (nthreads < 1 || N * row_bytes < (1 << 18)) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) dot_row_q8(w + n * row_bytes, nblocks, q, d, M, K, y + n, ldy);
    free(q);
    free(d);
    return 0;
}
