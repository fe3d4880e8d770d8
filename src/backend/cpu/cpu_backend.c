/* The CPU backend: every op of backend.h on host memory with a pthread pool.
 *
 * Arithmetic (the exactness contract of backend.h):
 * - dot products use dot8 (below): lane accumulators in a fixed combination order that
 *   depends only on the length, so the compiler may vectorise it without changing a bit.
 * - a linear dequantizes (w = scale·q + bias) or converts 128 weights of a row at a time and
 *   applies them to all M rows; each row accumulates into 32 lanes by column (lin_task).
 * - compiled with -ffp-contract=off (no implicit FMA), no fast-math.
 * - the Hadamard-rotated input of a linear stays float32: the reference outputs of the
 *   fixtures (Hugging Face port) match to 5e-5 that way and to only 4e-2 with the fp16
 *   rounding MODEL.md §2 describes for MLX, so the fixture's reference wins.
 * - threads split output rows / heads / channels, never a reduction.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/top_draw.h"
#include "core/threads.h"
#include "dflash/generate.h"
#include "dflash/safetensors.h"

typedef struct cpu_backend {
    df_backend base;
    df_pool *pool;
    /* scratch for linear (rotated inputs), grown on demand */
    float *xr;
    size_t xr_cap;
    float *wrow; /* per-worker dequantized weight rows */
    size_t wrow_cap;
    /* scratch for attention scores: one slice per task */
    float *scores;
    size_t scores_cap;
} cpu_backend;

static cpu_backend *cpu(df_backend *be) { return (cpu_backend *)be; }

static int grow(float **buf, size_t *cap, size_t n) {
    if (*cap >= n) return 1;
    float *p = realloc(*buf, n * sizeof(float));
    if (!p) return 0;
    *buf = p;
    *cap = n;
    return 1;
}

/* ---- scalar helpers ------------------------------------------------------------------ */

float df_round_f16(float x) { return df_f16_to_f32(df_f32_to_f16(x)); }

/* fp16 -> f32 through a 64 Ki-entry table filled once (exact). */
static float f16_table[65536];
static inline float f16_to_f32(uint16_t h) { return f16_table[h]; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float half_at(df_dtype t, const void *p, size_t i) {
    const uint16_t *h = p;
    return t == DF_DTYPE_BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Σ a[i]·b[i] in the fixed "dot8" order: 32 lane accumulators over i ≡ lane (mod 32),
 * combined lane-wise to 8 as l[j] = (l[j] + l[j+8]) + (l[j+16] + l[j+24]), then
 * ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), then the tail (n mod 32) in order. The order is a
 * function of n alone; four independent 8-wide chains keep the adds pipelined. The AVX2 and
 * the portable versions perform the same operations in the same order (same bits). */
#ifdef __AVX2__
#include <immintrin.h>
static inline float dot8(const float *a, const float *b, int n) {
    __m256 l0 = _mm256_setzero_ps(), l1 = _mm256_setzero_ps(), l2 = _mm256_setzero_ps(), l3 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        l0 = _mm256_add_ps(l0, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        l1 = _mm256_add_ps(l1, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
        l2 = _mm256_add_ps(l2, _mm256_mul_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16)));
        l3 = _mm256_add_ps(l3, _mm256_mul_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24)));
    }
    float l[8];
    _mm256_storeu_ps(l, _mm256_add_ps(_mm256_add_ps(l0, l1), _mm256_add_ps(l2, l3)));
    float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (; i < n; i++) s = s + a[i] * b[i];
    return s;
}
#else
static inline float dot8(const float *a, const float *b, int n) {
    float l[32];
    for (int j = 0; j < 32; j++) l[j] = 0.0f;
    int i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 32; j++) l[j] = l[j] + a[i + j] * b[i + j];
    for (int j = 0; j < 8; j++) l[j] = (l[j] + l[j + 8]) + (l[j + 16] + l[j + 24]);
    float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (; i < n; i++) s = s + a[i] * b[i];
    return s;
}
#endif

/* Σ a[i]² in the fixed dot8 order. */
static inline float sumsq8(const float *a, int n) { return dot8(a, a, n); }

