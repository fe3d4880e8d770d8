/* The CUDA backend: bookkeeping (device memory, the weight table, scratch buffers) and the
 * ops of backend.h, each a few launches of the kernels in cuda_kernels.cu
 * (see cuda_backend.h for the contract). Library code: never prints, never exits; a failing
 * op sets be->failed and keeps the first message for df_backend_cuda_last_error.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.h"

/* ---- tables ----------------------------------------------------------------------------------- */

enum { W_VEC = 1, W_LIN = 2, W_EMB = 3 };
enum { LIN_SIMPLE = 0 }; /* otherwise a DFK_MMA_* mode */

#define FP_BYTES 32

/* An uploaded weight. Fingerprint: the shape fields and bytes at the start, middle and end
 * of the host data. */
typedef struct wentry {
    const void *key;
    int kind;
    /* fingerprint */
    size_t host_bytes;
    int rows, cols, bits, gs, wdtype, sdtype, hb;
    const void *h_scales, *h_biases;
    const float *h_signs;
    unsigned char fp[3][FP_BYTES];
    /* device copies */
    void *d_w, *d_s, *d_b;
    float *d_signs;
    int mode;   /* W_LIN: LIN_SIMPLE or DFK_MMA_* */
    int lgs;    /* group size of the MMA layout */
    int KW;     /* K-slices of the MMA linear (from the shape only) */
} wentry;

typedef struct aentry {
    void *p;
    size_t bytes;
} aentry;

typedef struct cuda_backend {
    df_backend base;
    char err[256];
    /* weights: open addressing on (key, kind) */
    wentry **w;
    size_t w_cap, w_n;
    /* allocations: open addressing on the device pointer (tombstones = (void*)1) */
    aentry *a;
    size_t a_cap, a_n, a_used;
    size_t cur, peak, weight_bytes;
    /* scratch */
    float *xf;
    size_t xf_cap;
    float *xs;
    size_t xs_cap;
    uint32_t *xb;
    size_t xb_cap;
    float *part;
    size_t part_cap;
    float *conv_out;
    size_t conv_cap;
    int32_t *ids;
    int force_simple;
    int target_ctas;
} cuda_backend;

static cuda_backend *cub(df_backend *be) { return (cuda_backend *)be; }

