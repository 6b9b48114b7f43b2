/*
 * The exact path of pagedlm_gguf_mul_mat (gguf_kernels.c) for batches: BATCH_M x rows and more
 * (batched decode steps, prefill).
 *
 * x is transposed once per call into panels of PANEL rows, k-major (xt[k * PANEL + j], zero rows
 * past M), so that PANEL outputs of one weight row are PANEL / VW registers. Each thread decodes
 * NW weight rows at a time into a row-major buffer (the decoders of gguf_kernels.c: the torch
 * dequantizer's values) and, per panel, keeps the NW x PANEL sums in registers: per k, the
 * panel's PANEL / VW vector loads, NW broadcasts of decoded weights, NW * PANEL / VW FMAs. The
 * weights are never transposed (only x, once, which is small next to N x K), and every output is
 * one FMA chain over k in order, so its value does not depend on M or the build's vector width.
 *
 * NOTE: x panels are taken CHUNK_BYTES at a time so that the panels a thread walks for every
 * decoded group stay in its L2 (prefill's 1024 x 640 floats would not); each chunk decodes the
 * weights again, which costs ~1/(chunk rows / VW) of the FMAs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "gguf_common.h"

#if defined(__AVX512F__)
#define VW 16 /* floats per vector */
#define NW 8  /* weight rows per group: 8 x 2 accumulators, 8 broadcasts + 2 loads per 16 FMAs */
typedef __m512 vec;
#define v_zero() _mm512_setzero_ps()
#define v_load(p) _mm512_load_ps(p)
#define v_store(p, v) _mm512_store_ps(p, v)
#define v_set1(f) _mm512_set1_ps(f)
#define v_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX2__)
#define VW 8
#define NW 6  /* 6 x 2 accumulators of 16 ymm registers */
typedef __m256 vec;
#define v_zero() _mm256_setzero_ps()
#define v_load(p) _mm256_load_ps(p)
#define v_store(p, v) _mm256_store_ps(p, v)
#define v_set1(f) _mm256_set1_ps(f)
#define v_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#else /* one float per "vector": the same loops; -ffp-contract=off keeps a * b + c two roundings */
#define VW 1
#define NW 4
typedef float vec;
#define v_zero() 0.0f
#define v_load(p) (*(p))
#define v_store(p, v) (*(p) = (v))
#define v_set1(f) (f)
#define v_fma(a, b, c) ((a) * (b) + (c))
#endif

#define PANEL (2 * VW)
#define CHUNK_BYTES (512 * 1024)

/* sums[n * PANEL + j] = sum over k of w[n * K + k] * xt[k * PANEL + j], for n < NW and the first
 * nv * VW values of j (nv = 1 or 2: a panel whose rows past M fill its second half is half the work) */
static inline __attribute__((always_inline)) void panel_sums(const float *w, const float *xt, int64_t K, int nv,
                                                             float *sums) {
    vec c0[NW], c1[NW];
    for (int n = 0; n < NW; n++) c0[n] = c1[n] = v_zero();
    for (int64_t k = 0; k < K; k++) {
        const float *xk = xt + k * PANEL;
        vec x0 = v_load(xk), x1 = nv == 2 ? v_load(xk + VW) : v_zero();
        for (int n = 0; n < NW; n++) {
            vec b = v_set1(w[n * K + k]);
            c0[n] = v_fma(b, x0, c0[n]);
            if (nv == 2) c1[n] = v_fma(b, x1, c1[n]);
        }
    }
    for (int n = 0; n < NW; n++) {
        v_store(sums + n * PANEL, c0[n]);
        if (nv == 2) v_store(sums + n * PANEL + VW, c1[n]);
    }
}

static void panel_sums_full(const float *w, const float *xt, int64_t K, float *sums) { panel_sums(w, xt, K, 2, sums); }
static void panel_sums_half(const float *w, const float *xt, int64_t K, float *sums) { panel_sums(w, xt, K, 1, sums); }

/* y[j * ldy + n] = sums[n * PANEL + j] for j < rows, n < nw: the register tile written transposed.
 * NOTE: one masked 8-lane gather per output row instead of nw scalar copies: at 32 rows the copies
 * took ~10 % of the AVX-512 LM head (Q8_0 262,144 x 640: 59.6 ms, 46.3 without any store, 55.3
 * with the gathers); lanes from nw on are neither read nor written (AVX2's NW is 6). */
static inline void store_sums(const float *sums, int64_t rows, int64_t nw, float *y, int64_t ldy) {
#if defined(__AVX2__)
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i idx = _mm256_mullo_epi32(lane, _mm256_set1_epi32(PANEL));
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nw), lane);
    for (int64_t j = 0; j < rows; j++) {
        __m256 v = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), sums + j, idx, _mm256_castsi256_ps(keep), 4);
        if (nw == 8) _mm256_storeu_ps(y + j * ldy, v);
        else _mm256_maskstore_ps(y + j * ldy, keep, v);
    }
#else
    for (int64_t j = 0; j < rows; j++)
        for (int64_t n = 0; n < nw; n++) y[j * ldy + n] = sums[n * PANEL + j];
#endif
}

int mul_mat_batch(row_decoder fn, int64_t nblocks, int64_t row_bytes, const uint8_t *w, int64_t N, int64_t K,
                  const float *x, int64_t M, float *y, int64_t ldy, int nthreads) {
    const int64_t panels = (M + PANEL - 1) / PANEL, groups = (N + NW - 1) / NW;
    int64_t chunk = CHUNK_BYTES / (K * PANEL * (int64_t)sizeof(float));
    if (chunk < 1) chunk = 1;
    int threads = groups < nthreads ? (int)groups : nthreads;
    /* one allocation: the panels, then per thread NW decoded rows and NW x PANEL sums */
    const int64_t per_thread = NW * K + NW * PANEL;
    float *xt = (float *)aligned_alloc(64, (size_t)((panels * K * PANEL + threads * per_thread) * sizeof(float)));
    if (xt == NULL) return -2;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            float *dst = xt + p * K * PANEL;
            for (int64_t k = 0; k < K; k++)
                for (int j = 0; j < PANEL; j++) {
                    int64_t m = p * PANEL + j;
                    dst[k * PANEL + j] = m < M ? x[m * K + k] : 0.0f;
                }
        }
        /* a last group's rows past N keep whatever they held: their sums are dropped */
        float *buf = xt + panels * K * PANEL + omp_get_thread_num() * per_thread, *sums = buf + NW * K;
        for (int64_t p0 = 0; p0 < panels; p0 += chunk) {
            const int64_t p1 = p0 + chunk < panels ? p0 + chunk : panels;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t n0 = g * NW, nw = N - n0 < NW ? N - n0 : NW;
                for (int64_t r = 0; r < nw; r++)
                    fn(w + (n0 + r) * row_bytes, nblocks, buf + r * K);
                for (int64_t p = p0; p < p1; p++) {
                    const int64_t m0 = p * PANEL, rows = M - m0 < PANEL ? M - m0 : PANEL;
                    if (rows > VW) panel_sums_full(buf, xt + p * K * PANEL, K, sums);
                    else panel_sums_half(buf, xt + p * K * PANEL, K, sums);
                    store_sums(sums, rows, nw, y + m0 * ldy + n0, ldy);
                }
            }
        }
    }
    free(xt);
    return 0;
}