void df_hadamard_inplace(float *x, int n, int block) {
    const float scale = (float)(1.0 / sqrt((double)block));
    for (int base = 0; base + block <= n; base += block) {
        float *v = x + base;
        for (int h = 1; h < block; h <<= 1) {
            for (int i = 0; i < block; i += h << 1) {
                for (int j = i; j < i + h; j++) {
                    float a = v[j], b = v[j + h];
                    v[j] = a + b;
                    v[j + h] = a - b;
                }
            }
        }
        for (int i = 0; i < block; i++) v[i] = v[i] * scale;
    }
}

/* Byte -> codes lookup tables for 2- and 4-bit weights (lowest bits = first column). */
static float lut2[256][4];
static float lut4[256][2];
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;
static void lut_init(void) {
    for (int h = 0; h < 65536; h++) f16_table[h] = df_f16_to_f32((uint16_t)h);
    for (int b = 0; b < 256; b++) {
        for (int i = 0; i < 4; i++) lut2[b][i] = (float)((b >> (2 * i)) & 3);
        for (int i = 0; i < 2; i++) lut4[b][i] = (float)((b >> (4 * i)) & 15);
    }
}

/* Decodes n codes of `bits` bits starting at column c0 of a packed row into floats
 * (exact small integers). c0 and n are multiples of 32 for the table paths (group sizes
 * are 32, 64 or 128). */
static void decode_codes(const uint32_t *row, int bits, int c0, int n, float *out) {
    const unsigned char *bytes = (const unsigned char *)row; /* little-endian words */
    if (bits == 2 && c0 % 4 == 0 && n % 4 == 0) {
        const unsigned char *p = bytes + c0 / 4;
        for (int i = 0; i < n / 4; i++) memcpy(out + 4 * i, lut2[p[i]], 4 * sizeof(float));
        return;
    }
    if (bits == 4 && c0 % 2 == 0 && n % 2 == 0) {
        const unsigned char *p = bytes + c0 / 2;
        for (int i = 0; i < n / 2; i++) memcpy(out + 2 * i, lut4[p[i]], 2 * sizeof(float));
        return;
    }
    if (bits == 8) {
        const unsigned char *p = bytes + c0;
        for (int i = 0; i < n; i++) out[i] = (float)p[i];
        return;
    }
    const uint32_t mask = (1u << bits) - 1u;
    for (int i = 0; i < n; i++) {
        size_t bit = (size_t)(c0 + i) * (size_t)bits;
        size_t w = bit / 32;
        unsigned sh = (unsigned)(bit % 32);
        uint32_t v = row[w] >> sh;
        if (sh + (unsigned)bits > 32) v |= row[w + 1] << (32 - sh);
        out[i] = (float)(v & mask);
    }
}

/* Converts n dense weights of row r starting at column c0 to float. */
static void dense_chunk(const df_linear *W, int r, int c0, int n, float *out) {
    size_t off = (size_t)r * (size_t)W->cols + (size_t)c0;
    if (W->wdtype == DF_DTYPE_F32) {
        memcpy(out, (const float *)W->w + off, (size_t)n * sizeof(float));
    } else {
        for (int i = 0; i < n; i++) out[i] = half_at(W->wdtype, W->w, off + (size_t)i);
    }
}

/* ---- memory ------------------------------------------------------------------------------ */

static void *cpu_alloc(df_backend *be, size_t bytes) {
    (void)be;
    return calloc(1, bytes ? bytes : 1);
}
static void cpu_dealloc(df_backend *be, void *p) {
    (void)be;
    free(p);
}
static void cpu_copy(df_backend *be, void *dst, const void *src, size_t n) {
    (void)be;
    if (n) memmove(dst, src, n);
}
static void cpu_copy_rows(df_backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                          size_t row_bytes, int rows) {
    (void)be;
    for (int r = 0; r < rows; r++)
        memmove((char *)dst + (size_t)r * dst_pitch, (const char *)src + (size_t)r * src_pitch, row_bytes);
}
static void cpu_zero(df_backend *be, void *dst, size_t n) {
    (void)be;
    if (n) memset(dst, 0, n);
}

/* ---- embedding ---------------------------------------------------------------------------- */

