/*
 * GGUF quantized matmul and row gather for the CPU platform (pagedlm.backends.cpu.kernels.gguf_ops).
 *
 * y[M, N] = x[M, K] @ W[N, K]^T with W stored as GGUF blocks: row n of W is K / block_values
 * consecutive blocks. Threads split the output rows; each decodes a few rows at a time to float32 in
 * a small scratch buffer (the exact values of pagedlm's torch dequantizer, gguf_dequant.py: the same
 * float32 products, no fused multiply-add inside the decode) and multiplies every row of x by them,
 * so one decode serves the whole batch: for a few x rows (decode steps) as dot products of ROWS
 * decoded rows here, for BATCH_M rows and more as register tiles in gguf_batch.c.
 *
 * NOTE: compiled with -ffp-contract=off so the decode's "a * b - c" stays two roundings like the
 * torch reference; the dot products use explicit FMA (summation order differs from BLAS only).
 * NOTE: threads come from OpenMP; the shared object is loaded after torch, so its libgomp.so.1 is
 * the one torch already loaded (one thread pool, not two runtimes competing for the cores).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "gguf_common.h"

enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
};

#define ROWS 4    /* decoded rows per group for a few x rows (decode: M = 1) */
#define BATCH_M 6 /* from this many x rows on, gguf_batch.c's register tiles */

/* ---- scalar block decoders (the reference arithmetic; used without AVX2) -------------------- */

void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void dq_q4_0_scalar(const uint8_t *b, float *out) {
    float d = half_to_float(b);
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)((b[2 + j] & 0x0F) - 8);
        out[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

static void dq_q4_1_scalar(const uint8_t *b, float *out) {
    float d = half_to_float(b), m = half_to_float(b + 2);
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)(b[4 + j] & 0x0F) + m;
        out[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

static void dq_q5_0_scalar(const uint8_t *b, float *out) {
    float d = half_to_float(b);
    uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
    for (int j = 0; j < 16; j++) {
        int lo = (b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4);
        int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        out[j] = d * (float)(lo - 16);
        out[j + 16] = d * (float)(hi - 16);
    }
}

static void dq_q5_1_scalar(const uint8_t *b, float *out) {
    float d = half_to_float(b), m = half_to_float(b + 2);
    uint32_t qh = (uint32_t)b[4] | ((uint32_t)b[5] << 8) | ((uint32_t)b[6] << 16) | ((uint32_t)b[7] << 24);
    for (int j = 0; j < 16; j++) {
        int lo = (b[8 + j] & 0x0F) | (((qh >> j) & 1) << 4);
        int hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        out[j] = d * (float)lo + m;
        out[j + 16] = d * (float)hi + m;
    }
}

static void dq_q8_0_scalar(const uint8_t *b, float *out) {
    float d = half_to_float(b);
    for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)b[2 + j] * d;
}

static void dq_q4_k_scalar(const uint8_t *b, float *out) {
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k4_scale_min(b + 4, j, &sc, &mn);
        float ds = d * (float)sc, dm = dmin * (float)mn;
        const uint8_t *q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int v = (j & 1) ? (q[l] >> 4) : (q[l] & 0x0F);
            out[32 * j + l] = ds * (float)v - dm;
        }
    }
}

static void dq_q5_k_scalar(const uint8_t *b, float *out) {
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k4_scale_min(b + 4, j, &sc, &mn);
        float ds = d * (float)sc, dm = dmin * (float)mn;
        const uint8_t *q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int v = ((j & 1) ? (q[l] >> 4) : (q[l] & 0x0F)) | (((qh[l] >> j) & 1) << 4);
            out[32 * j + l] = ds * (float)v - dm;
        }
    }
}

