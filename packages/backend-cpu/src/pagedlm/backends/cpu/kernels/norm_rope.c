/*
 * RMSNorm (Llama's and Gemma's), the residual add before it, and rotary embeddings (with the
 * per-head q/k norm of Qwen3 and Gemma 3) for the CPU platform: one call where core's torch code
 * runs 8-12 small ops, each ~4 us of dispatch on a [1, 640] decode row.
 *
 * NOTE: every result is bit for bit core's torch reference (pagedlm.core.layers.layernorm and
 * .rotary), so the exact path stays token-identical to HF:
 * - mean(x^2) is torch's cascade sum (aten/src/ATen/native/cpu/SumKernel.cpp: the row read as
 *   vectors of `lanes` floats, four partial vectors, levels of 16; the scalar tail first, then
 *   the lanes in order) divided by N. `lanes` is the width torch's reduction runs at on this CPU,
 *   which norm_ops.py finds by comparing with torch at load; with no match it keeps torch's ops.
 * - every product and sum is rounded where torch rounds it (built with -ffp-contract=off), and
 *   bfloat16 results are rounded to nearest even as c10::BFloat16 does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { NORM_NONE = 0, NORM_LLAMA = 1, NORM_GEMMA = 2 };
#define MAX_LANES 16
#define MAX_ROW 16384

/* flags: bits 0-1 the tensors' dtype, 2-3 the weight's, 4-5 the norm style, 6 neox pairing */
#define FLAG_DT(f) ((f) & 3)
#define FLAG_WDT(f) (((f) >> 2) & 3)
#define FLAG_STYLE(f) (((f) >> 4) & 3)
#define FLAG_NEOX(f) (((f) >> 6) & 1)

/* the width of torch's reduction on this CPU (norm_ops.py sets it once; 0 = not set) */
static int g_lanes = 0;

int pagedlm_norm_set_lanes(int lanes) {
    if (lanes < 1 || lanes > MAX_LANES) return -1;
    g_lanes = lanes;
    return 0;
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float load(int dt, const void *p, int64_t i) {
    return dt == DT_F32 ? ((const float *)p)[i] : bf16_to_float(((const uint16_t *)p)[i]);
}

/* the value rounded to the tensor dtype (a float32 result is already rounded) */
static inline float round_to(int dt, float v) { return dt == DT_F32 ? v : bf16_to_float(float_to_bf16(v)); }

static inline void store(int dt, void *p, int64_t i, float v) {
    if (dt == DT_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = float_to_bf16(v);
}

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* torch's row_sum over `count` elements of `lanes` floats each (lanes 1: plain floats) into res */
static void row_sum(const float *v, int64_t count, int lanes, float *res) {
    const int64_t size = count / 4; /* rows of four elements: the four partial sums */
    int64_t power = ceil_log2(size) / 4;
    if (power < 4) power = 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[4][4][MAX_LANES];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < lanes; ++l) acc[0][k][l] += v[(i * 4 + k) * lanes + l];
        for (int j = 1; j < 4; ++j) {
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < lanes; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < lanes; ++l) acc[0][k][l] += v[(i * 4 + k) * lanes + l];
    for (int j = 1; j < 4; ++j)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < lanes; ++l) acc[0][k][l] += acc[j][k][l];
    for (int64_t e = size * 4; e < count; ++e)
        for (int l = 0; l < lanes; ++l) acc[0][0][l] += v[e * lanes + l];
    for (int k = 1; k < 4; ++k)
        for (int l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
    memcpy(res, acc[0][0], (size_t)lanes * sizeof(float));
}

/* torch.sum of n contiguous floats, in torch's order */
static float torch_sum(const float *v, int64_t n, int lanes) {
    float part[MAX_LANES];
    if (n < lanes) { /* torch's scalar_inner_sum */
        row_sum(v, n, 1, part);
        return part[0];
    }
    const int64_t nvec = n / lanes;
    row_sum(v, nvec, lanes, part);
    float total = 0.0f;
    for (int64_t e = nvec * lanes; e < n; ++e) total += v[e];
    for (int l = 0; l < lanes; ++l) total += part[l];
    return total;
}

/* h [n] float32 (the row, already in float) -> out [n] in dtype dt, normalised as `style` */
static void norm_row(const float *h, int64_t n, int dt, const void *w, int wdt, float eps, int style, int lanes,
                     float *sq, void *out) {
    for (int64_t i = 0; i < n; ++i) sq[i] = h[i] * h[i];
    const float var = torch_sum(sq, n, lanes) / (float)n;
    const float r = 1.0f / sqrtf(var + eps);
    if (style == NORM_GEMMA) {
        for (int64_t i = 0; i < n; ++i) {
            const float plus_one = 1.0f + load(wdt, w, i);
            store(dt, out, i, (h[i] * r) * plus_one);
        }
    } else {
        for (int64_t i = 0; i < n; ++i) store(dt, out, i, load(wdt, w, i) * round_to(dt, h[i] * r));
    }
}

/*
 * out[r] = norm(x[r]) for rows of n values (x row stride x_stride elements, out contiguous).
 * With res: s = x + res in the dtype is written to sum_out (contiguous) and normalised instead.
 * The flags' style NORM_LLAMA: weight * round(h * rsqrt(mean(h^2) + eps)), the product in the dtype;
 * NORM_GEMMA: round(h * rsqrt(...) * (1 + weight)), all in float32. Returns 0, or -1 for n too large
 * or the width not set.
 */
int pagedlm_rms_norm(int flags, const void *x, int64_t x_stride, const void *res, int64_t res_stride, void *sum_out,
                     void *out, int64_t rows, int64_t n, const void *w, float eps, int nthreads) {
    const int dt = FLAG_DT(flags), wdt = FLAG_WDT(flags), style = FLAG_STYLE(flags), lanes = g_lanes;
    if (n > MAX_ROW || lanes == 0) return -1;
    const size_t esize = dt == DT_F32 ? 4 : 2;
    const int threads = (nthreads > 1 && rows * n >= 65536) ? nthreads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r) {
        float h[MAX_ROW], sq[MAX_ROW];
        const char *xr = (const char *)x + (size_t)(r * x_stride) * esize;
        if (res) {
            const char *rr = (const char *)res + (size_t)(r * res_stride) * esize;
            char *sr = (char *)sum_out + (size_t)(r * n) * esize;
            for (int64_t i = 0; i < n; ++i) {
                const float s = round_to(dt, load(dt, xr, i) + load(dt, rr, i));
                store(dt, sr, i, s);
                h[i] = s;
            }
        } else {
            for (int64_t i = 0; i < n; ++i) h[i] = load(dt, xr, i);
        }
        norm_row(h, n, dt, w, wdt, eps, style, lanes, sq, (char *)out + (size_t)(r * n) * esize);
    }
    return 0;
}