static void embed_row(const df_linear *E, int32_t id, float *out) {
    const int cols = E->cols;
    if (id < 0 || id >= E->rows) {
        memset(out, 0, (size_t)cols * sizeof(float));
        return;
    }
    if (E->bits > 0) {
        const int gs = E->group_size, ng = cols / gs;
        const size_t words = (size_t)cols * (size_t)E->bits / 32;
        const uint32_t *row = (const uint32_t *)E->w + (size_t)id * words;
        for (int g = 0; g < ng; g++) {
            float s = half_at(E->sdtype, E->scales, (size_t)id * (size_t)ng + (size_t)g);
            float b = half_at(E->sdtype, E->biases, (size_t)id * (size_t)ng + (size_t)g);
            decode_codes(row, E->bits, g * gs, gs, out + g * gs);
            for (int i = 0; i < gs; i++) out[g * gs + i] = df_round_f16(s * out[g * gs + i] + b);
        }
    } else {
        dense_chunk(E, id, 0, cols, out);
    }
    if (E->hadamard_block > 0) {
        /* inverse rotation: row = signs ⊙ Hn(row), rounded to fp16 (MODEL.md §2) */
        df_hadamard_inplace(out, cols, E->hadamard_block);
        for (int i = 0; i < cols; i++) out[i] = df_round_f16(out[i] * E->signs[i]);
    }
}

static void cpu_embed(df_backend *be, const df_linear *E, const int32_t *ids, int M, float *out) {
    (void)be;
    for (int m = 0; m < M; m++) embed_row(E, ids[m], out + (size_t)m * (size_t)E->cols);
}

/* ---- linear -------------------------------------------------------------------------------- */

#define LIN_ROWS_PER_TASK 8

typedef struct lin_ctx {
    const df_linear *W;
    const float *x; /* [M, cols] (rotated when W has a Hadamard block) */
    int M;
    float *y;
    float *scratch; /* one dequantized weight row per worker */
    size_t scratch_stride;
} lin_ctx;

/* Output rows r0..r1: each weight row is dequantized (w = scale·q + bias) or converted to
 * float once into the worker's scratch, then dotted (dot8) with each of the M input rows. */
static void lin_task(void *vctx, int task, int n_tasks, int worker) {
    (void)n_tasks;
    const lin_ctx *c = vctx;
    const df_linear *W = c->W;
    const int cols = W->cols, M = c->M;
    int r0 = task * LIN_ROWS_PER_TASK, r1 = r0 + LIN_ROWS_PER_TASK;
    if (r1 > W->rows) r1 = W->rows;
    float *wrow = c->scratch + (size_t)worker * (size_t)c->scratch_stride;
    const int gs = W->bits > 0 ? W->group_size : cols;
    const int ng = W->bits > 0 ? cols / gs : 0;
    const size_t words = W->bits > 0 ? (size_t)cols * (size_t)W->bits / 32 : 0;
    for (int r = r0; r < r1; r++) {
        if (W->bits > 0) {
            const uint32_t *row = (const uint32_t *)W->w + (size_t)r * words;
            decode_codes(row, W->bits, 0, cols, wrow);
            for (int g = 0; g < ng; g++) {
                size_t gi = (size_t)r * (size_t)ng + (size_t)g;
                float sc = half_at(W->sdtype, W->scales, gi), bi = half_at(W->sdtype, W->biases, gi);
                float *wg = wrow + (size_t)g * (size_t)gs;
                for (int i = 0; i < gs; i++) wg[i] = wg[i] * sc + bi;
            }
        } else {
            dense_chunk(W, r, 0, cols, wrow);
        }
        for (int m = 0; m < M; m++)
            c->y[(size_t)m * (size_t)W->rows + (size_t)r] = dot8(wrow, c->x + (size_t)m * (size_t)cols, cols);
    }
}

/* Work below which an op runs on the calling thread (pool wake-ups cost more than it). */
#define PARALLEL_MIN_WORK (1 << 16)