static void dq_q6_k_scalar(const uint8_t *b, float *out) {
    float d = half_to_float(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        for (int k = 0; k < 4; k++) {
            for (int l = 0; l < 32; l++) {
                int low = (k < 2) ? (ql[32 * (k & 1) + l] & 0x0F) : (ql[32 * (k & 1) + l] >> 4);
                int v = (low | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
                int i = 128 * h + 32 * k + l;
                out[i] = (d * (float)scales[i / 16]) * (float)v;
            }
        }
    }
}

/* ---- AVX2 block decoders (same values) ------------------------------------------------------ */

#ifdef __AVX2__
/* 32 signed bytes -> 32 floats, times d */
static inline void store_i8x32_scaled(__m256i q, __m256 d, float *out) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d));
    _mm256_storeu_ps(out + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d));
    _mm256_storeu_ps(out + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d));
}

/* 32 bytes (0..63) -> 32 floats, ds * q - dm (two roundings) */
static inline void store_u8x32_affine(__m256i q, __m256 ds, __m256 dm, float *out) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        _mm256_storeu_ps(out + 8 * i, _mm256_sub_ps(_mm256_mul_ps(ds, v), dm));
    }
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles (values 0..15) then high nibbles (16..31) */
static inline __m256i nibbles_32(const uint8_t *p) {
    __m128i raw = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

/* byte i = 0xFF when bit i of the little-endian u32 at p is set, else 0 */
static inline __m256i bits_to_bytes(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), which), bit);
    return _mm256_cmpeq_epi8(v, bit);
}

static void dq_q4_0(const uint8_t *b, float *out) {
    __m256i q = _mm256_sub_epi8(nibbles_32(b + 2), _mm256_set1_epi8(8));
    store_i8x32_scaled(q, _mm256_set1_ps(half_to_float(b)), out);
}

static void dq_q5_0(const uint8_t *b, float *out) {
    __m256i high = _mm256_and_si256(bits_to_bytes(b + 2), _mm256_set1_epi8(0x10));
    __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibbles_32(b + 6), high), _mm256_set1_epi8(16));
    store_i8x32_scaled(q, _mm256_set1_ps(half_to_float(b)), out);
}

static void dq_q8_0(const uint8_t *b, float *out) {
#ifdef __AVX512F__
    /* the decode of the LM head and most linear layers of the default model: half the instructions */
    __m512 d = _mm512_set1_ps(half_to_float(b));
    for (int i = 0; i < 2; i++) {
        __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * i));
        _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d));
    }
#else
    __m256 d = _mm256_set1_ps(half_to_float(b));
    for (int i = 0; i < 4; i++) {
        __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i));
        _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
    }
#endif
}

static void dq_q4_k(const uint8_t *b, float *out) {
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
        __m256i nib[2] = {_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask)};
        for (int t = 0; t < 2; t++) {
            int j = 2 * c + t, sc, mn;
            k4_scale_min(b + 4, j, &sc, &mn);
            store_u8x32_affine(nib[t], _mm256_set1_ps(d * (float)sc), _mm256_set1_ps(dmin * (float)mn), out + 32 * j);
        }
    }
}

static void dq_q5_k(const uint8_t *b, float *out) {
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const __m256i mask = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * c));
        __m256i nib[2] = {_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask)};
        for (int t = 0; t < 2; t++) {
            int j = 2 * c + t, sc, mn;
            k4_scale_min(b + 4, j, &sc, &mn);
            __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one);
            __m256i q = _mm256_or_si256(nib[t], _mm256_slli_epi16(high, 4));
            store_u8x32_affine(q, _mm256_set1_ps(d * (float)sc), _mm256_set1_ps(dmin * (float)mn), out + 32 * j);
        }
    }
}