/* one head [D] (in dtype, contiguous) rotated in place by the position's cos | sin row */
static void rotate_head(int dt, void *head, const float *cos_sin, int64_t rotary_dim, int neox) {
    const int64_t half = rotary_dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float c = round_to(dt, cos_sin[i]), s = round_to(dt, cos_sin[half + i]);
        const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x1 = load(dt, head, a), x2 = load(dt, head, b);
        const float o1 = round_to(dt, x1 * c) - round_to(dt, x2 * s);
        const float o2 = round_to(dt, x2 * c) + round_to(dt, x1 * s);
        store(dt, head, a, o1);
        store(dt, head, b, o2);
    }
}

/* the heads of one tensor ([T, heads * D], token stride `stride`) -> out [T, heads * D] contiguous */
static void heads(int dt, const int64_t *positions, int64_t T, const void *x, int64_t stride, int64_t nheads,
                  int64_t D, int64_t rotary_dim, int neox, const float *cos_sin, const void *w, int wdt, float eps,
                  int style, int lanes, void *out, int threads) {
    const size_t esize = dt == DT_F32 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < T; ++t) {
        float h[MAX_ROW], sq[MAX_ROW];
        const float *cs = cos_sin + positions[t] * rotary_dim;
        for (int64_t hd = 0; hd < nheads; ++hd) {
            const char *src = (const char *)x + (size_t)(t * stride + hd * D) * esize;
            char *dst = (char *)out + (size_t)((t * nheads + hd) * D) * esize;
            if (style == NORM_NONE) {
                memcpy(dst, src, (size_t)D * esize);
            } else {
                for (int64_t i = 0; i < D; ++i) h[i] = load(dt, src, i);
                norm_row(h, D, dt, w, wdt, eps, style, lanes, sq, dst);
            }
            rotate_head(dt, dst, cs, rotary_dim, neox);
        }
    }
}

/*
 * Rotary embedding of query [T, hq * D] and key [T, hk * D] (token strides q_stride / k_stride;
 * key may be NULL), each head first normalised when the flags' style is not NORM_NONE (q_w / k_w
 * [D]).
 * cos_sin [max_pos, rotary_dim] float32; outputs contiguous. Returns 0, -1 for a head too large,
 * -3 for a position outside [0, max_pos).
 */
int pagedlm_qk_norm_rope(int flags, const int64_t *positions, int64_t T, int64_t max_pos, const void *q,
                         int64_t q_stride, int64_t hq, const void *k, int64_t k_stride, int64_t hk, int64_t D,
                         int64_t rotary_dim, const float *cos_sin, const void *q_w, const void *k_w, float eps,
                         void *q_out, void *k_out, int nthreads) {
    const int dt = FLAG_DT(flags), wdt = FLAG_WDT(flags), style = FLAG_STYLE(flags), neox = FLAG_NEOX(flags);
    const int lanes = g_lanes;
    if (D > MAX_ROW || lanes == 0 || rotary_dim > D || rotary_dim % 2) return -1;
    for (int64_t t = 0; t < T; ++t)
        if (positions[t] < 0 || positions[t] >= max_pos) return -3;
    const int threads = (nthreads > 1 && T * (hq + hk) * D >= 65536) ? nthreads : 1;
    heads(dt, positions, T, q, q_stride, hq, D, rotary_dim, neox, cos_sin, q_w, wdt, eps, style, lanes, q_out,
          threads);
    if (k)
        heads(dt, positions, T, k, k_stride, hk, D, rotary_dim, neox, cos_sin, k_w, wdt, eps, style, lanes, k_out,
              threads);
    return 0;
}

/* torch.sum of n floats in torch's order at `lanes` (norm_ops.py compares it with torch at load) */
float pagedlm_torch_order_sum(const float *v, int64_t n, int lanes) { return torch_sum(v, n, lanes); }