static void cpu_linear(df_backend *be, const df_linear *W, const float *x, int M, float *y) {
    cpu_backend *cb = cpu(be);
    const int cols = W->cols;
    for (int m0 = 0; m0 < M; m0 += DF_MAX_ROWS) {
        int mm = M - m0 < DF_MAX_ROWS ? M - m0 : DF_MAX_ROWS;
        const float *xin = x + (size_t)m0 * (size_t)cols;
        lin_ctx c = {.W = W, .x = xin, .M = mm, .y = y + (size_t)m0 * (size_t)W->rows,
                     .scratch_stride = (size_t)cols + 32};
        if (!grow(&cb->wrow, &cb->wrow_cap, (size_t)df_pool_size(cb->pool) * c.scratch_stride)) {
            be->failed = 1;
            return;
        }
        c.scratch = cb->wrow;
        if (W->hadamard_block > 0) {
            if (!grow(&cb->xr, &cb->xr_cap, (size_t)mm * (size_t)cols)) {
                be->failed = 1;
                return;
            }
            for (int m = 0; m < mm; m++) {
                float *xr = cb->xr + (size_t)m * (size_t)cols;
                const float *xi = xin + (size_t)m * (size_t)cols;
                for (int i = 0; i < cols; i++) xr[i] = xi[i] * W->signs[i];
                df_hadamard_inplace(xr, cols, W->hadamard_block);
            }
            c.x = cb->xr;
        }
        int n_tasks = (W->rows + LIN_ROWS_PER_TASK - 1) / LIN_ROWS_PER_TASK;
        if ((size_t)W->rows * (size_t)cols < PARALLEL_MIN_WORK)
            for (int t = 0; t < n_tasks; t++) lin_task(&c, t, n_tasks, 0);
        else
            df_pool_run(cb->pool, n_tasks, lin_task, &c);
    }
}

/* ---- elementwise ------------------------------------------------------------------------ */

static void cpu_rmsnorm(df_backend *be, const float *x, const float *w, int rows, int width, float eps,
                        float *y) {
    (void)be;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * (size_t)width;
        float *yr = y + (size_t)r * (size_t)width;
        float ms = sumsq8(xr, width) / (float)width;
        float inv = 1.0f / sqrtf(ms + eps);
        for (int i = 0; i < width; i++) yr[i] = w ? (xr[i] * inv) * w[i] : xr[i] * inv;
    }
}

static void cpu_add(df_backend *be, float *y, const float *x, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) y[i] = y[i] + x[i];
}

static void cpu_swiglu(df_backend *be, const float *gate, const float *up, size_t n, float *out) {
    (void)be;
    for (size_t i = 0; i < n; i++) out[i] = silu(gate[i]) * up[i];
}

/* ---- attention ----------------------------------------------------------------------------- */

/* cos/sin of partial rotate-half RoPE at text position pos: f[i] = pos · theta^(-2i/rot)
 * computed in double and rounded once (interleaved M-RoPE with all three axes equal — text
 * tokens — reduces to this). cs, sn: [rot/2]. */
static void rope_table(int rot, float theta, int32_t pos, float *cs, float *sn) {
    for (int i = 0; i < rot / 2; i++) {
        double inv_freq = pow((double)theta, -2.0 * (double)i / (double)rot);
        float f = (float)((double)pos * inv_freq);
        cs[i] = cosf(f);
        sn[i] = sinf(f);
    }
}

/* x' = x·cos + rotate_half(x)·sin on dims [0, rot) of one head vector. */
static void rope_apply(float *v, int rot, const float *cs, const float *sn) {
    const int half = rot / 2;
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cs[i] - b * sn[i];
        v[i + half] = b * cs[i] + a * sn[i];
    }
}

typedef struct attn_ctx {
    const df_attn_shape *sh;
    const float *q;
    const float *k_cache, *v_cache;
    int pos0, M;
    float *out;
    float *scores; /* [n_tasks, pos0+M] */
    int len_max;
} attn_ctx;