static void dq_q6_k(const uint8_t *b, float *out) {
    float d = half_to_float(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    const __m256i mask = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        __m256i ql[2] = {_mm256_loadu_si256((const __m256i *)(b + 64 * h)),
                         _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32))};
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        for (int k = 0; k < 4; k++) {
            __m256i low = k < 2 ? _mm256_and_si256(ql[k & 1], mask)
                                : _mm256_and_si256(_mm256_srli_epi16(ql[k & 1], 4), mask);
            __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), three);
            __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), bias);
            int i = 128 * h + 32 * k;
            __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            __m256 d0 = _mm256_set1_ps(d * (float)scales[i / 16]), d1 = _mm256_set1_ps(d * (float)scales[i / 16 + 1]);
            /* NOTE: (d * scale) * q, as the reference rounds it */
            _mm256_storeu_ps(out + i, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
            _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
            _mm256_storeu_ps(out + i + 16, _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
            _mm256_storeu_ps(out + i + 24, _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
        }
    }
}
#else
#define dq_q4_0 dq_q4_0_scalar
#define dq_q5_0 dq_q5_0_scalar
#define dq_q8_0 dq_q8_0_scalar
#define dq_q4_k dq_q4_k_scalar
#define dq_q5_k dq_q5_k_scalar
#define dq_q6_k dq_q6_k_scalar
#endif

/* A row per call, the block decoder inlined into its loop: one indirect call per row, not per
 * block (a hot Q8_0 block decodes in ~5 cycles, about what a call through a pointer costs). */
#define ROW_DECODER(name, block, values, bytes)                                               \
    static void name(const uint8_t *row, int64_t nblocks, float *out) {                       \
        for (int64_t i = 0; i < nblocks; i++) block(row + i * (bytes), out + i * (values));  \
    }
ROW_DECODER(row_q4_0, dq_q4_0, 32, 18)
ROW_DECODER(row_q4_1, dq_q4_1_scalar, 32, 20)
ROW_DECODER(row_q5_0, dq_q5_0, 32, 22)
ROW_DECODER(row_q5_1, dq_q5_1_scalar, 32, 24)
ROW_DECODER(row_q8_0, dq_q8_0, 32, 34)
ROW_DECODER(row_q4_k, dq_q4_k, 256, 144)
ROW_DECODER(row_q5_k, dq_q5_k, 256, 176)
ROW_DECODER(row_q6_k, dq_q6_k, 256, 210)

/* values per block, bytes per block, row decoder; 0 when the type is not handled here */
int gguf_type_info(int qtype, int *values, int *bytes, row_decoder *fn) {
    switch (qtype) {
    case T_Q4_0: *values = 32; *bytes = 18; *fn = row_q4_0; return 1;
    case T_Q4_1: *values = 32; *bytes = 20; *fn = row_q4_1; return 1;
    case T_Q5_0: *values = 32; *bytes = 22; *fn = row_q5_0; return 1;
    case T_Q5_1: *values = 32; *bytes = 24; *fn = row_q5_1; return 1;
    case T_Q8_0: *values = 32; *bytes = 34; *fn = row_q8_0; return 1;
    case T_Q4_K: *values = 256; *bytes = 144; *fn = row_q4_k; return 1;
    case T_Q5_K: *values = 256; *bytes = 176; *fn = row_q5_k; return 1;
    case T_Q6_K: *values = 256; *bytes = 210; *fn = row_q6_k; return 1;
    default: return 0;
    }
}

/* ---- dot products of x rows with decoded weight rows ---------------------------------------- */


/* y[m, n0 + r] for r < ROWS (all ROWS rows decoded in w, row stride K), every m < M */
static void dot_group(const float *x, const float *w, int64_t M, int64_t K, float *y, int64_t ldy) {
#ifdef __AVX2__
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
        const float *xa = x + m * K, *xb = xa + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k), t;
            t = _mm256_loadu_ps(w0 + k); a0 = _mm256_fmadd_ps(t, va, a0); b0 = _mm256_fmadd_ps(t, vb, b0);
            t = _mm256_loadu_ps(w1 + k); a1 = _mm256_fmadd_ps(t, va, a1); b1 = _mm256_fmadd_ps(t, vb, b1);
            t = _mm256_loadu_ps(w2 + k); a2 = _mm256_fmadd_ps(t, va, a2); b2 = _mm256_fmadd_ps(t, vb, b2);
            t = _mm256_loadu_ps(w3 + k); a3 = _mm256_fmadd_ps(t, va, a3); b3 = _mm256_fmadd_ps(t, vb, b3);
        }
        float *ya = y + m * ldy, *yb = ya + ldy;
        ya[0] = hsum(a0); ya[1] = hsum(a1); ya[2] = hsum(a2); ya[3] = hsum(a3);
        yb[0] = hsum(b0); yb[1] = hsum(b1); yb[2] = hsum(b2); yb[3] = hsum(b3);
    }
    for (; m < M; m++) {
        const float *xa = x + m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 va = _mm256_loadu_ps(xa + k);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), va, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), va, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), va, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), va, a3);
        }
        float *ya = y + m * ldy;
        ya[0] = hsum(a0); ya[1] = hsum(a1); ya[2] = hsum(a2); ya[3] = hsum(a3);
    }
