/*
 * What the CPU platform's GGUF kernel files share (gguf_kernels.c, gguf_batch.c, gguf_q8_act.c):
 * inline helpers, defined here once so each inlines them in its loops, and their entry points.
 */
#ifndef PAGEDLM_GGUF_COMMON_H
#define PAGEDLM_GGUF_COMMON_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* ---- float16 -> float32 ------------------------------------------------------------------- */

static inline float half_to_float(const uint8_t *p) {
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
    } else { /* subnormal half: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* the sum of a register's 8 floats: (v0 + v4 + v2 + v6) + (v1 + v5 + v3 + v7) */
#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* NOTE: not static: defined in gguf_kernels.c, used by gguf_q8_act.c too */
void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn);

/* ---- the exact path's block decoders (gguf_kernels.c), used by gguf_batch.c too ----------- */

/* a row of nblocks blocks -> its values as float32, exactly gguf_dequant.dequantize's */
typedef void (*row_decoder)(const uint8_t *row, int64_t nblocks, float *out);

/* values per block, bytes per block, row decoder; 0 when the type is not handled */
int gguf_type_info(int qtype, int *values, int *bytes, row_decoder *fn);

/* gguf_batch.c: y = x @ W^T for BATCH_M x rows and more (returns 0, or -2 without scratch memory) */
int mul_mat_batch(row_decoder fn, int64_t nblocks, int64_t row_bytes, const uint8_t *w, int64_t N, int64_t K,
                  const float *x, int64_t M, float *y, int64_t ldy, int nthreads);

#endif