static void attn_task(void *vctx, int task, int n_tasks, int worker) {
    (void)worker;
    const attn_ctx *c = vctx;
    const df_attn_shape *sh = c->sh;
    const int hd = sh->head_dim, nh = sh->n_heads, nkv = sh->n_kv_heads;
    const int qstride = (sh->gated ? 2 : 1) * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    float *sc = c->scores + (size_t)task * (size_t)c->len_max;
    const int pairs = c->M * nh;
    for (int p = task; p < pairs; p += n_tasks) {
        int m = p / nh, h = p % nh, kvh = h / (nh / nkv);
        const float *q = c->q + ((size_t)m * (size_t)nh + (size_t)h) * (size_t)qstride;
        int len = sh->causal ? c->pos0 + m + 1 : c->pos0 + c->M;
        int t0 = 0; /* sliding window: first context entry this row sees */
        if (sh->sliding_window > 0 && c->pos0 + m - sh->sliding_window + 1 > 0)
            t0 = c->pos0 + m - sh->sliding_window + 1 < c->pos0 ? c->pos0 + m - sh->sliding_window + 1 : c->pos0;
        float mx = -INFINITY;
        for (int t = t0; t < len; t++) {
            const float *k = c->k_cache + ((size_t)t * (size_t)nkv + (size_t)kvh) * (size_t)hd;
            float s = dot8(q, k, hd) * scale;
            sc[t] = s;
            if (s > mx) mx = s;
        }
        float sum = 0.0f;
        for (int t = t0; t < len; t++) {
            sc[t] = expf(sc[t] - mx);
            sum = sum + sc[t];
        }
        float *o = c->out + ((size_t)m * (size_t)nh + (size_t)h) * (size_t)hd;
        for (int d = 0; d < hd; d++) o[d] = 0.0f;
        for (int t = t0; t < len; t++) {
            const float *v = c->v_cache + ((size_t)t * (size_t)nkv + (size_t)kvh) * (size_t)hd;
            float w = sc[t];
            for (int d = 0; d < hd; d++) o[d] = o[d] + w * v[d];
        }
        float inv = 1.0f / sum;
        if (sh->gated) {
            const float *gate = q + hd;
            for (int d = 0; d < hd; d++) o[d] = (o[d] * inv) * sigmoidf(gate[d]);
        } else {
            for (int d = 0; d < hd; d++) o[d] = o[d] * inv;
        }
    }
}

static void cpu_kv_append(df_backend *be, const df_attn_shape *sh, float *k, const float *v, const float *k_norm,
                          const int32_t *positions, int M, float *k_cache, float *v_cache, int pos0) {
    const int hd = sh->head_dim, nkv = sh->n_kv_heads;
    float cs[512], sn[512];
    for (int m = 0; m < M; m++) {
        rope_table(sh->rot_dims, sh->rope_theta, positions[m], cs, sn);
        for (int h = 0; h < nkv; h++) {
            float *kh = k + ((size_t)m * (size_t)nkv + (size_t)h) * (size_t)hd;
            if (k_norm) cpu_rmsnorm(be, kh, k_norm, 1, hd, sh->eps, kh);
            rope_apply(kh, sh->rot_dims, cs, sn);
        }
    }
    size_t kv_row = (size_t)nkv * (size_t)hd;
    memcpy(k_cache + (size_t)pos0 * kv_row, k, (size_t)M * kv_row * sizeof(float));
    memcpy(v_cache + (size_t)pos0 * kv_row, v, (size_t)M * kv_row * sizeof(float));
}

static void cpu_attention(df_backend *be, const df_attn_shape *sh, float *q, float *k, const float *v,
                          const float *q_norm, const float *k_norm, const int32_t *positions, int M,
                          float *k_cache, float *v_cache, int pos0, float *out) {
    cpu_backend *cb = cpu(be);
    const int hd = sh->head_dim, nh = sh->n_heads;
    const int qstride = (sh->gated ? 2 : 1) * hd;
    float cs[512], sn[512];
    for (int m = 0; m < M; m++) {
        rope_table(sh->rot_dims, sh->rope_theta, positions[m], cs, sn);
        for (int h = 0; h < nh; h++) {
            float *qh = q + ((size_t)m * (size_t)nh + (size_t)h) * (size_t)qstride;
            if (q_norm) cpu_rmsnorm(be, qh, q_norm, 1, hd, sh->eps, qh);
            rope_apply(qh, sh->rot_dims, cs, sn);
        }
    }
    cpu_kv_append(be, sh, k, v, k_norm, positions, M, k_cache, v_cache, pos0);
    int n_tasks = df_pool_size(cb->pool);
    if (n_tasks > M * nh) n_tasks = M * nh;
    int len_max = pos0 + M;
    if (!grow(&cb->scores, &cb->scores_cap, (size_t)n_tasks * (size_t)len_max)) {
        be->failed = 1;
        return;
    }
    attn_ctx c = {.sh = sh, .q = q, .k_cache = k_cache, .v_cache = v_cache, .pos0 = pos0, .M = M,
                  .out = out, .scores = cb->scores, .len_max = len_max};
    df_pool_run(cb->pool, n_tasks, attn_task, &c);
}