static void fail(cuda_backend *cb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(cuda_backend *cb, const char *fmt, ...) {
    if (!cb->base.failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(cb->err, sizeof cb->err, fmt, ap);
        va_end(ap);
    }
    cb->base.failed = 1;
}

static int check(cuda_backend *cb, int st, const char *what) {
    if (st == 0) return 1;
    if (st < 0) fail(cb, "%s: unsupported shape on the CUDA backend", what);
    else fail(cb, "%s: CUDA error: %s", what, cudaGetErrorString((cudaError_t)st));
    return 0;
}

static size_t hash_ptr(const void *p) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

/* ---- device memory with accounting --------------------------------------------------------- */

static int a_grow(cuda_backend *cb) {
    size_t cap = cb->a_cap ? cb->a_cap * 2 : 1024;
    aentry *n = calloc(cap, sizeof *n);
    if (!n) return 0;
    for (size_t i = 0; i < cb->a_cap; i++) {
        void *p = cb->a[i].p;
        if (!p || p == (void *)1) continue;
        size_t h = hash_ptr(p) & (cap - 1);
        while (n[h].p) h = (h + 1) & (cap - 1);
        n[h] = cb->a[i];
    }
    free(cb->a);
    cb->a = n;
    cb->a_cap = cap;
    cb->a_used = cb->a_n;
    return 1;
}

static void *dmalloc(cuda_backend *cb, size_t bytes) {
    if ((cb->a_used + 1) * 2 > cb->a_cap && !a_grow(cb)) return NULL;
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    size_t h = hash_ptr(p) & (cb->a_cap - 1);
    while (cb->a[h].p && cb->a[h].p != (void *)1) h = (h + 1) & (cb->a_cap - 1);
    if (!cb->a[h].p) cb->a_used++;
    cb->a[h].p = p;
    cb->a[h].bytes = bytes;
    cb->a_n++;
    cb->cur += bytes;
    if (cb->cur > cb->peak) cb->peak = cb->cur;
    return p;
}

static size_t dfree(cuda_backend *cb, void *p) {
    if (!p) return 0;
    size_t bytes = 0;
    if (cb->a_cap) {
        size_t h = hash_ptr(p) & (cb->a_cap - 1);
        while (cb->a[h].p) {
            if (cb->a[h].p == p) {
                bytes = cb->a[h].bytes;
                cb->a[h].p = (void *)1;
                cb->a_n--;
                cb->cur -= bytes;
                break;
            }
            h = (h + 1) & (cb->a_cap - 1);
        }
    }
    cudaFree(p);
    return bytes;
}

/* Grows a scratch buffer to n elements of size esz (contents not kept). */
static int scratch(cuda_backend *cb, void **buf, size_t *cap, size_t n, size_t esz) {
    if (*cap >= n && *buf) return 1;
    size_t want = n + n / 4 + 64;
    dfree(cb, *buf);
    *buf = dmalloc(cb, want * esz);
    *cap = *buf ? want : 0;
    if (!*buf) fail(cb, "CUDA backend: out of device memory for %zu bytes of scratch", want * esz);
    return *buf != NULL;
}

/* ---- weights ------------------------------------------------------------------------------ */

static size_t dtype_size(df_dtype t) { return t == DF_DTYPE_F32 || t == DF_DTYPE_U32 ? 4 : 2; }

static void fingerprint(const void *host, size_t n, unsigned char fp[3][FP_BYTES]) {
    memset(fp, 0, 3 * FP_BYTES);
    if (!host || !n) return;
    const unsigned char *p = host;
    size_t k = n < FP_BYTES ? n : FP_BYTES;
    memcpy(fp[0], p, k);
    memcpy(fp[1], p + (n - k) / 2, k);
    memcpy(fp[2], p + n - k, k);
}

static void wentry_release(cuda_backend *cb, wentry *e) {
    size_t b = dfree(cb, e->d_w) + dfree(cb, e->d_s) + dfree(cb, e->d_b) + dfree(cb, e->d_signs);
    cb->weight_bytes -= b;
    e->d_w = e->d_s = e->d_b = NULL;
    e->d_signs = NULL;
}

static int w_grow(cuda_backend *cb) {
    size_t cap = cb->w_cap ? cb->w_cap * 2 : 1024;
    wentry **n = calloc(cap, sizeof *n);
    if (!n) return 0;
    for (size_t i = 0; i < cb->w_cap; i++) {
        wentry *e = cb->w[i];
        if (!e) continue;
        size_t h = (hash_ptr(e->key) + (size_t)e->kind) & (cap - 1);
        while (n[h]) h = (h + 1) & (cap - 1);
        n[h] = e;
    }
    free(cb->w);
    cb->w = n;
    cb->w_cap = cap;
    return 1;
}

/* The entry for (key, kind), created empty if absent (NULL on out of host memory). */
static wentry *w_slot(cuda_backend *cb, const void *key, int kind, int *fresh) {
    *fresh = 0;
    if ((cb->w_n + 1) * 2 > cb->w_cap && !w_grow(cb)) return NULL;
    size_t h = (hash_ptr(key) + (size_t)kind) & (cb->w_cap - 1);
    while (cb->w[h]) {
        if (cb->w[h]->key == key && cb->w[h]->kind == kind) return cb->w[h];
        h = (h + 1) & (cb->w_cap - 1);
    }
    wentry *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->key = key;
    e->kind = kind;
    cb->w[h] = e;
    cb->w_n++;
    *fresh = 1;
    return e;
}

static void *upload(cuda_backend *cb, const void *host, size_t bytes) {
    void *d = dmalloc(cb, bytes);
    if (!d) return NULL;
    if (cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        cudaGetLastError();
        dfree(cb, d);
        return NULL;
    }
    cb->weight_bytes += bytes;
    return d;
}

static void *walloc(cuda_backend *cb, size_t bytes) {
    void *d = dmalloc(cb, bytes);
    if (d) cb->weight_bytes += bytes;
    return d;
}

/* Device copy of a float vector of n elements (norm weights, conv weights, A_log, ...). */
static const float *dvec(cuda_backend *cb, const float *host, size_t n) {
    if (!host) return NULL;
    int fresh;
    wentry *e = w_slot(cb, host, W_VEC, &fresh);
    if (!e) {
        fail(cb, "CUDA backend: out of host memory");
        return NULL;
    }
    unsigned char fp[3][FP_BYTES];
    fingerprint(host, n * sizeof(float), fp);
    if (!fresh && e->host_bytes == n * sizeof(float) && memcmp(fp, e->fp, sizeof fp) == 0) return e->d_w;
    wentry_release(cb, e);
    e->host_bytes = n * sizeof(float);
    memcpy(e->fp, fp, sizeof fp);
    e->d_w = upload(cb, host, n * sizeof(float));
    if (!e->d_w) {
        e->host_bytes = 0;
        fail(cb, "CUDA backend: out of device memory uploading a vector of %zu floats", n);
    }
    return e->d_w;
}

static size_t lin_host_bytes(const df_linear *L) {
    if (L->bits > 0) return (size_t)L->rows * ((size_t)L->cols * (size_t)L->bits / 32) * 4;
    return (size_t)L->rows * (size_t)L->cols * dtype_size(L->wdtype);
}

static int same_linear(const wentry *e, const df_linear *L, unsigned char fp[3][FP_BYTES]) {
    return e->rows == L->rows && e->cols == L->cols && e->bits == L->bits && e->gs == L->group_size &&
           e->wdtype == (int)L->wdtype && e->sdtype == (int)L->sdtype && e->hb == L->hadamard_block &&
           e->h_scales == L->scales && e->h_biases == L->biases && e->h_signs == L->signs &&
           memcmp(fp, e->fp, 3 * FP_BYTES) == 0;
}

/* K-slices per CTA of the tensor-core linear: from the shape alone (never from M), so that a
 * row's reduction order is the same in every call. Eight slices (one per warp) keep the most
 * loads in flight for a single row; fewer when the weight has fewer than eight groups. */
static int choose_kw(int rows, int ng) {
    (void)rows;
    const char *force = getenv("DFLASH_CUDA_KW"); /* experiments only: fixed for the process */
    if (force && (atoi(force) == 1 || atoi(force) == 2 || atoi(force) == 4 || atoi(force) == 8) && atoi(force) <= ng)
        return atoi(force);
    int kw = 1;
    while (kw < 8 && kw * 2 <= ng) kw *= 2;
    return kw;
}

static int wdtype_code(df_dtype t) { return t == DF_DTYPE_F32 ? 2 : (t == DF_DTYPE_BF16 ? 1 : 0); }

/* Uploads (and for the tensor-core path repacks) a linear or an embedding. */
static const wentry *dlin(cuda_backend *cb, const df_linear *L, int kind) {
    int fresh;
    wentry *e = w_slot(cb, L->w, kind, &fresh);
    if (!e) {
        fail(cb, "CUDA backend: out of host memory");
        return NULL;
    }
    const size_t hbytes = lin_host_bytes(L);
    unsigned char fp[3][FP_BYTES];
    fingerprint(L->w, hbytes, fp);
    if (!fresh && e->d_w && same_linear(e, L, fp)) return e;
    wentry_release(cb, e);
    e->rows = L->rows;
    e->cols = L->cols;
    e->bits = L->bits;
    e->gs = L->group_size;
    e->wdtype = (int)L->wdtype;
    e->sdtype = (int)L->sdtype;
    e->hb = L->hadamard_block;
    e->h_scales = L->scales;
    e->h_biases = L->biases;
    e->h_signs = L->signs;
    memcpy(e->fp, fp, sizeof fp);
    e->mode = LIN_SIMPLE;
    e->lgs = 0;
    e->KW = 1;
    const int rows = L->rows, cols = L->cols, tiles = (rows + 15) / 16;
    const size_t sb_bytes = L->bits > 0 ? (size_t)rows * (size_t)(cols / L->group_size) * 2 : 0;
    if (kind == W_LIN && !cb->force_simple) {
        if ((L->bits == 2 || L->bits == 4 || L->bits == 8) && (L->group_size == 64 || L->group_size == 128) &&
            cols % L->group_size == 0 && (L->sdtype == DF_DTYPE_F16 || L->sdtype == DF_DTYPE_BF16))
            e->mode = L->bits, e->lgs = L->group_size;
        else if (L->bits == 0 && L->wdtype == DF_DTYPE_BF16 && cols % 64 == 0)
            e->mode = DFK_MMA_BF16, e->lgs = 64;
    }
    int ok = 1;
    if (e->mode != LIN_SIMPLE) {
        const int ng = cols / e->lgs;
        e->KW = choose_kw(rows, ng);
        const size_t wpl = e->mode == DFK_MMA_BF16 ? (size_t)(e->lgs / 16) * 4 : (size_t)e->mode * (size_t)e->lgs / 64;
        const size_t nwords = (size_t)tiles * (size_t)ng * 32 * wpl;
        void *t_w = dmalloc(cb, hbytes), *t_s = NULL, *t_b = NULL;
        ok = t_w && cudaMemcpy(t_w, L->w, hbytes, cudaMemcpyHostToDevice) == cudaSuccess;
        if (ok && e->mode != DFK_MMA_BF16) {
            t_s = dmalloc(cb, sb_bytes);
            t_b = dmalloc(cb, sb_bytes);
            ok = t_s && t_b && cudaMemcpy(t_s, L->scales, sb_bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
                 cudaMemcpy(t_b, L->biases, sb_bytes, cudaMemcpyHostToDevice) == cudaSuccess;
        }
        if (ok) {
            e->d_w = walloc(cb, nwords * 4);
            ok = e->d_w != NULL;
        }
        if (ok && e->mode != DFK_MMA_BF16) {
            e->d_s = walloc(cb, (size_t)tiles * (size_t)ng * 16 * 4);
            ok = e->d_s != NULL;
        }
        if (ok) {
            int st = e->mode == DFK_MMA_BF16 ? dfk_repack_bf16(t_w, rows, cols, e->d_w)
                                             : dfk_repack_quant(t_w, t_s, t_b, rows, cols, L->bits, L->group_size,
                                                                e->d_w, e->d_s);
            if (st == 0) st = (int)cudaDeviceSynchronize();
            if (st != 0) {
                fail(cb, "CUDA backend: repacking %s: %s", L->name ? L->name : "(linear)",
                     cudaGetErrorString((cudaError_t)st));
                ok = 0;
            }
        }
        dfree(cb, t_w);
        dfree(cb, t_s);
        dfree(cb, t_b);
    } else {
        e->d_w = upload(cb, L->w, hbytes);
        ok = e->d_w != NULL;
        if (ok && L->bits > 0) {
            e->d_s = upload(cb, L->scales, sb_bytes);
            e->d_b = upload(cb, L->biases, sb_bytes);
            ok = e->d_s && e->d_b;
        }
    }
    if (ok && L->hadamard_block > 0) {
        e->d_signs = upload(cb, L->signs, (size_t)cols * sizeof(float));
        ok = e->d_signs != NULL;
    }
    if (!ok) {
        wentry_release(cb, e);
        fail(cb, "CUDA backend: out of device memory uploading %s (%d x %d)", L->name ? L->name : "(linear)", rows,
             cols);
        return NULL;
    }
    return e;
}

/* ---- memory ops -------------------------------------------------------------------------------- */

static void *cu_alloc(df_backend *be, size_t bytes) {
    cuda_backend *cb = cub(be);
    void *p = dmalloc(cb, bytes);
    if (p && cudaMemset(p, 0, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        dfree(cb, p);
        return NULL;
    }
    return p;
}

static void cu_dealloc(df_backend *be, void *p) { dfree(cub(be), p); }

static void cu_to_device(df_backend *be, void *dst, const void *src, size_t n) {
    if (n) check(cub(be), (int)cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "to_device");
}
static void cu_to_host(df_backend *be, void *dst, const void *src, size_t n) {
    if (n) check(cub(be), (int)cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "to_host");
}
static void cu_copy(df_backend *be, void *dst, const void *src, size_t n) {
    if (n) check(cub(be), (int)cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, 0), "copy");
}
static void cu_zero(df_backend *be, void *dst, size_t n) {
    if (n) check(cub(be), (int)cudaMemsetAsync(dst, 0, n, 0), "zero");
}

/* ---- ops ------------------------------------------------------------------------------------------ */

static float hadamard_scale(int hb) { return hb > 0 ? (float)(1.0 / sqrt((double)hb)) : 1.0f; }

static void cu_embed(df_backend *be, const df_linear *E, const int32_t *ids, int M, float *out) {
    cuda_backend *cb = cub(be);
    if (E->cols > 12288) {
        fail(cb, "embed: width %d above 12288 is not supported on the CUDA backend", E->cols);
        return;
    }
    const wentry *e = dlin(cb, E, W_EMB);
    if (!e) return;
    for (int m0 = 0; m0 < M; m0 += DFK_MAX_ROWS) {
        int mm = M - m0 < DFK_MAX_ROWS ? M - m0 : DFK_MAX_ROWS;
        dfk_rows16 r;
        memset(&r, 0, sizeof r);
        for (int m = 0; m < mm; m++) r.v[m] = ids[m0 + m];
        int st = dfk_embed(E->bits > 0 ? e->d_w : NULL, e->d_s, e->d_b, E->sdtype == DF_DTYPE_BF16, E->bits,
                           E->group_size, E->bits > 0 ? NULL : e->d_w, wdtype_code(E->wdtype), E->rows, E->cols,
                           e->d_signs, E->hadamard_block, hadamard_scale(E->hadamard_block), r, mm,
                           out + (size_t)m0 * (size_t)E->cols);
        if (!check(cb, st, "embed")) return;
    }
}

/* Columns one prep block handles: a multiple of hb and gs dividing cols, up to 1024 (or hb). */
static int prep_seg(int cols, int hb, int gs) {
    int seg = 16;
    if (hb > seg) seg = hb;
    if (gs > seg) seg = gs;
    while (seg < 1024 && cols % (2 * seg) == 0) seg *= 2;
    return seg;
}

static int pow2floor(int x) {
    int p = 1;
    while (p * 2 <= x) p *= 2;
    return p;
}

static void cu_linear(df_backend *be, const df_linear *W, const float *x, int M, float *y) {
    cuda_backend *cb = cub(be);
    const wentry *e = dlin(cb, W, W_LIN);
    if (!e) return;
    const int rows = W->rows, cols = W->cols, hb = W->hadamard_block;
    if (hb > 8192 || (hb > 0 && cols % hb != 0)) {
        fail(cb, "linear %s: Hadamard block %d not supported on the CUDA backend", W->name ? W->name : "", hb);
        return;
    }
    for (int m0 = 0; m0 < M; m0 += DFK_MAX_ROWS) {
        const int mm = M - m0 < DFK_MAX_ROWS ? M - m0 : DFK_MAX_ROWS;
        const float *xin = x + (size_t)m0 * (size_t)cols;
        float *yout = y + (size_t)m0 * (size_t)rows;
        if (e->mode == LIN_SIMPLE) {
            const float *xf = xin;
            if (hb > 0) {
                if (!scratch(cb, (void **)&cb->xf, &cb->xf_cap, (size_t)mm * (size_t)cols, sizeof(float))) return;
                int st = dfk_prep(xin, mm, cols, e->d_signs, hb, hadamard_scale(hb), 0, prep_seg(cols, hb, 0), cb->xf,
                                  NULL, NULL);
                if (!check(cb, st, "linear prep")) return;
                xf = cb->xf;
            }
            int st = dfk_linear_simple(e->d_w, wdtype_code(W->wdtype), e->d_s, e->d_b, W->sdtype == DF_DTYPE_BF16,
                                       W->bits, W->group_size, rows, cols, xf, mm, yout);
            if (!check(cb, st, "linear")) return;
            continue;
        }
        const int quant = e->mode != DFK_MMA_BF16;
        const int gs = quant ? e->lgs : 0;
        const size_t kbt = (size_t)cols / 16, pairs = (size_t)(mm + 1) / 2;
        if (!scratch(cb, (void **)&cb->xf, &cb->xf_cap, (size_t)mm * (size_t)cols, sizeof(float)) ||
            !scratch(cb, (void **)&cb->xb, &cb->xb_cap, pairs * kbt * 32 * 2, sizeof(uint32_t)) ||
            (quant && !scratch(cb, (void **)&cb->xs, &cb->xs_cap, (size_t)mm * (size_t)(cols / gs), sizeof(float))))
            return;
        int st = dfk_prep(xin, mm, cols, hb > 0 ? e->d_signs : NULL, hb, hadamard_scale(hb), gs,
                          prep_seg(cols, hb, quant ? gs : 64), cb->xf, quant ? cb->xs : NULL, cb->xb);
        if (!check(cb, st, "linear prep")) return;
        const int tiles = (rows + 15) / 16, RW = 8 / e->KW;
        int tr = pow2floor(tiles / (RW * cb->target_ctas) > 0 ? tiles / (RW * cb->target_ctas) : 1);
        const int trmax = dfk_linear_mma_max_tr(e->mode, e->lgs, mm);
        if (tr > trmax) tr = trmax;
        st = dfk_linear_mma(e->mode, e->lgs, e->d_w, e->d_s, W->sdtype == DF_DTYPE_BF16, rows, cols, cb->xb,
                            quant ? cb->xs : NULL, mm, e->KW, tr, yout);
        if (!check(cb, st, "linear")) return;
    }
}

static void cu_rmsnorm(df_backend *be, const float *x, const float *w, int rows, int width, float eps, float *y) {
    cuda_backend *cb = cub(be);
    const float *dw = NULL;
    if (w && !(dw = dvec(cb, w, (size_t)width))) return;
    check(cb, dfk_rmsnorm(x, dw, rows, width, eps, y), "rmsnorm");
}

static void cu_add(df_backend *be, float *y, const float *x, size_t n) {
    if (n) check(cub(be), dfk_add(y, x, n), "add");
}

static void cu_swiglu(df_backend *be, const float *gate, const float *up, size_t n, float *out) {
    if (n) check(cub(be), dfk_swiglu(gate, up, n, out), "swiglu");
}

static int attn_shape_ok(cuda_backend *cb, const df_attn_shape *sh, int M) {
    if (M < 1 || M > DFK_MAX_ROWS || sh->head_dim > 1024 || sh->rot_dims > sh->head_dim || sh->n_kv_heads <= 0 ||
        sh->n_heads % sh->n_kv_heads != 0) {
        fail(cb, "attention: unsupported shape (M %d, head_dim %d, heads %d/%d) on the CUDA backend", M, sh->head_dim,
             sh->n_heads, sh->n_kv_heads);
        return 0;
    }
    return 1;
}

static dfk_rows16 rows16(const int32_t *v, int M) {
    dfk_rows16 r;
    memset(&r, 0, sizeof r);
    for (int m = 0; m < M && m < DFK_MAX_ROWS; m++) r.v[m] = v[m];
    return r;
}

static void cu_kv_append(df_backend *be, const df_attn_shape *sh, float *k, const float *v, const float *k_norm,
                         const int32_t *positions, int M, float *k_cache, float *v_cache, int pos0) {
    cuda_backend *cb = cub(be);
    if (!attn_shape_ok(cb, sh, M)) return;
    const float *kn = NULL;
    if (k_norm && !(kn = dvec(cb, k_norm, (size_t)sh->head_dim))) return;
    int st = dfk_qk_prep(NULL, 0, sh->n_heads, k, v, sh->n_kv_heads, sh->head_dim, NULL, kn, sh->rot_dims,
                         sh->rope_theta, sh->eps, rows16(positions, M), M, k_cache, v_cache, pos0);
    check(cb, st, "kv_append");
}

static void cu_attention(df_backend *be, const df_attn_shape *sh, float *q, float *k, const float *v,
                         const float *q_norm, const float *k_norm, const int32_t *positions, int M, float *k_cache,
                         float *v_cache, int pos0, float *out) {
    cuda_backend *cb = cub(be);
    if (!attn_shape_ok(cb, sh, M)) return;
    const int hd = sh->head_dim, qstride = (sh->gated ? 2 : 1) * hd;
    const float *qn = NULL, *kn = NULL;
    if (q_norm && !(qn = dvec(cb, q_norm, (size_t)hd))) return;
    if (k_norm && !(kn = dvec(cb, k_norm, (size_t)hd))) return;
    int st = dfk_qk_prep(q, qstride, sh->n_heads, k, v, sh->n_kv_heads, hd, qn, kn, sh->rot_dims, sh->rope_theta,
                         sh->eps, rows16(positions, M), M, k_cache, v_cache, pos0);
    if (!check(cb, st, "attention prep")) return;
    const int nchunk = (pos0 + M + DFK_ATTN_CHUNK - 1) / DFK_ATTN_CHUNK;
    if (!scratch(cb, (void **)&cb->part, &cb->part_cap,
                 (size_t)M * (size_t)sh->n_heads * (size_t)nchunk * (size_t)(hd + 2), sizeof(float)))
        return;
    st = dfk_attention(q, qstride, sh->gated, sh->n_heads, sh->n_kv_heads, hd, k_cache, v_cache, sh->causal, pos0, M,
                       nchunk, cb->part, out);
    check(cb, st, "attention");
}

static void cu_gdn(df_backend *be, const df_gdn_shape *sh, const float *qkv, const float *z, const float *a,
                   const float *b, const float *conv_w, const float *A_log, const float *dt_bias, const float *norm_w,
                   int M, float *conv_state, float *S, float *out) {
    cuda_backend *cb = cub(be);
    const int nk = sh->n_k_heads, nv = sh->n_v_heads, dk = sh->k_head_dim, dv = sh->v_head_dim;
    const int C = 2 * nk * dk + nv * dv, K = sh->conv_kernel;
    const float *cw = dvec(cb, conv_w, (size_t)C * (size_t)K);
    const float *al = dvec(cb, A_log, (size_t)nv);
    const float *dt = dvec(cb, dt_bias, (size_t)nv);
    const float *nw = dvec(cb, norm_w, (size_t)dv);
    if (!cw || !al || !dt || !nw) {
        if (!be->failed) fail(cb, "gdn: missing weights");
        return;
    }
    if (!scratch(cb, (void **)&cb->conv_out, &cb->conv_cap, (size_t)M * (size_t)C, sizeof(float))) return;
    if (!check(cb, dfk_gdn_conv(qkv, cw, C, K, M, conv_state, cb->conv_out), "gdn conv")) return;
    int st = dfk_gdn_recurrence(cb->conv_out, z, a, b, al, dt, nw, nk, nv, dk, dv, sh->eps, M, S, out);
    check(cb, st, "gdn recurrence");
}

static void cu_argmax(df_backend *be, const float *x, int rows, int width, int32_t *out) {
    cuda_backend *cb = cub(be);
    for (int r0 = 0; r0 < rows; r0 += DFK_MAX_ROWS) {
        int n = rows - r0 < DFK_MAX_ROWS ? rows - r0 : DFK_MAX_ROWS;
        if (!check(cb, dfk_argmax(x + (size_t)r0 * (size_t)width, n, width, cb->ids), "argmax")) return;
        if (!check(cb, (int)cudaMemcpy(out + r0, cb->ids, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost),
                   "argmax"))
            return;
    }
}

/* ---- construction ---------------------------------------------------------------------------------- */

static void cu_destroy(df_backend *be) {
    cuda_backend *cb = cub(be);
    if (!cb) return;
    for (size_t i = 0; i < cb->w_cap; i++) {
        if (!cb->w[i]) continue;
        wentry_release(cb, cb->w[i]);
        free(cb->w[i]);
    }
    free(cb->w);
    void *bufs[] = {cb->xf, cb->xs, cb->xb, cb->part, cb->conv_out, cb->ids};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) dfree(cb, bufs[i]);
    /* buffers the caller did not free */
    for (size_t i = 0; i < cb->a_cap; i++)
        if (cb->a[i].p && cb->a[i].p != (void *)1) cudaFree(cb->a[i].p);
    free(cb->a);
    free(cb);
}

static const df_backend_ops cuda_ops = {
    .name = "cuda",
    .destroy = cu_destroy,
    .alloc = cu_alloc,
    .dealloc = cu_dealloc,
    .to_device = cu_to_device,
    .to_host = cu_to_host,
    .copy = cu_copy,
    .zero = cu_zero,
    .embed = cu_embed,
    .linear = cu_linear,
    .rmsnorm = cu_rmsnorm,
    .add = cu_add,
    .swiglu = cu_swiglu,
    .attention = cu_attention,
    .kv_append = cu_kv_append,
    .gdn = cu_gdn,
    .argmax = cu_argmax,
};

int df_cuda_available(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n > 0;
}

df_status df_backend_cuda_create(df_backend **out, int device, df_error *err) {
    *out = NULL;
    int n = 0;
    cudaError_t ce = cudaGetDeviceCount(&n);
    if (ce != cudaSuccess || n <= 0) {
        cudaGetLastError();
        return df_error_set(err, DF_ERR_UNSUPPORTED, "CUDA backend: no usable GPU (%s)",
                            ce != cudaSuccess ? cudaGetErrorString(ce) : "no device");
    }
    if (device < 0 || device >= n)
        return df_error_set(err, DF_ERR_INVALID_ARG, "CUDA backend: device %d does not exist (%d found)", device, n);
    if ((ce = cudaSetDevice(device)) != cudaSuccess)
        return df_error_set(err, DF_ERR_UNSUPPORTED, "CUDA backend: cannot use device %d: %s", device,
                            cudaGetErrorString(ce));
    cuda_backend *cb = calloc(1, sizeof *cb);
    if (!cb) return df_error_set(err, DF_ERR_NOMEM, "CUDA backend: out of memory");
    cb->base.ops = &cuda_ops;
    cb->base.n_threads = 1;
    const char *lin = getenv("DFLASH_CUDA_LINEAR");
    cb->force_simple = lin && strcmp(lin, "simple") == 0;
    const char *ctas = getenv("DFLASH_CUDA_TARGET_CTAS");
    cb->target_ctas = ctas && atoi(ctas) > 0 ? atoi(ctas) : 1056; /* about 4 waves of 2 CTAs per SM */
    if (!w_grow(cb) || !a_grow(cb) || !(cb->ids = dmalloc(cb, DFK_MAX_ROWS * sizeof(int32_t)))) {
        cu_destroy(&cb->base);
        return df_error_set(err, DF_ERR_NOMEM, "CUDA backend: out of memory");
    }
    *out = &cb->base;
    return DF_OK;
}

const char *df_backend_cuda_last_error(df_backend *be) { return cub(be)->err; }

void df_backend_cuda_stats(df_backend *be, df_cuda_stats *st) {
    cuda_backend *cb = cub(be);
    st->cur_bytes = cb->cur;
    st->peak_bytes = cb->peak;
    st->weight_bytes = cb->weight_bytes;
    int nw = 0;
    for (size_t i = 0; i < cb->w_cap; i++)
        if (cb->w[i] && cb->w[i]->d_w) nw++;
    st->n_weights = nw;
}

void df_backend_cuda_reset_peak(df_backend *be) { cub(be)->peak = cub(be)->cur; }

void df_backend_cuda_sync(df_backend *be) {
    if (cudaDeviceSynchronize() != cudaSuccess) fail(cub(be), "sync: %s", cudaGetErrorString(cudaGetLastError()));
}

df_status df_cuda_copy_bandwidth(size_t bytes, double *gbps, df_error *err) {
    int st = dfk_copy_bandwidth(bytes, 20, gbps);
    if (st) return df_error_set(err, DF_ERR_INTERNAL, "copy bandwidth: %s", cudaGetErrorString((cudaError_t)st));
    return DF_OK;
}

df_status df_cuda_device_info(char *name, size_t name_len, size_t *total_bytes, df_error *err) {
    struct cudaDeviceProp p;
    cudaError_t ce = cudaGetDeviceProperties(&p, 0);
    if (ce != cudaSuccess) return df_error_set(err, DF_ERR_UNSUPPORTED, "device info: %s", cudaGetErrorString(ce));
    snprintf(name, name_len, "%s (%d SMs, sm_%d%d)", p.name, p.multiProcessorCount, p.major, p.minor);
    *total_bytes = p.totalGlobalMem;
    return DF_OK;
}