#else
    for (int64_t m = 0; m < M; m++)
        for (int r = 0; r < ROWS; r++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += x[m * K + k] * w[r * K + k];
            y[m * ldy + r] = acc;
        }
#endif
}

/* one decoded row (the tail of N that does not fill a group) */
static void dot_row(const float *x, const float *w, int64_t M, int64_t K, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        const float *xa = x + m * K;
#ifdef __AVX2__
        __m256 a = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xa + k), a);
        y[m * ldy] = hsum(a);
#else
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc += xa[k] * w[k];
        y[m * ldy] = acc;
#endif
    }
}

/* ---- entry points --------------------------------------------------------------------------- */

/* Whether qtype is handled (1) or not (0). */
int pagedlm_gguf_supports(int qtype) {
    int v, b;
    row_decoder fn;
    return gguf_type_info(qtype, &v, &b, &fn);
}

/* 1 when compiled with AVX2 + FMA, 0 for the scalar build. */
int pagedlm_gguf_simd(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

/*
 * y [M, N] (row stride ldy) = x [M, K] float32 contiguous @ W^T, W = N rows of K / values blocks.
 * Returns 0, or -1 for an unsupported type or a K that is not a multiple of the block size,
 * -2 when scratch memory cannot be allocated.
 */
int pagedlm_gguf_mul_mat(int qtype, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                         int64_t ldy, int nthreads) {
    int values, bytes;
    row_decoder fn;
    if (!gguf_type_info(qtype, &values, &bytes, &fn) || K % values) return -1;
    const int64_t nblocks = K / values, row_bytes = nblocks * bytes;
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
    if (M >= BATCH_M) return mul_mat_batch(fn, nblocks, row_bytes, w, N, K, x, M, y, ldy, nthreads);
    const int64_t groups = (N + ROWS - 1) / ROWS;
    if (groups < nthreads) nthreads = (int)groups;
#pragma omp parallel num_threads(nthreads) reduction(|: failed)
    {
        float *buf = (float *)aligned_alloc(64, (size_t)((ROWS * K * sizeof(float) + 63) / 64 * 64));
        if (buf == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                int64_t n0 = g * ROWS;
                if (n0 + ROWS <= N) {
                    for (int r = 0; r < ROWS; r++) fn(w + (n0 + r) * row_bytes, nblocks, buf + r * K);
                    dot_group(x, buf, M, K, y + n0, ldy);
                } else {
                    for (int64_t n = n0; n < N; n++) {
                        fn(w + n * row_bytes, nblocks, buf);
                        dot_row(x, buf, M, K, y + n, ldy);
                    }
                }
            }
            free(buf);
        }
    }
    return failed ? -2 : 0;
}

/* out [T, K] float32 = rows ids[t] of W (N rows of K values). Returns 0, -1 as above, -3 for an id
 * outside [0, N). */
int pagedlm_gguf_get_rows(int qtype, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t T,
                          float *out, int nthreads) {
    int values, bytes;
    row_decoder fn;
    if (!gguf_type_info(qtype, &values, &bytes, &fn) || K % values) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -3;
    const int64_t nblocks = K / values, row_bytes = nblocks * bytes;
    if (T < 64) nthreads = 1; /* a decode step's few rows: a parallel region costs more than it saves */
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) fn(w + ids[t] * row_bytes, nblocks, out + t * K);
    return 0;
}