/* ---- DFlash2 dynamic convolution ------------------------------------------------------------ */

static void cpu_dyn_conv(df_backend *be, const float *x, const float *dyn, int dyn_stride, const float *base, int K,
                         int gs, int M, int H, float *out) {
    (void)be;
    const int G = H / gs;
    for (int t = 0; t < M; t++) {
        float *o = out + (size_t)t * (size_t)H;
        for (int ch = 0; ch < H; ch++) o[ch] = 0.0f;
        const float *d = dyn + (size_t)t * (size_t)dyn_stride;
        for (int k = 0; k < K && k <= t; k++) {
            const float *xs = x + (size_t)(t - k) * (size_t)H;
            const float *bk = base + (size_t)k * (size_t)H;
            for (int ch = 0; ch < H; ch++) {
                o[ch] = o[ch] + bk[ch] * xs[ch];
                o[ch] = o[ch] + d[k * G + ch / gs] * xs[ch];
            }
        }
    }
}

/* ---- Gated DeltaNet -------------------------------------------------------------------------- */

typedef struct gdn_ctx {
    const df_gdn_shape *sh;
    const float *qkv; /* raw projections [M, C] */
    float *conv_out;  /* [M, C] after conv + silu */
    const float *z, *a, *b, *conv_w, *A_log, *dt_bias, *norm_w;
    int M, C;
    float *conv_state, *S, *out;
} gdn_ctx;

#define GDN_CH_PER_TASK 64

static void gdn_conv_task(void *vctx, int task, int n_tasks, int worker) {
    (void)worker;
    (void)n_tasks;
    const gdn_ctx *c = vctx;
    const int K = c->sh->conv_kernel, C = c->C;
    int c0 = task * GDN_CH_PER_TASK, c1 = c0 + GDN_CH_PER_TASK;
    if (c1 > C) c1 = C;
    for (int ch = c0; ch < c1; ch++) {
        const float *w = c->conv_w + (size_t)ch * (size_t)K;
        float win[16]; /* K <= 16: the last K inputs of this channel */
        for (int j = 0; j < K - 1; j++) win[j] = c->conv_state[(size_t)j * (size_t)C + (size_t)ch];
        for (int m = 0; m < c->M; m++) {
            win[K - 1] = c->qkv[(size_t)m * (size_t)C + (size_t)ch];
            float s = 0.0f;
            for (int j = 0; j < K; j++) s = s + w[j] * win[j];
            c->conv_out[(size_t)m * (size_t)C + (size_t)ch] = silu(s);
            for (int j = 0; j < K - 1; j++) win[j] = win[j + 1];
        }
        for (int j = 0; j < K - 1; j++) c->conv_state[(size_t)j * (size_t)C + (size_t)ch] = win[j];
    }
}

