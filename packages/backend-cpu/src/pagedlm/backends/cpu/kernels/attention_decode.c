/*
 * Decode attention for the cpu_paged backend (pagedlm.backends.cpu.attention): one query token per
 * request, read straight from the paged float32 cache, and this step's K/V written into it.
 *
 * The torch path gathers every request's whole context into a padded [R, S, Hkv, D] copy, runs
 * SDPA on it and scatters the result back: at Gemma 3 270M's batch 32 that was ~1.2 ms a layer,
 * mostly copies, for ~0.1 ms of arithmetic. Here each (request, kv head) task reads the keys and
 * values of its visible positions in place: scores = scale * q . k (FMA dot products), softmax
 * in float32 (max subtracted, expf), out = sum p * v / sum p.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "gguf_common.h"

static inline float dot(const float *a, const float *b, int64_t D) {
    int64_t d = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    s = hsum(acc);
#endif
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* o[d] += p * v[d] */
static inline void axpy(float p, const float *v, float *o, int64_t D) {
    int64_t d = 0;
#if defined(__AVX512F__)
    __m512 pv = _mm512_set1_ps(p);
    for (; d + 16 <= D; d += 16) _mm512_storeu_ps(o + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + d), _mm512_loadu_ps(o + d)));
#elif defined(__AVX2__)
    __m256 pv = _mm256_set1_ps(p);
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
#endif
    for (; d < D; d++) o[d] += p * v[d];
}

/* the cache slot of context position p through a request's block table row */
static inline int64_t slot_of(const int32_t *blocks, int64_t p, int64_t block_size) {
    return (int64_t)blocks[p / block_size] * block_size + p % block_size;
}

/*
 * R requests, each one query token. q row t, head h: q + t * q_stride + h * D (q_rows[r] = t);
 * caches [slots, Hkv, D] contiguous; token t's new_k / new_v rows (strides k_stride / v_stride)
 * are written first to slot new_slots[t] for the R tokens t = q_rows[r] (< 0: none; new_slots
 * NULL: nothing to write); context position s of request r is slot
 * block_table[r * bt_stride + s / block_size] * block_size + s % block_size; the query sits at
 * position q_pos[r] and sees positions max(0, q_pos - window + 1) .. q_pos (window 0: from 0).
 * Query head h reads kv head h / (H / Hkv). out row out_rows[r], head h: out + out_rows[r] *
 * out_stride + h * D. Returns 0, -2 without scratch memory.
 */
int pagedlm_attn_decode(const float *q, int64_t q_stride, const int64_t *q_rows, float *k_cache, float *v_cache,
                        const float *new_k, int64_t k_stride, const float *new_v, int64_t v_stride,
                        const int64_t *new_slots, const int32_t *block_table, int64_t bt_stride, int64_t block_size,
                        const int64_t *q_pos,
                        int64_t window, int64_t R, int64_t H, int64_t Hkv, int64_t D, float scale, float *out,
                        int64_t out_stride, const int64_t *out_rows, int nthreads) {
    /* per thread and query head: the n scores of the longest visible context, then 1 / their sum */
    int64_t longest = 1;
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = window > 0 && q_pos[r] + 1 > window ? window : q_pos[r] + 1;
        longest = n > longest ? n : longest;
    }
    const int64_t G = H / Hkv, tasks = R * Hkv, slot_floats = Hkv * D, SS = longest + 1;
    int threads = tasks < nthreads ? (int)tasks : (nthreads < 1 ? 1 : nthreads);
    float *scratch = (float *)malloc((size_t)(threads * G * SS) * sizeof(float));
    if (scratch == NULL) return -2;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const int64_t t = q_rows[r], slot = new_slots == NULL ? -1 : new_slots[t];
            if (slot < 0) continue;
            for (int64_t kh = 0; kh < Hkv; kh++) {
                memcpy(k_cache + slot * slot_floats + kh * D, new_k + t * k_stride + kh * D, D * sizeof(float));
                memcpy(v_cache + slot * slot_floats + kh * D, new_v + t * v_stride + kh * D, D * sizeof(float));
            }
        }
        float *scores = scratch + omp_get_thread_num() * G * SS;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t r = task / Hkv, kh = task % Hkv, pos = q_pos[r];
            const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0, n = pos - lo + 1;
            const int32_t *blocks = block_table + r * bt_stride;
            /* the G query heads of this kv head take each key and value row in turn: one pass
             * over the context (rows of 1 kB scattered over the cache) instead of G */
            const float *qh = q + q_rows[r] * q_stride + kh * G * D;
            float *oh = out + out_rows[r] * out_stride + kh * G * D;
            for (int64_t s = 0; s < n; s++) {
                const float *k = k_cache + slot_of(blocks, lo + s, block_size) * slot_floats + kh * D;
                for (int64_t g = 0; g < G; g++) scores[g * SS + s] = scale * dot(qh + g * D, k, D);
            }
            for (int64_t g = 0; g < G; g++) {
                float *sc = scores + g * SS, mx = -INFINITY, sum = 0.0f;
                for (int64_t s = 0; s < n; s++) mx = sc[s] > mx ? sc[s] : mx;
                for (int64_t s = 0; s < n; s++) {
                    sc[s] = expf(sc[s] - mx);
                    sum += sc[s];
                }
                sc[n] = 1.0f / sum;
            }
            memset(oh, 0, (size_t)(G * D) * sizeof(float));
            for (int64_t s = 0; s < n; s++) {
                const float *v = v_cache + slot_of(blocks, lo + s, block_size) * slot_floats + kh * D;
                for (int64_t g = 0; g < G; g++) axpy(scores[g * SS + s], v, oh + g * D, D);
            }
            for (int64_t g = 0; g < G; g++) {
                const float inv = scores[g * SS + n];
                for (int64_t d = 0; d < D; d++) oh[g * D + d] *= inv;
            }
        }
    }
    free(scratch);
    return 0;
}