static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static void gdn_head_task(void *vctx, int task, int n_tasks, int worker) {
    (void)worker;
    (void)n_tasks;
    const gdn_ctx *c = vctx;
    const df_gdn_shape *sh = c->sh;
    const int nk = sh->n_k_heads, nv = sh->n_v_heads, dk = sh->k_head_dim, dv = sh->v_head_dim;
    const int Kd = nk * dk, Vd = nv * dv, C = c->C;
    const int j = task, kh = j / (nv / nk);
    float *S = c->S + (size_t)j * (size_t)dk * (size_t)dv;
    float q[512], k[512], mem[512], d[512], o[512];
    const float qscale = 1.0f / sqrtf((float)dk);
    const float A = -expf(c->A_log[j]);
    for (int m = 0; m < c->M; m++) {
        const float *row = c->conv_out + (size_t)m * (size_t)C;
        const float *qi = row + (size_t)kh * (size_t)dk;
        const float *ki = row + (size_t)Kd + (size_t)kh * (size_t)dk;
        const float *vi = row + 2 * (size_t)Kd + (size_t)j * (size_t)dv;
        float qn = 1.0f / sqrtf(sumsq8(qi, dk) + 1e-6f);
        float kn = 1.0f / sqrtf(sumsq8(ki, dk) + 1e-6f);
        for (int i = 0; i < dk; i++) {
            q[i] = (qi[i] * qn) * qscale;
            k[i] = ki[i] * kn;
        }
        float beta = sigmoidf(c->b[(size_t)m * (size_t)nv + (size_t)j]);
        float g = A * softplusf(c->a[(size_t)m * (size_t)nv + (size_t)j] + c->dt_bias[j]);
        float decay = expf(g);
        for (int v = 0; v < dv; v++) mem[v] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *Si = S + (size_t)i * (size_t)dv;
            for (int v = 0; v < dv; v++) {
                Si[v] = Si[v] * decay;
                mem[v] = mem[v] + Si[v] * k[i];
            }
        }
        for (int v = 0; v < dv; v++) d[v] = (vi[v] - mem[v]) * beta;
        for (int v = 0; v < dv; v++) o[v] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *Si = S + (size_t)i * (size_t)dv;
            for (int v = 0; v < dv; v++) {
                Si[v] = Si[v] + k[i] * d[v];
                o[v] = o[v] + Si[v] * q[i];
            }
        }
        if (c->out) {
            float inv = 1.0f / sqrtf(sumsq8(o, dv) / (float)dv + sh->eps);
            const float *z = c->z + (size_t)m * (size_t)Vd + (size_t)j * (size_t)dv;
            float *y = c->out + (size_t)m * (size_t)Vd + (size_t)j * (size_t)dv;
            for (int v = 0; v < dv; v++) y[v] = (c->norm_w[v] * (o[v] * inv)) * silu(z[v]);
        }
    }
}

static void cpu_gdn(df_backend *be, const df_gdn_shape *sh, const float *qkv, const float *z, const float *a,
                    const float *b, const float *conv_w, const float *A_log, const float *dt_bias,
                    const float *norm_w, int M, float *conv_state, float *S, float *out) {
    cpu_backend *cb = cpu(be);
    const int C = 2 * sh->n_k_heads * sh->k_head_dim + sh->n_v_heads * sh->v_head_dim;
    float *conv_out = malloc((size_t)M * (size_t)C * sizeof(float));
    if (!conv_out) {
        be->failed = 1;
        return;
    }
    gdn_ctx c = {.sh = sh, .qkv = qkv, .conv_out = conv_out, .z = z, .a = a, .b = b, .conv_w = conv_w,
                 .A_log = A_log, .dt_bias = dt_bias, .norm_w = norm_w, .M = M, .C = C,
                 .conv_state = conv_state, .S = S, .out = out};
    df_pool_run(cb->pool, (C + GDN_CH_PER_TASK - 1) / GDN_CH_PER_TASK, gdn_conv_task, &c);
    df_pool_run(cb->pool, sh->n_v_heads, gdn_head_task, &c);
    free(conv_out);
}

/* ---- argmax ------------------------------------------------------------------------------- */

static void cpu_argmax(df_backend *be, const float *x, int rows, int width, int32_t *out) {
    (void)be;
    for (int r = 0; r < rows; r++) out[r] = df_argmax(x + (size_t)r * (size_t)width, width);
}

/* backend.h df_top_k_insert: a later entry enters only when strictly greater than the last
 * kept one, so ties keep the lower index first. */
int df_top_k_insert(const float *x, int width, int k, int32_t *ids, float *vals) {
    int len = 0;
    for (int i = 0; i < width; i++) {
        const float v = x[i];
        if (len == k && !(v > vals[len - 1])) continue;
        int pos = len < k ? len++ : k - 1;
        while (pos > 0 && v > vals[pos - 1]) {
            ids[pos] = ids[pos - 1];
            vals[pos] = vals[pos - 1];
            pos--;
        }
        ids[pos] = i;
        vals[pos] = v;
    }
    return len;
}

/* backend.h df_top_k_host. */
void df_top_k_host(const float *x, int width, int k, int32_t *ids, float *vals) {
    for (int i = 0; i < width; i++)
        if (isnan(x[i])) {
            ids[0] = -1;
            vals[0] = x[i];
            return;
        }
    (void)df_top_k_insert(x, width, k, ids, vals);
}

/* backend.h df_exp_nonpos. */
float df_exp_nonpos(float x) { return df_exp_nonpos_inl(x); }

/* backend.h df_sample_top_list. */
int32_t df_sample_top_list(const int32_t *ids, const float *vals, int n, const df_top_draw *d, uint64_t u) {
    float p[64];
    if (n > 64) n = 64;
    for (int j = 0; j < n; j++) p[j] = df_top_term(vals[j], vals[0], d->temperature);
    return df_top_draw_terms(ids, p, n, d->top_p, d->min_p, u);
}

/* backend.h `sample_top_dev` (backend memory is host memory here). */
static void cpu_sample_top_dev(df_backend *be, const float *x, int width, const df_top_draw *d, uint64_t u,
                               int32_t *out) {
    (void)be;
    int32_t ids[64];
    float vals[64];
    const int k = d->k < 1 ? 1 : (d->k > 64 ? 64 : d->k);
    df_top_k_host(x, width, k < width ? k : width, ids, vals);
    out[0] = ids[0] < 0 || !isfinite(vals[0]) ? -1 : df_sample_top_list(ids, vals, k < width ? k : width, d, u);
}

/* backend.h `read_ahead`: every op has run when it returns here. */
static void cpu_read_ahead(df_backend *be, void *dst, const void *src, size_t n) {
    (void)be;
    if (n && dst != src) memcpy(dst, src, n);
}

/* backend.h `top_k` (backend memory is host memory here). */
static void cpu_top_k(df_backend *be, const float *x, int width, int k, int32_t *ids, float *vals) {
    (void)be;
    df_top_k_host(x, width, k, ids, vals);
}

/* backend.h `argmax_dev` (backend memory is host memory here). */
static void cpu_argmax_dev(df_backend *be, const float *x, int rows, int width, int32_t *out, int32_t bad) {
    cpu_argmax(be, x, rows, width, out);
    for (int r = 0; r < rows; r++)
        if (out[r] < 0) out[r] = bad;
}

/* ---- construction --------------------------------------------------------------------------- */

static void cpu_destroy(df_backend *be) {
    cpu_backend *cb = cpu(be);
    if (!cb) return;
    df_pool_free(cb->pool);
    free(cb->xr);
    free(cb->wrow);
    free(cb->scores);
    free(cb);
}

static const df_backend_ops cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .dealloc = cpu_dealloc,
    .to_device = cpu_copy,
    .to_host = cpu_copy,
    .copy_rows = cpu_copy_rows,
    .copy = cpu_copy,
    .zero = cpu_zero,
    .embed = cpu_embed,
    .linear = cpu_linear,
    .rmsnorm = cpu_rmsnorm,
    .add = cpu_add,
    .swiglu = cpu_swiglu,
    .attention = cpu_attention,
    .kv_append = cpu_kv_append,
    .dyn_conv = cpu_dyn_conv,
    .gdn = cpu_gdn,
    .argmax = cpu_argmax,
    .top_k = cpu_top_k,
    .embed_dev = cpu_embed, /* ids in backend memory are host memory here */
    .argmax_dev = cpu_argmax_dev,
    .sample_top_dev = cpu_sample_top_dev,
    .read_ahead = cpu_read_ahead,
};

df_status df_backend_cpu_create(df_backend **out, int n_threads, df_error *err) {
    *out = NULL;
    cpu_backend *cb = calloc(1, sizeof *cb);
    if (!cb) return df_error_set(err, DF_ERR_NOMEM, "cpu backend: out of memory");
    if (n_threads <= 0) n_threads = df_cpu_count();
    df_status st = df_pool_init(&cb->pool, n_threads, err);
    if (st != DF_OK) {
        free(cb);
        return st;
    }
    pthread_once(&lut_once, lut_init);
    cb->base.ops = &cpu_ops;
    cb->base.n_threads = n_threads;
    *out = &cb->base;
    return DF_OK;
}
