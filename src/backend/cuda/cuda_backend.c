/* The CUDA backend: bookkeeping (device memory, the weight table, scratch buffers) and the
 * ops of backend.h, each a few launches of the kernels in cuda_kernels.cu
 * (see cuda_backend.h for the contract). Library code: never prints, never exits; a failing
 * op sets be->failed and keeps the first message for df_backend_cuda_last_error.
 */
#include <cuda_runtime_api.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/step_writes.h"

/* ---- tables ----------------------------------------------------------------------------------- */

enum { W_VEC = 1, W_LIN = 2, W_EMB = 3 };
/* linear modes: LIN_SIMPLE (CUDA cores, any format), a DFK_MMA_* mode (bf16 tensor cores),
 * LIN_Q (fixed-point integer tensor cores, cuda_qlin.cu), LIN_DENSE (dense 16-bit, CUDA cores) */
enum { LIN_SIMPLE = 0, LIN_Q = 32, LIN_DENSE = 33 };

#define FP_BYTES 32
#define DF_CUDA_MAX_CONST 32

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

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
    int sbf;    /* LIN_Q: the scale format of dfk_linear_q (1 bf16; plus 2 scales only) */
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
    void *tk; /* top_k's result: 64 ids, then 64 values (allocated at the first use) */
    /* prepared inputs of the fixed-point linears: one slot per linear of a call */
    uint32_t *qx[DFK_QMAX];
    float *qe[DFK_QMAX], *qs[DFK_QMAX];
    size_t qx_cap[DFK_QMAX], qe_cap[DFK_QMAX], qs_cap[DFK_QMAX];
    float *hbuf, *lbuf;
    size_t hbuf_cap, lbuf_cap;
    void *mbuf; /* overlapping copies go through it */
    size_t mbuf_cap;
    int force_simple;
    int qpath; /* 1: quantized 2/4/8-bit weights run on the fixed-point path (default) */
    int q_scales_only; /* 1: ternary weights (biases = −scales) stored without their biases
                          (DFLASH_CUDA_QSCALES=0 keeps them: the same bits, more bytes) */
    int target_ctas;
    int dense_first;        /* dense linears of a group launched before its fixed-point ones (DFLASH_CUDA_DENSE_FIRST) */
    int dense_ride;         /* dense linears of a group ride along with its fixed-point launch (DFLASH_CUDA_DENSE_RIDE) */
    char profile_skip[256]; /* DFLASH_CUDA_PROFILE_SKIP: commands not run (timing experiments only) */
    int mma_group; /* 1: the tensor-core linears of one input in one launch (DFLASH_CUDA_MMA_GROUP) */
    int q_ring, q_ctas, q_ring_max_m, q_bulk, q_split_bytes, q_split_rows; /* dfk_linear_q's schedule (DFLASH_CUDA_QRING, _QCTAS,
                                                 _QRING_MAXM, _QBULK, _QSPLIT_BYTES, _QSPLIT_ROWS) */
    /* step recording (see "steps and graphs" below) */
    cudaStream_t stream;
    struct cmd *cmds;
    size_t n_cmds, cap_cmds;
    uint64_t sig_hash;
    int32_t *dparams;           /* device, DF_CUDA_MAX_PARAMS ints (the host side: hparams()) */
    size_t n_params;
    unsigned char *dstage;      /* their device copy (DF_CUDA_STAGE_BYTES, allocated at the first to_device) */
    size_t n_stage;
    /* submitted steps (cu_submit): the pinned parameter block and staging buffer (hparams(),
     * hstage(): pinned host memory, DF_CUDA_MAX_PARAMS ints and DF_CUDA_STAGE_BYTES) are pair pb
     * of hp_buf / hs_buf; a
     * step launched without waiting leaves its pair to its copies and the next step takes the
     * other one, once the step that used it last (event pev[]) is done */
    int32_t *hp_buf[2];
    unsigned char *hs_buf[2];
    cudaEvent_t pev[2];
    int pev_set[2];
    int pb;
    int in_flight;              /* steps launched since the last wait */
    int submit_waits;           /* DFLASH_CUDA_SUBMIT=0: submit waits for the step (experiments) */
    int sw_at_wait;             /* DFLASH_CUDA_SW_AT_WAIT=1: the step-writes table is emptied at host
                                 * waits only, not at each step's launch (experiments) */
    void **dfree_later;         /* buffers to free after the step runs */
    size_t n_dfree, cap_dfree;
    struct gentry *graphs;      /* [DF_CUDA_MAX_GRAPHS] */
    /* the state buffers (GDN states, KV caches) that kernels recorded in this step write, from
     * which row on: a kernel may read a buffer before waiting for the previous kernel only where
     * no kernel since the last host synchronization wrote it (step_writes.h). Only kernels need
     * noting: copies and fills (copy, copy_rows, zero, to_device) are stream operations that no
     * kernel overlaps, so a later kernel, even before its wait, sees them done. */
    df_step_writes sw;
    uint64_t clock;
    int use_graphs;
    const char *trace_path; /* DFLASH_CUDA_TRACE: the timeline file written at destroy, or NULL */
    long n_steps, n_replays, n_captures;
    double t_step_end;                        /* monotonic ms of the last step's end (0: none yet) */
    double host_between_ms, host_launch_ms;   /* df_cuda_stats */
    int host_profile;                         /* DFLASH_CUDA_HOST_PROFILE: time the weight lookups and records */
    /* host ranges whose weights never change (df_backend_ops.host_const): their weights are
     * found by pointer and shape, without reading the host data to check it */
    const unsigned char *const_p[DF_CUDA_MAX_CONST];
    size_t const_n[DF_CUDA_MAX_CONST];
    int n_const;
    double host_weights_ms, host_record_ms;   /* df_cuda_stats (with host_profile) */
    long n_recorded;                          /* commands recorded */
} cuda_backend;

/* The pinned parameter block and staging buffer that the step being recorded fills: pair pb. */
static inline int32_t *hparams(const cuda_backend *cb) { return cb->hp_buf[cb->pb]; }
static inline unsigned char *hstage(const cuda_backend *cb) { return cb->hs_buf[cb->pb]; }

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
static void free_later(cuda_backend *cb, void *p);

static int scratch(cuda_backend *cb, void **buf, size_t *cap, size_t n, size_t esz) {
    if (*cap >= n && *buf) return 1;
    size_t want = n + n / 4 + 64;
    free_later(cb, *buf); /* recorded commands of this step may still use it */
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

/* 1 when [p, p + n) lies in a range registered as constant (cu_host_const). */
static int in_const(const cuda_backend *cb, const void *p, size_t n) {
    const unsigned char *b = p;
    for (int i = 0; i < cb->n_const; i++)
        if (b >= cb->const_p[i] && n <= cb->const_n[i] && (size_t)(b - cb->const_p[i]) <= cb->const_n[i] - n) return 1;
    return 0;
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

static const float *dvec_(cuda_backend *cb, const float *host, size_t n);
/* dvec_, timed with DFLASH_CUDA_HOST_PROFILE */
static const float *dvec(cuda_backend *cb, const float *host, size_t n) {
    if (!cb->host_profile) return dvec_(cb, host, n);
    const double t0 = now_ms();
    const float *d = dvec_(cb, host, n);
    cb->host_weights_ms += now_ms() - t0;
    return d;
}

/* Device copy of a float vector of n elements (norm weights, conv weights, A_log, ...). */
static const float *dvec_(cuda_backend *cb, const float *host, size_t n) {
    if (!host) return NULL;
    int fresh;
    wentry *e = w_slot(cb, host, W_VEC, &fresh);
    if (!e) {
        fail(cb, "CUDA backend: out of host memory");
        return NULL;
    }
    if (!fresh && e->d_w && e->host_bytes == n * sizeof(float) && in_const(cb, host, n * sizeof(float))) return e->d_w;
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

/* 1 when entry e holds linear L: its shape fields and pointers, and (fp != NULL) the
 * fingerprint of its host data. */
static int same_linear(const wentry *e, const df_linear *L, unsigned char fp[3][FP_BYTES]) {
    return e->rows == L->rows && e->cols == L->cols && e->bits == L->bits && e->gs == L->group_size &&
           e->wdtype == (int)L->wdtype && e->sdtype == (int)L->sdtype && e->hb == L->hadamard_block &&
           e->h_scales == L->scales && e->h_biases == L->biases && e->h_signs == L->signs &&
           (!fp || memcmp(fp, e->fp, 3 * FP_BYTES) == 0);
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

/* K-slices of a fixed-point weight: a function of its shape (and of the kernel, fixed per
 * backend), never of M, so the bits are the same on every GPU and for every M. The ring kernel
 * (units: 8/KW tiles, one per warp) takes the fewest slices that still give about 12800
 * warp-tiles (enough units to balance its persistent grid over the device), at most 8 and of at
 * least 8 groups each (a unit's fixed costs spread over more records; measured on the H200
 * against 4 groups: t(8) 9.75 against 10.19 ms, plain decoding the same); the register kernel
 * keeps tiles × slices below 2048 (its units are CTAs). */
static int choose_kw_q(int rows, int ng, int ring) {
    const char *force = getenv("DFLASH_CUDA_KW"); /* experiments only: fixed for the process */
    if (force && (atoi(force) == 1 || atoi(force) == 2 || atoi(force) == 4 || atoi(force) == 8) && atoi(force) <= ng)
        return atoi(force);
    const char *cap = getenv("DFLASH_CUDA_KW_MAX"); /* experiments only: at most this many slices */
    const int kmax = cap && atoi(cap) >= 1 && atoi(cap) <= 8 ? atoi(cap) : 8;
    const char *mg = getenv("DFLASH_CUDA_KW_GROUPS"); /* experiments only: groups per slice at least */
    const int gmin = mg && atoi(mg) >= 1 && atoi(mg) <= 64 ? atoi(mg) : 8;
    const int tiles = (rows + 15) / 16;
    int kw = 1;
    while (kw < kmax && (ring ? tiles * kw < 12800 : tiles * kw < 2048) && ng / (2 * kw) >= gmin) kw *= 2;
    return kw;
}

static int wdtype_code(df_dtype t) { return t == DF_DTYPE_F32 ? 2 : (t == DF_DTYPE_BF16 ? 1 : 0); }

static const wentry *dlin_(cuda_backend *cb, const df_linear *L, int kind);
/* dlin_, timed with DFLASH_CUDA_HOST_PROFILE */
static const wentry *dlin(cuda_backend *cb, const df_linear *L, int kind) {
    if (!cb->host_profile) return dlin_(cb, L, kind);
    const double t0 = now_ms();
    const wentry *e = dlin_(cb, L, kind);
    cb->host_weights_ms += now_ms() - t0;
    return e;
}

/* Uploads (and for the tensor-core path repacks) a linear or an embedding. */
static const wentry *dlin_(cuda_backend *cb, const df_linear *L, int kind) {
    int fresh;
    wentry *e = w_slot(cb, L->w, kind, &fresh);
    if (!e) {
        fail(cb, "CUDA backend: out of host memory");
        return NULL;
    }
    const size_t hbytes = lin_host_bytes(L);
    /* a weight in a constant range: the same pointer and shape are the same weight (its
     * fingerprint, three reads of host memory far apart, was most of a step's host time) */
    if (!fresh && e->d_w && in_const(cb, L->w, hbytes) && same_linear(e, L, NULL)) return e;
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
    e->sbf = L->sdtype == DF_DTYPE_BF16;
    const int rows = L->rows, cols = L->cols, tiles = (rows + 15) / 16;
    const size_t sb_bytes = L->bits > 0 ? (size_t)rows * (size_t)(cols / L->group_size) * 2 : 0;
    if (kind == W_LIN && !cb->force_simple) {
        if ((L->bits == 2 || L->bits == 4 || L->bits == 8) && (L->group_size == 64 || L->group_size == 128) &&
            cols % L->group_size == 0 && (L->sdtype == DF_DTYPE_F16 || L->sdtype == DF_DTYPE_BF16))
            e->mode = cb->qpath ? LIN_Q : L->bits, e->lgs = L->group_size;
        else if (L->bits == 0 && L->wdtype == DF_DTYPE_BF16 && cols % 64 == 0)
            e->mode = DFK_MMA_BF16, e->lgs = 64;
        else if (L->bits == 0 && (L->wdtype == DF_DTYPE_F16 || L->wdtype == DF_DTYPE_BF16) && cols % 8 == 0)
            e->mode = LIN_DENSE;
    }
    int ok = 1;
    if (e->mode != LIN_SIMPLE && e->mode != LIN_DENSE) { /* repacked on the device */
        const int ng = cols / e->lgs, q = e->mode == LIN_Q, quant = e->mode != DFK_MMA_BF16;
        e->KW = q ? choose_kw_q(rows, ng, cb->q_ring) : choose_kw(rows, ng);
        /* ternary 2-bit weights: the scales alone (5.6% fewer bytes a step) */
        const int so = q && cb->q_scales_only && L->bits == 2 && df_linear_biases_negate_scales(L);
        if (so) e->sbf |= 2;
        const size_t wpl = e->mode == DFK_MMA_BF16 ? (size_t)(e->lgs / 16) * 4 : (size_t)e->mode * (size_t)e->lgs / 64;
        const size_t nwords = q ? dfk_q_code_words(rows, cols, L->bits, L->group_size)
                                : (size_t)tiles * (size_t)ng * 32 * wpl;
        void *t_w = dmalloc(cb, hbytes), *t_s = NULL, *t_b = NULL;
        ok = t_w && cudaMemcpy(t_w, L->w, hbytes, cudaMemcpyHostToDevice) == cudaSuccess;
        if (ok && quant) {
            t_s = dmalloc(cb, sb_bytes);
            t_b = so ? NULL : dmalloc(cb, sb_bytes);
            ok = t_s && (so || t_b) && cudaMemcpy(t_s, L->scales, sb_bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
                 (so || cudaMemcpy(t_b, L->biases, sb_bytes, cudaMemcpyHostToDevice) == cudaSuccess);
        }
        if (ok) {
            e->d_w = walloc(cb, nwords * 4);
            ok = e->d_w != NULL;
        }
        if (ok && quant) {
            e->d_s = walloc(cb, (q ? dfk_q_sb_words(rows, cols, e->lgs, so) : (size_t)tiles * (size_t)ng * 16) * 4);
            ok = e->d_s != NULL;
        }
        if (ok) {
            int st = q ? dfk_repack_q(t_w, t_s, t_b, rows, cols, L->bits, L->group_size, e->KW, so, e->d_w, e->d_s)
                       : e->mode == DFK_MMA_BF16
                             ? dfk_repack_bf16(t_w, rows, cols, e->d_w)
                             : dfk_repack_quant(t_w, t_s, t_b, rows, cols, L->bits, L->group_size, e->d_w, e->d_s);
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

/* ---- steps and graphs --------------------------------------------------------------------------
 *
 * Ops do not launch at once: each records commands (a launcher and its arguments) into the
 * current step. A step runs when the host needs a result or a buffer goes away (to_host,
 * argmax, dealloc, sync, destroy): the values that change from step to step (token ids, RoPE
 * positions, the cache length pos0) travel in a small parameter block copied to the device
 * first, and kernels read them from there; host data for to_device is staged the same way (one
 * copy of the staging buffer to its device twin at the step's start, then a device-to-device
 * copy per to_device in the step's order: a host-to-device copy node in the middle of a
 * captured graph, after kernels with programmatic dependencies, was seen to leave stale data
 * on replays where the same copy at a graph's start does not). A step whose commands
 * (launchers, pointers, shapes) equal those of a step seen before runs as a replayed CUDA graph
 * (captured on its second occurrence), which removes the per-launch cost of ~1400 kernels per
 * decoded token. Replays run exactly the kernels with exactly the arguments of an eager run:
 * same bits. DFLASH_CUDA_GRAPHS=0 runs every step eagerly.
 *
 * `submit` launches the recorded step without waiting (the speculative round queues its drafter
 * pass, then records the verify pass while the drafter runs; greedy decoding queues step N + 1
 * and reads step N's token with `read_ahead`): the next step stages into the other of two pinned
 * buffer pairs, and the steps' buffers are freed only at the next wait. A step's recorded writes
 * (step_writes.h) are forgotten when it is launched: it begins with a copy, behind which the
 * next step's kernels start. DFLASH_CUDA_SUBMIT=0 makes submit wait (experiments);
 * DFLASH_CUDA_IDS_DEV=0 leaves out submit, embed_dev, argmax_dev and read_ahead, so that
 * speculative decoding takes its ids through the host, each pass awaited, and
 * DFLASH_CUDA_READ_AHEAD=0 read_ahead alone (same-binary comparisons); DFLASH_CUDA_SW_AT_WAIT=1
 * forgets the writes at host waits only, as before steps began with a barrier. */

#define CMD_ARGS 640
#define DF_CUDA_MAX_PARAMS 65536
#define DF_CUDA_STAGE_BYTES ((size_t)32 << 20)
#define DF_CUDA_MAX_GRAPHS 256

typedef int (*cmd_fn)(cuda_backend *cb, const void *args);

typedef struct cmd {
    cmd_fn fn;
    const char *what;
    size_t size;
    unsigned char args[CMD_ARGS];
} cmd;

typedef struct gentry {
    uint64_t hash, used;
    size_t n_cmds, n_params, n_stage;
    int pb;                 /* the pinned buffer pair its copies read */
    cmd *sig;               /* copy of the commands */
    cudaGraphExec_t exec;   /* NULL until the step is seen a second time */
    int no_graph;           /* capture failed: run this step eagerly */
} gentry;

static void free_later(cuda_backend *cb, void *p) {
    if (!p) return;
    if (cb->n_dfree == cb->cap_dfree) {
        size_t cap = cb->cap_dfree ? cb->cap_dfree * 2 : 64;
        void **n = realloc(cb->dfree_later, cap * sizeof *n);
        if (!n) { /* cannot defer: wait for the device instead */
            cudaStreamSynchronize(cb->stream);
            dfree(cb, p);
            return;
        }
        cb->dfree_later = n;
        cb->cap_dfree = cap;
    }
    cb->dfree_later[cb->n_dfree++] = p;
}

/* Hash of n bytes (a multiple of 8) into h, a word at a time. */
static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
    }
    return h;
}

static void step_run(cuda_backend *cb);

static void record_(cuda_backend *cb, cmd_fn fn, const char *what, const void *args, size_t size);
/* record_, counted (and timed with DFLASH_CUDA_HOST_PROFILE) */
static void record(cuda_backend *cb, cmd_fn fn, const char *what, const void *args, size_t size) {
    cb->n_recorded++;
    if (!cb->host_profile) {
        record_(cb, fn, what, args, size);
        return;
    }
    const double t0 = now_ms();
    record_(cb, fn, what, args, size);
    cb->host_record_ms += now_ms() - t0;
}

/* Appends a command (args: a struct of at most CMD_ARGS bytes, zero-padded by the caller). */
static void record_(cuda_backend *cb, cmd_fn fn, const char *what, const void *args, size_t size) {
    if (cb->n_cmds == cb->cap_cmds) {
        size_t cap = cb->cap_cmds ? cb->cap_cmds * 2 : 2048;
        cmd *n = realloc(cb->cmds, cap * sizeof *n);
        if (!n) {
            fail(cb, "CUDA backend: out of host memory for commands");
            return;
        }
        cb->cmds = n;
        cb->cap_cmds = cap;
    }
    if (size > CMD_ARGS) { /* a programming error: the struct outgrew the command */
        fail(cb, "CUDA backend: %s: %zu bytes of arguments, at most %d", what, size, CMD_ARGS);
        return;
    }
    cmd *c = &cb->cmds[cb->n_cmds++];
    c->fn = fn;
    c->what = what;
    c->size = (size + 7) / 8 * 8;
    memcpy(c->args, args, size);
    memset(c->args + size, 0, c->size - size); /* bytes past c->size are never read */
    /* the step's key: a filter only (a hit is confirmed by cmds_equal), so the first bytes do */
    cb->sig_hash = fnv(cb->sig_hash, c, offsetof(cmd, args) + (c->size < 128 ? c->size : 128));
}

/* Room for n parameter ints in this step: their offset (the step runs first when full). */
static size_t params(cuda_backend *cb, size_t n) {
    if (cb->n_params + n > DF_CUDA_MAX_PARAMS) step_run(cb);
    size_t off = cb->n_params;
    cb->n_params += n;
    return off;
}

/* 1 when the n commands a and b are the same (launchers and the used bytes of their arguments). */
static int cmds_equal(const cmd *a, const cmd *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (a[i].fn != b[i].fn || a[i].what != b[i].what || a[i].size != b[i].size ||
            memcmp(a[i].args, b[i].args, a[i].size) != 0)
            return 0;
    return 1;
}

static void graph_free(gentry *g) {
    if (g->exec) cudaGraphExecDestroy(g->exec);
    free(g->sig);
    memset(g, 0, sizeof *g);
}

/* 1 when name is one of the comma-separated names of list. */
static int skip_listed(const char *list, const char *name) {
    const size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *e = strchr(p, ',');
        const size_t k = e ? (size_t)(e - p) : strlen(p);
        if (k == n && strncmp(p, name, n) == 0) return 1;
        if (!e) break;
        p = e + 1;
    }
    return 0;
}

static int run_cmds(cuda_backend *cb) {
    int st = 0;
    dfk_set_stream(cb->stream); /* the launchers' stream (one backend runs at a time) */
    if (cb->n_params)
        st = (int)cudaMemcpyAsync(cb->dparams, hparams(cb), cb->n_params * sizeof(int32_t), cudaMemcpyHostToDevice,
                                  cb->stream);
    if (cb->n_stage && st == 0)
        st = (int)cudaMemcpyAsync(cb->dstage, hstage(cb), cb->n_stage, cudaMemcpyHostToDevice, cb->stream);
    for (size_t i = 0; i < cb->n_cmds && st == 0; i++) {
        if (cb->profile_skip[0] && skip_listed(cb->profile_skip, cb->cmds[i].what)) continue;
        st = cb->cmds[i].fn(cb, cb->cmds[i].args);
        if (st) {
            if (st < 0) fail(cb, "%s: unsupported shape on the CUDA backend", cb->cmds[i].what);
            else fail(cb, "%s: CUDA error: %s", cb->cmds[i].what, cudaGetErrorString((cudaError_t)st));
        }
    }
    return st;
}

/* Launches the recorded step (replaying or capturing a graph when it repeats) without waiting
 * for it; the command list is empty afterwards, the pinned buffers still in use. */
static void step_launch(cuda_backend *cb) {
    if (cb->n_cmds || cb->n_params || cb->n_stage) {
        /* every step starts with the parameter block's copy: a full barrier behind the steps
         * launched before (a copy waits for all earlier work of the stream, and the kernels after
         * it for the copy), so a kernel may read before its PDL wait what those steps wrote */
        if (!cb->n_params) (void)params(cb, 1);
        const double t0 = now_ms();
        cb->n_steps++;
        gentry *hit = NULL, *victim = NULL;
        const uint64_t key = fnv(cb->sig_hash, &cb->n_params, sizeof cb->n_params) ^ (uint64_t)cb->n_stage;
        if (cb->use_graphs && cb->n_cmds > 0) {
            for (int i = 0; i < DF_CUDA_MAX_GRAPHS; i++) {
                gentry *g = &cb->graphs[i];
                if (g->sig && g->hash == key && g->n_cmds == cb->n_cmds && g->n_params == cb->n_params &&
                    g->n_stage == cb->n_stage && g->pb == cb->pb && cmds_equal(g->sig, cb->cmds, cb->n_cmds)) {
                    hit = g;
                    break;
                }
                if (!victim || !g->sig || (victim->sig && g->used < victim->used)) victim = g;
            }
        }
        int st = 0;
        if (hit && hit->exec) {
            st = (int)cudaGraphLaunch(hit->exec, cb->stream);
            cb->n_replays++;
            const double t1 = now_ms(); /* the host times of replayed steps (df_cuda_stats) */
            if (cb->t_step_end > 0 && !cb->in_flight) cb->host_between_ms += t0 - cb->t_step_end;
            cb->host_launch_ms += t1 - t0;
        } else if (hit && hit->no_graph) {
            run_cmds(cb);
        } else if (hit) { /* second occurrence: capture it */
            cudaGraph_t graph = NULL;
            const int failed_before = cb->base.failed;
            int cs = (int)cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeThreadLocal);
            if (cs == 0) {
                int rs = run_cmds(cb);
                int es = (int)cudaStreamEndCapture(cb->stream, &graph);
                cs = rs ? rs : es;
            }
            if (cs == 0) cs = (int)cudaGraphInstantiate(&hit->exec, graph, 0);
            if (graph) cudaGraphDestroy(graph);
            cb->n_captures++;
            if (cs == 0) {
                st = (int)cudaGraphLaunch(hit->exec, cb->stream);
            } else { /* run it eagerly instead, and never try to capture it again */
                cudaGetLastError();
                if (hit->exec) cudaGraphExecDestroy(hit->exec);
                hit->exec = NULL;
                hit->no_graph = 1;
                if (!failed_before) { /* a command error during capture is reported by the eager run */
                    cb->base.failed = 0;
                    cb->err[0] = 0;
                }
                run_cmds(cb);
            }
        } else {
            if (victim) { /* remember the step; captured if it comes again */
                graph_free(victim);
                victim->sig = malloc(cb->n_cmds * sizeof(cmd));
                if (victim->sig) {
                    memcpy(victim->sig, cb->cmds, cb->n_cmds * sizeof(cmd));
                    victim->hash = key;
                    victim->n_cmds = cb->n_cmds;
                    victim->n_params = cb->n_params;
                    victim->n_stage = cb->n_stage;
                    victim->pb = cb->pb;
                    hit = victim;
                }
            }
            run_cmds(cb);
        }
        if (hit) hit->used = ++cb->clock;
        if (st && !cb->base.failed) fail(cb, "step: %s", cudaGetErrorString((cudaError_t)st));
        cb->in_flight++;
    }
    cb->n_cmds = 0;
    cb->n_params = 0;
    cb->n_stage = 0;
    cb->sig_hash = 0xcbf29ce484222325ULL;
    if (!cb->sw_at_wait) df_step_writes_reset(&cb->sw); /* the next step starts behind this one */
}

/* Waits for every launched step; then frees the buffers they may have used and forgets their
 * writes (step_writes.h: the next step's kernels may read before their wait what is done). */
static void step_wait(cuda_backend *cb) {
    cudaError_t e = cudaStreamSynchronize(cb->stream);
    if (e != cudaSuccess && !cb->base.failed) fail(cb, "step: CUDA error: %s", cudaGetErrorString(e));
    df_step_writes_reset(&cb->sw);
    for (size_t i = 0; i < cb->n_dfree; i++) dfree(cb, cb->dfree_later[i]);
    cb->n_dfree = 0;
    cb->in_flight = 0;
    cb->pev_set[0] = cb->pev_set[1] = 0;
    cb->pb = 0;
    cb->t_step_end = now_ms();
}

/* Runs the recorded step and waits for it (and for any submitted before it). */
static void step_run(cuda_backend *cb) {
    step_launch(cb);
    step_wait(cb);
}

/* backend.h `submit`: launches the recorded step without waiting; the next step records into
 * the other pinned buffer pair, after the step that used that pair last has finished. */
static void cu_submit(df_backend *be) {
    cuda_backend *cb = cub(be);
    if (!cb->n_cmds && !cb->n_params && !cb->n_stage) return;
    if (cb->submit_waits) { /* DFLASH_CUDA_SUBMIT=0: experiments */
        step_run(cb);
        return;
    }
    step_launch(cb);
    if (cudaEventRecord(cb->pev[cb->pb], cb->stream) != cudaSuccess) { /* cannot mark it: wait instead */
        cudaGetLastError();
        step_wait(cb);
        return;
    }
    cb->pev_set[cb->pb] = 1;
    cb->pb ^= 1;
    if (cb->pev_set[cb->pb]) {
        cudaError_t e = cudaEventSynchronize(cb->pev[cb->pb]);
        if (e != cudaSuccess && !cb->base.failed) fail(cb, "submit: CUDA error: %s", cudaGetErrorString(e));
        cb->pev_set[cb->pb] = 0;
    }
}

/* backend.h `read_ahead`: submit returns once the step submitted before the one it launches
 * has finished (the pinned buffer pairs alternate), so every step but the last submitted one is
 * done; the copy runs on the legacy default stream, which does not wait for this backend's
 * non-blocking stream. */
static void cu_read_ahead(df_backend *be, void *dst, const void *src, size_t n) {
    cuda_backend *cb = cub(be);
    if (n) check(cb, (int)cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "read_ahead");
}

/* ---- memory ops -------------------------------------------------------------------------------- */

static void *cu_alloc(df_backend *be, size_t bytes) {
    cuda_backend *cb = cub(be);
    void *p = dmalloc(cb, bytes);
    if (p && (cudaMemsetAsync(p, 0, bytes ? bytes : 1, cb->stream) != cudaSuccess ||
              cudaStreamSynchronize(cb->stream) != cudaSuccess)) {
        cudaGetLastError();
        dfree(cb, p);
        return NULL;
    }
    return p;
}

/* df_backend_ops.host_const: registers (on = 1) or drops (on = 0) a constant host range; past
 * DF_CUDA_MAX_CONST ranges the weights of further ones are checked as any other. Dropping a
 * range frees the device copies of its weights (after the recorded ops have run): memory mapped
 * there later may hold other data at the same addresses. */
static void cu_host_const(df_backend *be, const void *p, size_t bytes, int on) {
    cuda_backend *cb = cub(be);
    for (int i = 0; i < cb->n_const; i++)
        if (cb->const_p[i] == p) { /* drop it (a new registration replaces it) */
            const unsigned char *b = cb->const_p[i];
            const size_t n = cb->const_n[i];
            step_run(cb);
            for (size_t k = 0; k < cb->w_cap; k++) {
                wentry *e = cb->w[k];
                if (e && (const unsigned char *)e->key >= b && (size_t)((const unsigned char *)e->key - b) < n)
                    wentry_release(cb, e);
            }
            cb->const_p[i] = cb->const_p[cb->n_const - 1];
            cb->const_n[i] = cb->const_n[cb->n_const - 1];
            cb->n_const--;
            break;
        }
    if (on && p && bytes && cb->n_const < DF_CUDA_MAX_CONST) {
        cb->const_p[cb->n_const] = p;
        cb->const_n[cb->n_const++] = bytes;
    }
}

static void cu_dealloc(df_backend *be, void *p) {
    cuda_backend *cb = cub(be);
    if (!p) return;
    step_run(cb);
    dfree(cb, p);
}

typedef struct a_copy {
    void *dst;
    const void *src;
    size_t n;
    size_t stage; /* h2d: offset in the staging buffer */
    int kind;     /* 0 d2d, 1 h2d, 2 memset */
} a_copy;

static int run_copy(cuda_backend *cb, const void *args) {
    const a_copy *a = args;
    if (a->kind == 2) return (int)cudaMemsetAsync(a->dst, 0, a->n, cb->stream);
    if (a->kind == 1) return (int)cudaMemcpyAsync(a->dst, cb->dstage + a->stage, a->n, cudaMemcpyDeviceToDevice, cb->stream);
    return (int)cudaMemcpyAsync(a->dst, a->src, a->n, cudaMemcpyDeviceToDevice, cb->stream);
}

static void cu_to_device(df_backend *be, void *dst, const void *src, size_t n) {
    cuda_backend *cb = cub(be);
    if (!n) return;
    if (cb->n_stage + n > DF_CUDA_STAGE_BYTES) step_run(cb);
    if (n > DF_CUDA_STAGE_BYTES) { /* too big to stage: a synchronous copy */
        check(cb, (int)cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "to_device");
        return;
    }
    if (!cb->dstage && !(cb->dstage = dmalloc(cb, DF_CUDA_STAGE_BYTES))) {
        fail(cb, "CUDA backend: out of device memory for the staging buffer");
        return;
    }
    a_copy a;
    memset(&a, 0, sizeof a);
    a.dst = dst;
    a.n = n;
    a.stage = cb->n_stage;
    a.kind = 1;
    memcpy(hstage(cb) + cb->n_stage, src, n);
    cb->n_stage += (n + 15) / 16 * 16;
    record(cb, run_copy, "to_device", &a, sizeof a);
}

static void cu_to_host(df_backend *be, void *dst, const void *src, size_t n) {
    cuda_backend *cb = cub(be);
    step_run(cb);
    if (n) check(cb, (int)cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "to_host");
}

/* backend.h `copy` (memmove semantics: a device-to-device copy may not overlap, so overlapping
 * ranges go through a scratch buffer). */
static void cu_copy(df_backend *be, void *dst, const void *src, size_t n) {
    cuda_backend *cb = cub(be);
    if (!n || dst == src) return;
    const char *d = dst, *s = src;
    if (d < s + n && s < d + n) {
        if (!scratch(cb, &cb->mbuf, &cb->mbuf_cap, n, 1)) return;
        cu_copy(be, cb->mbuf, src, n);
        cu_copy(be, dst, cb->mbuf, n);
        return;
    }
    a_copy a;
    memset(&a, 0, sizeof a);
    a.dst = dst;
    a.src = src;
    a.n = n;
    record(cb, run_copy, "copy", &a, sizeof a);
}

typedef struct a_copy_rows {
    void *dst;
    const void *src;
    size_t dpitch, spitch, width;
    int rows;
} a_copy_rows;

static int run_copy_rows(cuda_backend *cb, const void *args) {
    const a_copy_rows *a = args;
    return (int)cudaMemcpy2DAsync(a->dst, a->dpitch, a->src, a->spitch, a->width, (size_t)a->rows,
                                  cudaMemcpyDeviceToDevice, cb->stream);
}

/* backend.h `copy_rows`: one strided device-to-device copy. */
static void cu_copy_rows(df_backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                         size_t row_bytes, int rows) {
    cuda_backend *cb = cub(be);
    if (rows <= 0 || !row_bytes) return;
    a_copy_rows a;
    memset(&a, 0, sizeof a);
    a.dst = dst;
    a.src = src;
    a.dpitch = dst_pitch;
    a.spitch = src_pitch;
    a.width = row_bytes;
    a.rows = rows;
    record(cb, run_copy_rows, "copy_rows", &a, sizeof a);
}

static void cu_zero(df_backend *be, void *dst, size_t n) {
    if (!n) return;
    a_copy a;
    memset(&a, 0, sizeof a);
    a.dst = dst;
    a.n = n;
    a.kind = 2;
    record(cub(be), run_copy, "zero", &a, sizeof a);
}

/* ---- ops ------------------------------------------------------------------------------------------ */

static float hadamard_scale(int hb) { return hb > 0 ? (float)(1.0 / sqrt((double)hb)) : 1.0f; }

typedef struct a_embed {
    const void *codes, *scales, *biases, *dense, *signs;
    const int32_t *ids;
    float *out;
    float hscale;
    int sb_bf16, bits, gs, wdtype, rows, cols, hb, M;
} a_embed;

static int run_embed(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_embed *a = args;
    return dfk_embed(a->codes, a->scales, a->biases, a->sb_bf16, a->bits, a->gs, a->dense, a->wdtype, a->rows, a->cols,
                     a->signs, a->hb, a->hscale, a->ids, a->M, a->out);
}

/* embed and embed_dev: the ids from the host (through the parameter block) or from device
 * memory (d_ids). */
static void embed_rows(cuda_backend *cb, const df_linear *E, const int32_t *ids, const int32_t *d_ids, int M,
                       float *out) {
    if (E->cols > 12288) {
        fail(cb, "embed: width %d above 12288 is not supported on the CUDA backend", E->cols);
        return;
    }
    const wentry *e = dlin(cb, E, W_EMB);
    if (!e) return;
    for (int m0 = 0; m0 < M; m0 += DFK_MAX_ROWS) {
        const int mm = M - m0 < DFK_MAX_ROWS ? M - m0 : DFK_MAX_ROWS;
        size_t off = 0;
        if (!d_ids) {
            off = params(cb, DFK_MAX_ROWS);
            for (int m = 0; m < DFK_MAX_ROWS; m++) hparams(cb)[off + (size_t)m] = m < mm ? ids[m0 + m] : 0;
        }
        a_embed a;
        memset(&a, 0, sizeof a);
        a.codes = E->bits > 0 ? e->d_w : NULL;
        a.scales = e->d_s;
        a.biases = e->d_b;
        a.dense = E->bits > 0 ? NULL : e->d_w;
        a.signs = e->d_signs;
        a.ids = d_ids ? d_ids + m0 : cb->dparams + off;
        a.out = out + (size_t)m0 * (size_t)E->cols;
        a.hscale = hadamard_scale(E->hadamard_block);
        a.sb_bf16 = E->sdtype == DF_DTYPE_BF16;
        a.bits = E->bits;
        a.gs = E->group_size;
        a.wdtype = wdtype_code(E->wdtype);
        a.rows = E->rows;
        a.cols = E->cols;
        a.hb = E->hadamard_block;
        a.M = mm;
        record(cb, run_embed, "embed", &a, sizeof a);
    }
}

static void cu_embed(df_backend *be, const df_linear *E, const int32_t *ids, int M, float *out) {
    embed_rows(cub(be), E, ids, NULL, M, out);
}

/* backend.h `embed_dev`. */
static void cu_embed_dev(df_backend *be, const df_linear *E, const int32_t *ids, int M, float *out) {
    embed_rows(cub(be), E, NULL, ids, M, out);
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

typedef struct a_prep {
    const float *x, *signs;
    float *xf, *xs;
    uint32_t *xb;
    float hscale;
    int M, cols, hb, gs, seg;
} a_prep;

static int run_prep(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_prep *a = args;
    return dfk_prep(a->x, a->M, a->cols, a->signs, a->hb, a->hscale, a->gs, a->seg, a->xf, a->xs, a->xb);
}

typedef struct a_lin {
    const void *w, *s, *b;
    const uint32_t *xb;
    const float *xf, *xs;
    float *y;
    int mode, lgs, sb_bf16, rows, cols, M, KW, TR, wdtype, bits, gs;
} a_lin;

static int run_lin_mma(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_lin *a = args;
    return dfk_linear_mma(a->mode, a->lgs, a->w, a->s, a->sb_bf16, a->rows, a->cols, a->xb, a->xs, a->M, a->KW, a->TR,
                          a->y);
}

/* dfk_linear_mma_multi's arguments: n tensor-core linears of one prepared input */
typedef struct a_mma {
    const uint32_t *xb;
    const float *xs;
    int mode, gs, sb_bf16, cols, M, TR, n;
    dfk_mlin l[DFK_QMAX];
} a_mma;

static int run_lin_mma_multi(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_mma *a = args;
    return dfk_linear_mma_multi(a->mode, a->gs, a->sb_bf16, a->cols, a->xb, a->xs, a->M, a->TR, a->n, a->l);
}

static int run_lin_simple(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_lin *a = args;
    return dfk_linear_simple(a->w, a->wdtype, a->s, a->b, a->sb_bf16, a->bits, a->gs, a->rows, a->cols, a->xf, a->M,
                             a->y);
}

static void lin_group(cuda_backend *cb, const float *x, const float *up, const float *norm_w, float eps, int mm,
                      int cols, int n, const df_linear *const *Ws, float *const *ys, int add, float *h_out);

/* 1 when the commands recorded last are a run_prep with exactly the arguments p, then only
 * tensor-core linears that read its outputs and write nothing it reads (x, bytes): its outputs
 * still hold what p would write (several linears of one input, e.g. q/k/v, share one
 * preparation). */
static int prep_recorded(const cuda_backend *cb, const a_prep *p, size_t x_bytes) {
    const char *x0 = (const char *)p->x, *x1 = x0 + x_bytes;
    for (size_t k = cb->n_cmds; k-- > 0;) {
        const cmd *c = &cb->cmds[k];
        if (c->fn == run_lin_mma) {
            const a_lin *l = (const void *)c->args;
            const char *y0 = (const char *)l->y, *y1 = y0 + (size_t)l->M * (size_t)l->rows * sizeof(float);
            if (y0 < x1 && x0 < y1) return 0;
            continue;
        }
        if (c->fn == run_lin_mma_multi) {
            const a_mma *g = (const void *)c->args;
            for (int i = 0; i < g->n; i++) {
                const char *y0 = (const char *)g->l[i].y, *y1 = y0 + (size_t)g->M * (size_t)g->l[i].rows * sizeof(float);
                if (y0 < x1 && x0 < y1) return 0;
            }
            continue;
        }
        return c->fn == run_prep && memcmp(c->args, p, sizeof *p) == 0;
    }
    return 0;
}

/* The input and rotation fields of a preparation of x [mm, cols] for entry e (hb: its
 * Hadamard block; outputs left NULL). */
static void prep_fill(a_prep *p, const float *xin, int mm, int cols, const wentry *e, int hb) {
    memset(p, 0, sizeof *p);
    p->x = xin;
    p->signs = hb > 0 ? e->d_signs : NULL;
    p->hscale = hadamard_scale(hb);
    p->M = mm;
    p->cols = cols;
    p->hb = hb;
}

/* Words of the tensor-core linear's B fragments of mm rows of cols columns (dfk_prep's xb:
 * uint2 [ceil(mm/2), cols/16, 32]). */
static size_t mma_xb_words(int mm, int cols) { return (size_t)(mm + 1) / 2 * (size_t)(cols / 16) * 32 * 2; }

/* Records the preparation of x [mm, cols] for the tensor-core linears of W's format and
 * rotation (e: W's entry) into cb->xf, cb->xb (and cb->xs when quantized), unless the commands
 * recorded last already made exactly it. Returns 0 when out of memory (cb failed). */
static int mma_prep(cuda_backend *cb, const float *xin, int mm, int cols, const wentry *e, const df_linear *W) {
    const int hb = W->hadamard_block, quant = e->mode != DFK_MMA_BF16;
    const int gs = quant ? e->lgs : 0;
    if (!scratch(cb, (void **)&cb->xf, &cb->xf_cap, (size_t)mm * (size_t)cols, sizeof(float)) ||
        !scratch(cb, (void **)&cb->xb, &cb->xb_cap, mma_xb_words(mm, cols), sizeof(uint32_t)) ||
        (quant && !scratch(cb, (void **)&cb->xs, &cb->xs_cap, (size_t)mm * (size_t)(cols / gs), sizeof(float))))
        return 0;
    a_prep p;
    prep_fill(&p, xin, mm, cols, e, hb);
    p.xf = cb->xf;
    p.xs = quant ? cb->xs : NULL;
    p.xb = cb->xb;
    p.gs = gs;
    p.seg = prep_seg(cols, hb, quant ? gs : 64);
    if (!prep_recorded(cb, &p, (size_t)mm * (size_t)cols * sizeof(float)))
        record(cb, run_prep, "linear prep", &p, sizeof p);
    return 1;
}

/* Tiles per warp of a tensor-core linear of `rows` rows and mm data rows (work distribution
 * only: about target_ctas CTAs, within what the kernel takes). */
static int mma_tr(const cuda_backend *cb, const wentry *e, int rows, int mm) {
    const int tiles = (rows + 15) / 16, RW = 8 / e->KW;
    int tr = pow2floor(tiles / (RW * cb->target_ctas) > 0 ? tiles / (RW * cb->target_ctas) : 1);
    const int trmax = dfk_linear_mma_max_tr(e->mode, e->lgs, mm);
    return tr > trmax ? trmax : tr;
}

static void cu_linear(df_backend *be, const df_linear *W, const float *x, int M, float *y) {
    cuda_backend *cb = cub(be);
    const wentry *e = dlin(cb, W, W_LIN);
    if (!e) return;
    if (e->mode == LIN_Q || e->mode == LIN_DENSE) {
        for (int m0 = 0; m0 < M; m0 += DFK_MAX_ROWS) {
            const int mm = M - m0 < DFK_MAX_ROWS ? M - m0 : DFK_MAX_ROWS;
            float *yo = y + (size_t)m0 * (size_t)W->rows;
            lin_group(cb, x + (size_t)m0 * (size_t)W->cols, NULL, NULL, 0.0f, mm, W->cols, 1, &W, &yo, 0, NULL);
        }
        return;
    }
    const int rows = W->rows, cols = W->cols, hb = W->hadamard_block;
    if (hb > 8192 || (hb > 0 && cols % hb != 0)) {
        fail(cb, "linear %s: Hadamard block %d not supported on the CUDA backend", W->name ? W->name : "", hb);
        return;
    }
    for (int m0 = 0; m0 < M; m0 += DFK_MAX_ROWS) {
        const int mm = M - m0 < DFK_MAX_ROWS ? M - m0 : DFK_MAX_ROWS;
        const float *xin = x + (size_t)m0 * (size_t)cols;
        float *yout = y + (size_t)m0 * (size_t)rows;
        a_lin l;
        memset(&l, 0, sizeof l);
        l.w = e->d_w;
        l.s = e->d_s;
        l.b = e->d_b;
        l.y = yout;
        l.mode = e->mode;
        l.lgs = e->lgs;
        l.sb_bf16 = W->sdtype == DF_DTYPE_BF16;
        l.rows = rows;
        l.cols = cols;
        l.M = mm;
        l.KW = e->KW;
        l.wdtype = wdtype_code(W->wdtype);
        l.bits = W->bits;
        l.gs = W->group_size;
        if (e->mode == LIN_SIMPLE) {
            l.xf = xin;
            if (hb > 0) {
                a_prep p;
                prep_fill(&p, xin, mm, cols, e, hb);
                if (!scratch(cb, (void **)&cb->xf, &cb->xf_cap, (size_t)mm * (size_t)cols, sizeof(float))) return;
                p.xf = cb->xf;
                p.seg = prep_seg(cols, hb, 0);
                record(cb, run_prep, "linear prep", &p, sizeof p);
                l.xf = cb->xf;
            }
            record(cb, run_lin_simple, "linear", &l, sizeof l);
            continue;
        }
        if (!mma_prep(cb, xin, mm, cols, e, W)) return;
        l.TR = mma_tr(cb, e, rows, mm);
        l.xb = cb->xb;
        l.xs = e->mode != DFK_MMA_BF16 ? cb->xs : NULL;
        record(cb, run_lin_mma, "linear", &l, sizeof l);
    }
}

/* ---- fused linears: one input preparation for several linears ------------------------------
 *
 * lin_group runs n <= DFK_QMAX linears on one input v = norm(act(x)) (act: SwiGLU with `up`, or
 * none; norm: RMSNorm with norm_w, or none) of mm <= 16 rows: one dfk_qprep for all of them
 * (it writes v itself to h when a linear needs the float input), then the fixed-point linears
 * of one format in one launch, the dense ones in another, any other format through the
 * unfused path. add = 1: y += W·v (the residual add in the linear's epilogue). */

typedef struct a_qprep {
    const float *x, *up, *norm_w;
    float *h;
    uint32_t *xb; /* the bf16 B fragments of v too (dfk_qprep_takes_xb), or NULL */
    float eps;
    int M, cols, seg, n;
    dfk_qout outs[DFK_QMAX];
} a_qprep;

static int run_qprep(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_qprep *a = args;
    return dfk_qprep(a->x, a->up, a->norm_w, a->eps, a->M, a->cols, a->seg, a->h, a->xb, a->n, a->outs);
}

typedef struct a_qlin {
    int bits, gs, sbf, M, n, nd;
    dfk_qsched sched;
    dfk_qlin l[DFK_QMAX];
    dfk_dlin dl[DFK_QMAX]; /* dense linears riding along (nd) */
} a_qlin;

_Static_assert(sizeof(a_qlin) <= CMD_ARGS, "a_qlin must fit in a command");

static int run_qlin(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_qlin *a = args;
    return dfk_linear_q(a->bits, a->gs, a->sbf, a->M, a->sched, a->n, a->l, a->nd, a->dl);
}

typedef struct a_dlin {
    int M, n;
    dfk_dlin l[DFK_QMAX];
} a_dlin;

static int run_dlin(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_dlin *a = args;
    return dfk_linear_dense(a->M, a->n, a->l);
}

static void cu_linear(df_backend *be, const df_linear *W, const float *x, int M, float *y);
static void cu_rmsnorm(df_backend *be, const float *x, const float *w, int rows, int width, float eps, float *y);
static void cu_add(df_backend *be, float *y, const float *x, size_t n);
static void cu_swiglu(df_backend *be, const float *gate, const float *up, size_t n, float *out);

/* Columns per prep block: a multiple of every hb and gs dividing cols, up to 1024 (more blocks
 * per row: the prep of one row is a latency chain). */
static int qprep_seg(int cols, int base) {
    if (cols % base != 0) return cols; /* no fixed-point output and an odd width: one block per row */
    int seg = base;
    while (seg < 1024 && cols % (2 * seg) == 0) seg *= 2;
    return seg;
}

static void lin_group(cuda_backend *cb, const float *x, const float *up, const float *norm_w, float eps, int mm,
                      int cols, int n, const df_linear *const *Ws, float *const *ys, int add, float *h_out) {
    const wentry *es[DFK_QMAX];
    int nq = 0, nother = 0, base = 16;
    for (int i = 0; i < n; i++) {
        if (Ws[i]->cols != cols) {
            fail(cb, "linears: %s has %d columns, the input %d", Ws[i]->name ? Ws[i]->name : "", Ws[i]->cols, cols);
            return;
        }
        if (!(es[i] = dlin(cb, Ws[i], W_LIN))) return;
        const int hb = Ws[i]->hadamard_block;
        if (hb > 8192 || (hb > 0 && cols % hb != 0)) {
            fail(cb, "linear %s: Hadamard block %d not supported on the CUDA backend", Ws[i]->name ? Ws[i]->name : "",
                 hb);
            return;
        }
        if (es[i]->mode == LIN_Q) {
            nq++;
            if (hb > base) base = hb;
            if (es[i]->lgs > base) base = es[i]->lgs;
        } else {
            nother++;
        }
    }
    const float *dnorm = NULL;
    if (norm_w && !(dnorm = dvec(cb, norm_w, (size_t)cols))) return;
    /* the float input v, when some linear needs it and it is not x itself */
    const float *v = x;
    if (nother && (dnorm || up)) {
        if (h_out) v = h_out;
        else {
            if (!scratch(cb, (void **)&cb->hbuf, &cb->hbuf_cap, (size_t)mm * (size_t)cols, sizeof(float))) return;
            v = cb->hbuf;
        }
    }
    const int fused_norm = dnorm && qprep_seg(cols, base) <= DFK_QPREP_MAX_SEG;
    if (dnorm && !fused_norm) { /* a Hadamard block too wide for one prep block: the norm first */
        float *hh = h_out;
        if (!hh) {
            if (!scratch(cb, (void **)&cb->hbuf, &cb->hbuf_cap, (size_t)mm * (size_t)cols, sizeof(float))) return;
            hh = cb->hbuf;
        }
        if (up) { /* SwiGLU then RMSNorm: not a pattern of the models; composed */
            cu_swiglu(&cb->base, x, up, (size_t)mm * (size_t)cols, hh);
            cu_rmsnorm(&cb->base, hh, norm_w, mm, cols, eps, hh);
        } else {
            cu_rmsnorm(&cb->base, x, norm_w, mm, cols, eps, hh);
        }
        x = hh;
        up = NULL;
        dnorm = NULL;
        v = hh;
    }
    /* the tensor-core linears without rotation of one format (a drafter's bf16 q/k/v, gate/up,
     * o, down): one launch (dfk_linear_mma_multi: the bits of one launch each), its B fragments
     * written by the preparation below when there is one and it can (bf16), else by their own */
    a_mma g;
    memset(&g, 0, sizeof g);
    int done[DFK_QMAX] = {0}, first = -1;
    for (int i = 0; i < n && cb->mma_group; i++) {
        const int mode = es[i]->mode;
        if (mode == LIN_SIMPLE || mode == LIN_Q || mode == LIN_DENSE || Ws[i]->hadamard_block > 0) continue;
        if (first < 0) first = i;
        else if (mode != es[first]->mode || es[i]->lgs != es[first]->lgs ||
                 (Ws[i]->sdtype == DF_DTYPE_BF16) != (Ws[first]->sdtype == DF_DTYPE_BF16))
            continue;
        dfk_mlin *l = &g.l[g.n++];
        l->codes = es[i]->d_w;
        l->sb = es[i]->d_s;
        l->rows = Ws[i]->rows;
        l->KW = es[i]->KW;
        l->y = ys[i];
        done[i] = 1;
        const int tr = mma_tr(cb, es[i], Ws[i]->rows, mm);
        if (g.n == 1 || tr < g.TR) g.TR = tr;
    }
    const int qprep_on = nq || v != x;
    const int frags_in_qprep = g.n > 0 && qprep_on && es[first]->mode == DFK_MMA_BF16 &&
                               dfk_qprep_takes_xb(cols, qprep_seg(cols, base));
    if (g.n == 1 && !frags_in_qprep && !add) { /* alone and nothing saved: the unfused path below */
        g.n = 0;
        memset(done, 0, sizeof done);
    }
    if (frags_in_qprep && !scratch(cb, (void **)&cb->xb, &cb->xb_cap, mma_xb_words(mm, cols), sizeof(uint32_t)))
        return;
    a_qprep p;
    memset(&p, 0, sizeof p);
    if (qprep_on) {
        p.xb = frags_in_qprep ? cb->xb : NULL;
        p.x = x;
        p.up = up;
        p.norm_w = dnorm;
        p.h = v != x ? (float *)v : (h_out && (dnorm || up) ? h_out : NULL);
        p.eps = eps;
        p.M = mm;
        p.cols = cols;
        p.seg = qprep_seg(cols, base);
        int k = 0;
        for (int i = 0; i < n; i++) {
            if (es[i]->mode != LIN_Q) continue;
            const int ng = cols / es[i]->lgs;
            if (!scratch(cb, (void **)&cb->qx[k], &cb->qx_cap[k], (size_t)mm * (size_t)cols / 2, sizeof(uint32_t)) ||
                !scratch(cb, (void **)&cb->qe[k], &cb->qe_cap[k], (size_t)mm * (size_t)ng, sizeof(float)) ||
                !scratch(cb, (void **)&cb->qs[k], &cb->qs_cap[k], (size_t)mm * (size_t)ng, sizeof(float)))
                return;
            dfk_qout *o = &p.outs[k++];
            o->signs = Ws[i]->hadamard_block > 0 ? es[i]->d_signs : NULL;
            o->hb = Ws[i]->hadamard_block;
            o->hscale = hadamard_scale(o->hb);
            o->gs = es[i]->lgs;
            o->xe_shift = dfk_q_xe_shift(Ws[i]->bits);
        }
        for (int i = 0; i < k; i++) {
            p.outs[i].xq = cb->qx[i];
            p.outs[i].xe = cb->qe[i];
            p.outs[i].xsx = cb->qs[i];
        }
        p.n = k ? k : 1; /* k == 0: only v is written (output 0 without xq) */
        record(cb, run_qprep, "linear prep", &p, sizeof p);
    }
    /* dense 16-bit linears in one launch, before the fixed-point ones: their short kernel then
     * runs while the fixed-point launch's first weights stream in (programmatic dependent
     * launch), instead of after it (decode: 0.27 ms per token in kernels of a few µs) */
    a_dlin d;
    memset(&d, 0, sizeof d);
    d.M = mm;
    for (int i = 0; i < n; i++) {
        if (es[i]->mode != LIN_DENSE || add) continue;
        dfk_dlin *l = &d.l[d.n++];
        l->w = es[i]->d_w;
        l->wdtype = wdtype_code(Ws[i]->wdtype);
        l->rows = Ws[i]->rows;
        l->cols = cols;
        l->x = v;
        l->y = ys[i];
    }
    /* the dense linears ride along with the first fixed-point launch (DFLASH_CUDA_DENSE_RIDE) */
    int ride = 0;
    if (d.n && cb->dense_ride)
        for (int i = 0; i < n; i++) ride |= es[i]->mode == LIN_Q;
    if (d.n && !ride && cb->dense_first) record(cb, run_dlin, "linear (dense)", &d, sizeof d);
    /* the fixed-point linears, one launch per format, in order */
    int k = 0;
    for (int i = 0; i < n;) {
        if (es[i]->mode != LIN_Q) {
            i++;
            continue;
        }
        a_qlin q;
        memset(&q, 0, sizeof q);
        q.bits = Ws[i]->bits;
        q.gs = es[i]->lgs;
        q.sbf = es[i]->sbf;
        q.M = mm;
        q.sched.TR = dfk_linear_q_max_tr(mm);
        q.sched.ring = cb->q_ring;
        q.sched.ring_max_m = cb->q_ring_max_m;
        q.sched.bulk = cb->q_bulk;
        q.sched.split_bytes = cb->q_split_bytes;
        q.sched.split_rows = cb->q_split_rows;
        q.sched.ctas = cb->q_ctas;
        for (int j = i; j < n && q.n < DFK_QMAX; j++) {
            if (es[j]->mode != LIN_Q) continue;
            if (Ws[j]->bits != q.bits || es[j]->lgs != q.gs || es[j]->sbf != q.sbf) break;
            dfk_qlin *l = &q.l[q.n++];
            l->codes = es[j]->d_w;
            l->sb = es[j]->d_s;
            l->rows = Ws[j]->rows;
            l->cols = cols;
            l->KW = es[j]->KW;
            l->add = add;
            l->xq = cb->qx[k];
            l->xe = cb->qe[k];
            l->xsx = cb->qs[k];
            l->y = ys[j];
            k++;
            const int tiles = (Ws[j]->rows + 15) / 16, RW = 8 / es[j]->KW;
            const int tr = pow2floor(tiles / (RW * cb->target_ctas) > 0 ? tiles / (RW * cb->target_ctas) : 1);
            if (tr < q.sched.TR) q.sched.TR = tr;
            i = j + 1;
        }
        if (ride) {
            q.nd = d.n;
            memcpy(q.dl, d.l, sizeof d.l);
            ride = 0;
            d.n = 0;
        }
        record(cb, run_qlin, "linear", &q, sizeof q);
    }
    if (g.n > 0) {
        if (!frags_in_qprep && !mma_prep(cb, v, mm, cols, es[first], Ws[first])) return;
        g.mode = es[first]->mode;
        g.gs = es[first]->lgs;
        g.sb_bf16 = Ws[first]->sdtype == DF_DTYPE_BF16;
        g.cols = cols;
        g.M = mm;
        g.xb = cb->xb;
        g.xs = g.mode != DFK_MMA_BF16 ? cb->xs : NULL;
        g.l[0].add = add; /* y += W·v (one linear): the add in the epilogue */
        record(cb, run_lin_mma_multi, "linear", &g, sizeof g);
    }
    /* any other format unfused */
    for (int i = 0; i < n; i++) {
        if ((es[i]->mode == LIN_DENSE && !add) || es[i]->mode == LIN_Q || done[i]) continue;
        if (add) {
            if (!scratch(cb, (void **)&cb->lbuf, &cb->lbuf_cap, (size_t)mm * (size_t)Ws[i]->rows, sizeof(float)))
                return;
            cu_linear(&cb->base, Ws[i], v, mm, cb->lbuf);
            cu_add(&cb->base, ys[i], cb->lbuf, (size_t)mm * (size_t)Ws[i]->rows);
        } else {
            cu_linear(&cb->base, Ws[i], v, mm, ys[i]);
        }
    }
    if (d.n && !cb->dense_first) record(cb, run_dlin, "linear (dense)", &d, sizeof d);
}

/* backend.h `linears`: RMSNorm (optional) + several linears of the same input. */
static void cu_linears(df_backend *be, const float *x, const float *norm_w, float eps, int M, int width, int n,
                       const df_linear *const *Ws, float *const *ys, float *h_out) {
    cuda_backend *cb = cub(be);
    if (n < 1 || n > DFK_QMAX) {
        fail(cb, "linears: %d linears in one call (1..%d)", n, DFK_QMAX);
        return;
    }
    for (int m0 = 0; m0 < M; m0 += DFK_MAX_ROWS) {
        const int mm = M - m0 < DFK_MAX_ROWS ? M - m0 : DFK_MAX_ROWS;
        float *yo[DFK_QMAX];
        for (int i = 0; i < n; i++) yo[i] = ys[i] + (size_t)m0 * (size_t)Ws[i]->rows;
        lin_group(cb, x + (size_t)m0 * (size_t)width, NULL, norm_w, eps, mm, width, n, Ws, yo, 0,
                  h_out ? h_out + (size_t)m0 * (size_t)width : NULL);
    }
}

/* backend.h `linear_add`: y += W · act(x). */
static void cu_linear_add(df_backend *be, const df_linear *W, const float *x, const float *up, int M, float *y) {
    cuda_backend *cb = cub(be);
    for (int m0 = 0; m0 < M; m0 += DFK_MAX_ROWS) {
        const int mm = M - m0 < DFK_MAX_ROWS ? M - m0 : DFK_MAX_ROWS;
        float *yo = y + (size_t)m0 * (size_t)W->rows;
        const size_t xo = (size_t)m0 * (size_t)W->cols;
        lin_group(cb, x + xo, up ? up + xo : NULL, NULL, 0.0f, mm, W->cols, 1, &W, &yo, 1, NULL);
    }
}

typedef struct a_ew {
    const float *x, *w, *u;
    float *y;
    size_t n;
    float eps;
    int rows, width, kind; /* 0 rmsnorm, 1 add, 2 swiglu */
} a_ew;

static int run_ew(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_ew *a = args;
    if (a->kind == 0) return dfk_rmsnorm(a->x, a->w, a->rows, a->width, a->eps, a->y);
    if (a->kind == 1) return dfk_add(a->y, a->x, a->n);
    return dfk_swiglu(a->x, a->u, a->n, a->y);
}

static void cu_rmsnorm(df_backend *be, const float *x, const float *w, int rows, int width, float eps, float *y) {
    cuda_backend *cb = cub(be);
    const float *dw = NULL;
    if (w && !(dw = dvec(cb, w, (size_t)width))) return;
    a_ew a;
    memset(&a, 0, sizeof a);
    a.x = x;
    a.w = dw;
    a.y = y;
    a.rows = rows;
    a.width = width;
    a.eps = eps;
    record(cb, run_ew, "rmsnorm", &a, sizeof a);
}

static void cu_add(df_backend *be, float *y, const float *x, size_t n) {
    if (!n) return;
    a_ew a;
    memset(&a, 0, sizeof a);
    a.x = x;
    a.y = y;
    a.n = n;
    a.kind = 1;
    record(cub(be), run_ew, "add", &a, sizeof a);
}

static void cu_swiglu(df_backend *be, const float *gate, const float *up, size_t n, float *out) {
    if (!n) return;
    a_ew a;
    memset(&a, 0, sizeof a);
    a.x = gate;
    a.u = up;
    a.y = out;
    a.n = n;
    a.kind = 2;
    record(cub(be), run_ew, "swiglu", &a, sizeof a);
}

/* attends: the op reads the cache (attention; not kv_append): dfk_attention must take the shape. */
static int attn_shape_ok(cuda_backend *cb, const df_attn_shape *sh, int M, int attends) {
    const int hd = sh->head_dim;
    if (M < 1 || M > DFK_MAX_ROWS || hd > 1024 || sh->rot_dims > hd || sh->n_kv_heads <= 0 ||
        sh->n_heads % sh->n_kv_heads != 0 ||
        (attends && !dfk_attention_shape_ok(sh->n_heads, sh->n_kv_heads, hd))) {
        fail(cb,
             "attention: unsupported shape (M %d, head_dim %d, heads %d/%d) on the CUDA backend (it attends with "
             "head_dim 64, 128 or 256 and at most 16 query heads per KV head)",
             M, hd, sh->n_heads, sh->n_kv_heads);
        return 0;
    }
    return 1;
}

typedef struct a_attn {
    float *q, *k, *k_cache, *v_cache, *part, *out;
    const float *v, *qn, *kn;
    const int32_t *pos; /* device: [DFK_MAX_ROWS] positions, then pos0, then the rows written earlier in the step */
    float theta, eps;
    int qstride, nh, nkv, hd, rot, M, gated, causal, nchunk;
} a_attn;

static int run_qk_prep(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_attn *a = args;
    return dfk_qk_prep(a->q, a->qstride, a->nh, a->k, a->v, a->nkv, a->hd, a->qn, a->kn, a->rot, a->theta, a->eps,
                       a->pos, a->M, a->k_cache, a->v_cache);
}

static int run_attention(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_attn *a = args;
    return dfk_attention(a->q, a->qstride, a->gated, a->nh, a->nkv, a->hd, a->k_cache, a->v_cache, a->causal,
                         a->pos + DFK_MAX_ROWS, a->M, a->nchunk, a->part, a->out);
}

/* Records the k/v (and q) preparation of an attention op; fills the common arguments. */
static int attn_prep(cuda_backend *cb, const df_attn_shape *sh, float *q, float *k, const float *v,
                     const float *q_norm, const float *k_norm, const int32_t *positions, int M, float *k_cache,
                     float *v_cache, int pos0, a_attn *a) {
    if (!attn_shape_ok(cb, sh, M, q != NULL)) return 0;
    const int hd = sh->head_dim;
    memset(a, 0, sizeof *a);
    if (q_norm && !(a->qn = dvec(cb, q_norm, (size_t)hd))) return 0;
    if (k_norm && !(a->kn = dvec(cb, k_norm, (size_t)hd))) return 0;
    const size_t off = params(cb, DFK_MAX_ROWS + 2);
    for (int m = 0; m < DFK_MAX_ROWS; m++) hparams(cb)[off + (size_t)m] = m < M ? positions[m] : 0;
    hparams(cb)[off + DFK_MAX_ROWS] = pos0;
    /* the cache rows the kernels read before the PDL wait: those no kernel of this step writes
     * (this op's own preparation writes rows pos0 .. pos0 + M - 1) */
    df_step_writes_note(&cb->sw, k_cache, pos0);
    df_step_writes_note(&cb->sw, v_cache, pos0);
    const int wk = df_step_writes_first(&cb->sw, k_cache), wv = df_step_writes_first(&cb->sw, v_cache);
    hparams(cb)[off + DFK_MAX_ROWS + 1] = wk < wv ? wk : wv;
    a->q = q;
    a->k = k;
    a->v = v;
    a->k_cache = k_cache;
    a->v_cache = v_cache;
    a->pos = cb->dparams + off;
    a->theta = sh->rope_theta;
    a->eps = sh->eps;
    a->qstride = (sh->gated ? 2 : 1) * hd;
    a->nh = sh->n_heads;
    a->nkv = sh->n_kv_heads;
    a->hd = hd;
    a->rot = sh->rot_dims;
    a->M = M;
    a->gated = sh->gated;
    a->causal = sh->causal;
    record(cb, run_qk_prep, "attention prep", a, sizeof *a);
    return 1;
}

static void cu_kv_append(df_backend *be, const df_attn_shape *sh, float *k, const float *v, const float *k_norm,
                         const int32_t *positions, int M, float *k_cache, float *v_cache, int pos0) {
    a_attn a;
    attn_prep(cub(be), sh, NULL, k, v, NULL, k_norm, positions, M, k_cache, v_cache, pos0, &a);
}

static void cu_attention(df_backend *be, const df_attn_shape *sh, float *q, float *k, const float *v,
                         const float *q_norm, const float *k_norm, const int32_t *positions, int M, float *k_cache,
                         float *v_cache, int pos0, float *out) {
    cuda_backend *cb = cub(be);
    a_attn a;
    if (!attn_prep(cb, sh, q, k, v, q_norm, k_norm, positions, M, k_cache, v_cache, pos0, &a)) return;
    /* chunk bound rounded up so that steps at nearby positions share a graph: to a power of two
     * (>= 8) up to 128 chunks, beyond to k·2^j with 8 <= k < 16 (at most 1/8 above the need:
     * the parts' scratch of long contexts stays close to its need) */
    const int ch = dfk_attn_chunk(), need = (pos0 + M + ch - 1) / ch;
    int unit = 1;
    while (need > 16 * unit) unit *= 2;
    int nchunk = 8;
    while (nchunk < need) nchunk *= 2;
    if (need > 128) nchunk = (need + unit - 1) / unit * unit;
    if (!scratch(cb, (void **)&cb->part, &cb->part_cap,
                 (size_t)M * (size_t)sh->n_heads * (size_t)nchunk * (size_t)(sh->head_dim + 2), sizeof(float)))
        return;
    a.nchunk = nchunk;
    a.part = cb->part;
    a.out = out;
    record(cb, run_attention, "attention", &a, sizeof a);
}

/* A GDN launch's dimensions (conv channels C = 2·nk·dk + nv·dv). */
typedef struct gdn_dims {
    float eps;
    int nk, nv, dk, dv, C, K, M;
} gdn_dims;

static gdn_dims gdn_dims_of(const df_gdn_shape *sh, int M) {
    gdn_dims d;
    d.nk = sh->n_k_heads;
    d.nv = sh->n_v_heads;
    d.dk = sh->k_head_dim;
    d.dv = sh->v_head_dim;
    d.C = 2 * d.nk * d.dk + d.nv * d.dv;
    d.K = sh->conv_kernel;
    d.M = M;
    d.eps = sh->eps;
    return d;
}

typedef struct a_gdn {
    const float *qkv, *z, *a, *b, *cw, *al, *dt, *nw, *conv_in, *S_in;
    float *conv_state, *S, *out, *conv_out;
    gdn_dims d;
    int pre; /* the states are read before waiting for the previous kernel (dfk_gdn_fused) */
} a_gdn;

static int g_gdn_fused = 1; /* DFLASH_CUDA_GDN_FUSED=0: conv and recurrence as two kernels */

static int run_gdn(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_gdn *g = args;
    const gdn_dims *d = &g->d;
    if (g_gdn_fused && 2 * d->dk + d->dv <= 4 * d->dv && d->nk <= DFK_GDN_MAX_KH && d->M >= 1)
        return dfk_gdn_fused(g->qkv, g->cw, d->K, g->conv_in, g->conv_state, g->z, g->a, g->b, g->al, g->dt, g->nw,
                             d->nk, d->nv, d->dk, d->dv, d->eps, d->M, g->S_in, g->S, g->out, g->pre);
    int st = dfk_gdn_conv(g->qkv, g->cw, d->C, d->K, d->M, g->conv_in, g->conv_state, g->conv_out);
    if (st) return st;
    return dfk_gdn_recurrence(g->conv_out, g->z, g->a, g->b, g->al, g->dt, g->nw, d->nk, d->nv, d->dk, d->dv, d->eps,
                              d->M, g->S_in, g->S, g->out);
}

/* backend.h `gdn_to` (conv_in == conv_state and S_in == S: `gdn`, in place). */
static void cu_gdn_to(df_backend *be, const df_gdn_shape *sh, const float *qkv, const float *z, const float *a,
                      const float *b, const float *conv_w, const float *A_log, const float *dt_bias,
                      const float *norm_w, int M, const float *conv_in, const float *S_in, float *conv_state, float *S,
                      float *out) {
    cuda_backend *cb = cub(be);
    a_gdn g;
    memset(&g, 0, sizeof g);
    g.d = gdn_dims_of(sh, M);
    g.cw = dvec(cb, conv_w, (size_t)g.d.C * (size_t)g.d.K);
    g.al = dvec(cb, A_log, (size_t)g.d.nv);
    g.dt = dvec(cb, dt_bias, (size_t)g.d.nv);
    g.nw = dvec(cb, norm_w, (size_t)g.d.dv);
    if (!g.cw || !g.al || !g.dt || !g.nw) {
        if (!be->failed) fail(cb, "gdn: missing weights");
        return;
    }
    if (!scratch(cb, (void **)&cb->conv_out, &cb->conv_cap, (size_t)M * (size_t)g.d.C, sizeof(float))) return;
    g.conv_out = cb->conv_out;
    g.qkv = qkv;
    g.z = z;
    g.a = a;
    g.b = b;
    g.conv_in = conv_in;
    g.S_in = S_in;
    g.conv_state = conv_state;
    g.S = S;
    g.out = out;
    g.pre = df_step_writes_first(&cb->sw, S_in) == INT_MAX && df_step_writes_first(&cb->sw, conv_in) == INT_MAX;
    df_step_writes_note(&cb->sw, S, 0);
    df_step_writes_note(&cb->sw, conv_state, 0);
    record(cb, run_gdn, "gdn", &g, sizeof g);
}

typedef struct a_gdn_multi {
    const dfk_gdn_job *jobs; /* in the step's parameters */
    int n;
    gdn_dims d;
} a_gdn_multi;

static int run_gdn_multi(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_gdn_multi *g = args;
    const gdn_dims *d = &g->d;
    return dfk_gdn_multi(g->jobs, g->n, d->C, d->K, d->nk, d->nv, d->dk, d->dv, d->eps, d->M);
}

/* backend.h `gdn_states`: the layers' job table goes with the step's parameters; two launches
 * per DFK_GDN_JOBS layers. */
#define DFK_GDN_JOBS 64
static void cu_gdn_states(df_backend *be, const df_gdn_shape *sh, int M, int n, const df_gdn_layer *layers) {
    cuda_backend *cb = cub(be);
    if (n <= 0 || M <= 0) return;
    a_gdn_multi g;
    memset(&g, 0, sizeof g);
    g.d = gdn_dims_of(sh, M);
    const size_t per = (size_t)M * (size_t)g.d.C;
    const int chunk = n < DFK_GDN_JOBS ? n : DFK_GDN_JOBS;
    if (!scratch(cb, (void **)&cb->conv_out, &cb->conv_cap, per * (size_t)chunk, sizeof(float))) return;
    _Static_assert(sizeof(dfk_gdn_job) % sizeof(int32_t) == 0, "a job is a whole number of parameter ints");
    const size_t job_ints = sizeof(dfk_gdn_job) / sizeof(int32_t);
    for (int i0 = 0; i0 < n; i0 += chunk) {
        const int nn = n - i0 < chunk ? n - i0 : chunk;
        size_t off = params(cb, (size_t)nn * job_ints + 1);
        off += off & 1; /* 8-byte aligned pointers */
        dfk_gdn_job *jobs = (dfk_gdn_job *)(void *)(hparams(cb) + off);
        for (int i = 0; i < nn; i++) {
            const df_gdn_layer *L = &layers[i0 + i];
            dfk_gdn_job J;
            J.qkv = L->qkv;
            J.z = L->z;
            J.a = L->a;
            J.b = L->b;
            J.conv_w = dvec(cb, L->conv_w, (size_t)g.d.C * (size_t)g.d.K);
            J.A_log = dvec(cb, L->A_log, (size_t)g.d.nv);
            J.dt_bias = dvec(cb, L->dt_bias, (size_t)g.d.nv);
            J.norm_w = dvec(cb, L->norm_w, (size_t)g.d.dv);
            J.conv_state = L->conv_state;
            J.S = L->S;
            df_step_writes_note(&cb->sw, L->conv_state, 0);
            df_step_writes_note(&cb->sw, L->S, 0);
            J.conv_out = cb->conv_out + (size_t)i * per;
            if (!J.conv_w || !J.A_log || !J.dt_bias || !J.norm_w) {
                if (!be->failed) fail(cb, "gdn: missing weights");
                return;
            }
            memcpy(&jobs[i], &J, sizeof J);
        }
        g.jobs = (const dfk_gdn_job *)(const void *)(cb->dparams + off);
        g.n = nn;
        record(cb, run_gdn_multi, "gdn_states", &g, sizeof g);
    }
}

static void cu_gdn(df_backend *be, const df_gdn_shape *sh, const float *qkv, const float *z, const float *a,
                   const float *b, const float *conv_w, const float *A_log, const float *dt_bias, const float *norm_w,
                   int M, float *conv_state, float *S, float *out) {
    cu_gdn_to(be, sh, qkv, z, a, b, conv_w, A_log, dt_bias, norm_w, M, conv_state, S, conv_state, S, out);
}

typedef struct a_dyn {
    const float *x, *dyn, *base;
    float *out;
    int dyn_stride, K, gs, M, H;
} a_dyn;

static int run_dyn(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_dyn *a = args;
    return dfk_dyn_conv(a->x, a->dyn, a->dyn_stride, a->base, a->K, a->gs, a->M, a->H, a->out);
}

static void cu_dyn_conv(df_backend *be, const float *x, const float *dyn, int dyn_stride, const float *base, int K,
                        int gs, int M, int H, float *out) {
    cuda_backend *cb = cub(be);
    a_dyn a;
    memset(&a, 0, sizeof a);
    if (gs <= 0 || H % gs != 0) {
        fail(cb, "dyn_conv: group size %d does not divide %d", gs, H);
        return;
    }
    if (!(a.base = dvec(cb, base, (size_t)K * (size_t)H))) return;
    a.x = x;
    a.dyn = dyn;
    a.out = out;
    a.dyn_stride = dyn_stride;
    a.K = K;
    a.gs = gs;
    a.M = M;
    a.H = H;
    record(cb, run_dyn, "dyn_conv", &a, sizeof a);
}

typedef struct a_argmax {
    const float *x;
    int32_t *out;
    int rows, width, bad;
} a_argmax;

static int run_argmax(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_argmax *a = args;
    return dfk_argmax(a->x, a->rows, a->width, a->out, a->bad);
}

/* backend.h `argmax_dev`. */
static void cu_argmax_dev(df_backend *be, const float *x, int rows, int width, int32_t *out, int32_t bad) {
    cuda_backend *cb = cub(be);
    for (int r0 = 0; r0 < rows; r0 += DFK_MAX_ROWS) {
        a_argmax a;
        memset(&a, 0, sizeof a);
        a.x = x + (size_t)r0 * (size_t)width;
        a.out = out + r0;
        a.rows = rows - r0 < DFK_MAX_ROWS ? rows - r0 : DFK_MAX_ROWS;
        a.width = width;
        a.bad = bad;
        record(cb, run_argmax, "argmax", &a, sizeof a);
    }
}

static void cu_argmax(df_backend *be, const float *x, int rows, int width, int32_t *out) {
    cuda_backend *cb = cub(be);
    for (int r0 = 0; r0 < rows; r0 += DFK_MAX_ROWS) {
        const int n = rows - r0 < DFK_MAX_ROWS ? rows - r0 : DFK_MAX_ROWS;
        a_argmax a;
        memset(&a, 0, sizeof a);
        a.x = x + (size_t)r0 * (size_t)width;
        a.out = cb->ids;
        a.rows = n;
        a.width = width;
        a.bad = -1;
        record(cb, run_argmax, "argmax", &a, sizeof a);
        step_run(cb);
        if (!check(cb, (int)cudaMemcpy(out + r0, cb->ids, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost),
                   "argmax"))
            return;
    }
}

typedef struct a_top_k {
    const float *x;
    int width, k;
    int32_t *ids;
    float *vals;
} a_top_k;

static int run_top_k(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_top_k *a = args;
    return dfk_top_k(a->x, a->width, a->k, a->ids, a->vals);
}

/* The arguments of the top-k kernels for row x: their list in the backend's buffer (64 ids,
 * then 64 values; allocated at the first use). 0 (the backend failed) when out of memory. */
static int top_k_args(cuda_backend *cb, const float *x, int width, int k, a_top_k *a) {
    if (!cb->tk && !(cb->tk = dmalloc(cb, 128 * sizeof(int32_t)))) {
        fail(cb, "CUDA backend: out of device memory for top_k");
        return 0;
    }
    memset(a, 0, sizeof *a);
    a->x = x;
    a->width = width;
    a->k = k;
    a->ids = (int32_t *)cb->tk;
    a->vals = (float *)cb->tk + 64;
    return 1;
}

/* backend.h `top_k`: the kernels' 512-byte result read back; rows wider than the kernels take
 * go to the host whole. */
static void cu_top_k(df_backend *be, const float *x, int width, int k, int32_t *ids, float *vals) {
    cuda_backend *cb = cub(be);
    if (width > dfk_top_k_max_width()) {
        float *row = malloc((size_t)width * sizeof(float));
        if (!row) {
            fail(cb, "CUDA backend: out of host memory for top_k");
            return;
        }
        cu_to_host(be, row, x, (size_t)width * sizeof(float));
        df_top_k_host(row, width, k, ids, vals);
        free(row);
        return;
    }
    a_top_k a;
    if (!top_k_args(cb, x, width, k, &a)) return;
    record(cb, run_top_k, "top_k", &a, sizeof a);
    step_run(cb);
    if (check(cb, (int)cudaMemcpy(ids, a.ids, (size_t)k * sizeof(int32_t), cudaMemcpyDeviceToHost), "top_k"))
        check(cb, (int)cudaMemcpy(vals, a.vals, (size_t)k * sizeof(float), cudaMemcpyDeviceToHost), "top_k");
}

typedef struct a_draw {
    a_top_k t;
    dfk_draw d;
} a_draw;

static int run_draw(cuda_backend *cb, const void *args) {
    (void)cb;
    const a_draw *a = args;
    return dfk_top_k_draw(a->t.x, a->t.width, a->t.k, a->t.ids, a->t.vals, &a->d);
}

/* backend.h `sample_top_dev`: the top-k kernels with the draw in their merge; the random bits in
 * the step's parameter block (so that replayed steps differ in them alone). Rows wider than the
 * kernels take: the host's top-k and draw, the token copied back. */
static void cu_sample_top_dev(df_backend *be, const float *x, int width, const df_top_draw *d, uint64_t u,
                              int32_t *out) {
    cuda_backend *cb = cub(be);
    if (d->k < 1 || d->k > 64 || d->k > width || !(d->temperature > 0.0f)) {
        fail(cb, "sample_top_dev: top-k of %d over %d entries at temperature %g", d->k, width, (double)d->temperature);
        return;
    }
    if (width > dfk_top_k_max_width()) {
        int32_t ids[64];
        float vals[64];
        cu_top_k(be, x, width, d->k, ids, vals);
        const int32_t id = ids[0] < 0 || !isfinite(vals[0]) ? -1 : df_sample_top_list(ids, vals, d->k, d, u);
        cu_to_device(be, out, &id, sizeof id);
        return;
    }
    a_draw a;
    memset(&a, 0, sizeof a);
    if (!top_k_args(cb, x, width, d->k, &a.t)) return;
    const size_t off = params(cb, 2);
    hparams(cb)[off] = (int32_t)(uint32_t)u;
    hparams(cb)[off + 1] = (int32_t)(uint32_t)(u >> 32);
    a.d.temperature = d->temperature;
    a.d.top_p = d->top_p;
    a.d.min_p = d->min_p;
    a.d.u = (const uint32_t *)(cb->dparams + off);
    a.d.out = out;
    record(cb, run_draw, "sample_top", &a, sizeof a);
}

/* ---- construction ---------------------------------------------------------------------------------- */

static void cu_destroy(df_backend *be) {
    cuda_backend *cb = cub(be);
    if (!cb) return;
    if (cb->stream) step_run(cb);
    if (cb->trace_path) (void)dfk_trace_dump(cb->trace_path); /* experiments only: a failed write is not reported */
    if (cb->graphs) {
        for (int i = 0; i < DF_CUDA_MAX_GRAPHS; i++) graph_free(&cb->graphs[i]);
        free(cb->graphs);
    }
    for (size_t i = 0; i < cb->w_cap; i++) {
        if (!cb->w[i]) continue;
        wentry_release(cb, cb->w[i]);
        free(cb->w[i]);
    }
    free(cb->w);
    void *bufs[] = {cb->xf,      cb->xs,   cb->xb,   cb->part, cb->conv_out, cb->ids,
                    cb->dparams, cb->hbuf, cb->lbuf, cb->mbuf, cb->dstage, cb->tk};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) dfree(cb, bufs[i]);
    for (int i = 0; i < DFK_QMAX; i++) {
        dfree(cb, cb->qx[i]);
        dfree(cb, cb->qe[i]);
        dfree(cb, cb->qs[i]);
    }
    /* buffers the caller did not free */
    for (size_t i = 0; i < cb->a_cap; i++)
        if (cb->a[i].p && cb->a[i].p != (void *)1) cudaFree(cb->a[i].p);
    free(cb->a);
    free(cb->cmds);
    free(cb->dfree_later);
    for (int i = 0; i < 2; i++) {
        if (cb->hp_buf[i]) cudaFreeHost(cb->hp_buf[i]);
        if (cb->hs_buf[i]) cudaFreeHost(cb->hs_buf[i]);
        if (cb->pev[i]) cudaEventDestroy(cb->pev[i]);
    }
    if (cb->stream) cudaStreamDestroy(cb->stream);
    free(cb);
}

/* the ops of both tables below */
#define CUDA_OPS_COMMON \
    .name = "cuda", \
    .destroy = cu_destroy, \
    .alloc = cu_alloc, \
    .dealloc = cu_dealloc, \
    .to_device = cu_to_device, \
    .to_host = cu_to_host, \
    .copy = cu_copy, \
    .copy_rows = cu_copy_rows, \
    .zero = cu_zero, \
    .host_const = cu_host_const, \
    .embed = cu_embed, \
    .linear = cu_linear, \
    .rmsnorm = cu_rmsnorm, \
    .add = cu_add, \
    .swiglu = cu_swiglu, \
    .attention = cu_attention, \
    .kv_append = cu_kv_append, \
    .dyn_conv = cu_dyn_conv, \
    .gdn = cu_gdn, \
    .argmax = cu_argmax, \
    .top_k = cu_top_k, \
    .linears = cu_linears, \
    .linear_add = cu_linear_add, \
    .gdn_to = cu_gdn_to, \
    .gdn_states = cu_gdn_states,

/* token ids in backend memory (backend.h) */
#define CUDA_OPS_IDS .embed_dev = cu_embed_dev, .argmax_dev = cu_argmax_dev, .submit = cu_submit,

static const df_backend_ops cuda_ops = {CUDA_OPS_COMMON CUDA_OPS_IDS.read_ahead = cu_read_ahead,
                                        .sample_top_dev = cu_sample_top_dev};

/* DFLASH_CUDA_READ_AHEAD=0 (experiments: plain decoding records each step after reading the
 * previous step's token, greedy or sampled (then from the top k on the host), for same-binary
 * comparisons) */
static const df_backend_ops cuda_ops_no_ahead = {CUDA_OPS_COMMON CUDA_OPS_IDS};

/* DFLASH_CUDA_IDS_DEV=0 (experiments: the speculative round's ids through the host, each pass
 * awaited, for same-binary comparisons) */
static const df_backend_ops cuda_ops_host_ids = {
    CUDA_OPS_COMMON
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
    const char *sbw = getenv("DFLASH_CUDA_SUBMIT");
    cb->submit_waits = sbw && strcmp(sbw, "0") == 0;
    const char *idd = getenv("DFLASH_CUDA_IDS_DEV");
    const char *rah = getenv("DFLASH_CUDA_READ_AHEAD");
    cb->base.ops = idd && strcmp(idd, "0") == 0   ? &cuda_ops_host_ids
                   : rah && strcmp(rah, "0") == 0 ? &cuda_ops_no_ahead
                                                  : &cuda_ops;
    const char *swt = getenv("DFLASH_CUDA_SW_AT_WAIT"); /* 1: forget writes at host waits only (experiments) */
    cb->sw_at_wait = swt && strcmp(swt, "1") == 0;
    cb->base.n_threads = 1;
    df_step_writes_init(&cb->sw);
    const char *lin = getenv("DFLASH_CUDA_LINEAR");
    cb->force_simple = lin && strcmp(lin, "simple") == 0;
    /* DFLASH_CUDA_LINEAR=bf16split: quantized weights on the bf16 tensor-core path (exact
     * float32 activations, slower) instead of the fixed-point path */
    cb->qpath = !(lin && strcmp(lin, "bf16split") == 0);
    const char *qsc = getenv("DFLASH_CUDA_QSCALES"); /* 0: keep the biases of ternary weights (the same bits) */
    cb->q_scales_only = !(qsc && strcmp(qsc, "0") == 0);
    const char *pdl = getenv("DFLASH_CUDA_PDL");
    dfk_set_pdl(pdl && strcmp(pdl, "0") == 0 ? 0 : (pdl && strcmp(pdl, "linears") == 0 ? 2 : 1));
    const char *qp = getenv("DFLASH_CUDA_QPERSIST");
    dfk_set_q_persistent(qp && strcmp(qp, "1") == 0);
    const char *qpf = getenv("DFLASH_CUDA_QPREFETCH");
    dfk_set_q_prefetch(!(qpf && strcmp(qpf, "0") == 0));
    /* DFLASH_CUDA_QRING=0|1: the fixed-point linear's kernel (dfk_linear_q; the same bits in
     * either) */
    const char *qring = getenv("DFLASH_CUDA_QRING");
    cb->q_ring = qring && strcmp(qring, "0") == 0 ? 0 : 1;
    /* DFLASH_CUDA_QBULK=0: the ring kernel's records copied per lane (cp.async) instead of by
     * bulk copies (the same bits); 1: bulk copies up to 4 rows; 2 (default): up to 8 rows
     * (measured on the H200: verify passes of 6 and 7 rows 11% faster, 8 rows 4%) */
    const char *qbk = getenv("DFLASH_CUDA_QBULK");
    cb->q_bulk = qbk && strcmp(qbk, "0") == 0 ? 0 : (qbk && strcmp(qbk, "1") == 0 ? 1 : 2);
    /* DFLASH_CUDA_PROFILE_SKIP=name,name: commands (by their names: "linear prep", "gdn", ...)
     * that are recorded but not run, to time the rest of a step in place. The results are
     * wrong: for timing experiments only. */
    const char *dfirst = getenv("DFLASH_CUDA_DENSE_FIRST"); /* 0: after them (the same bits) */
    cb->dense_first = !(dfirst && strcmp(dfirst, "0") == 0);
    const char *dride = getenv("DFLASH_CUDA_DENSE_RIDE"); /* 0: their own launch (the same bits) */
    cb->dense_ride = !(dride && strcmp(dride, "0") == 0);
    const char *pskip = getenv("DFLASH_CUDA_PROFILE_SKIP");
    snprintf(cb->profile_skip, sizeof cb->profile_skip, "%s", pskip ? pskip : "");
    const char *qrm = getenv("DFLASH_CUDA_QRING_MAXM");
    cb->q_ring_max_m = qrm ? atoi(qrm) : 0;
    const char *qct = getenv("DFLASH_CUDA_QCTAS"); /* persistent grid size (tests: many units per CTA) */
    cb->q_ctas = qct && atoi(qct) > 0 ? atoi(qct) : 0;
    const char *qsm = getenv("DFLASH_CUDA_QSMEM");
    dfk_set_qsmem(!(qsm && strcmp(qsm, "0") == 0));
    /* DFLASH_CUDA_QSPLIT_BYTES / _ROWS: the fixed-point linears of M rows in launches of fewer
     * rows (dfk_qsched.split_bytes, split_rows; the same bits; 0: no limit) */
    const char *qsb = getenv("DFLASH_CUDA_QSPLIT_BYTES"), *qsr = getenv("DFLASH_CUDA_QSPLIT_ROWS");
    /* default: launches whose input copy would take more than 150000 bytes (the down projection
     * from 5 rows, lm_head at 16) split; measured with DFLASH_CUDA_QBULK=2: verify passes of
     * 15 and 16 rows 7-13% faster, the drafter pass at 16 rows 14%, 9 and 13 rows 2-3% slower */
    cb->q_split_bytes = qsb ? (atoi(qsb) > 0 ? atoi(qsb) : 0) : 150000;
    cb->q_split_rows = qsr && atoi(qsr) > 0 ? atoi(qsr) : 0;
    const char *qsmx = getenv("DFLASH_CUDA_QSMEM_MAX"); /* bytes of input copy per CTA at most */
    if (qsmx && atol(qsmx) >= 0) dfk_set_qsmem_max((size_t)atol(qsmx));
    const char *ctas = getenv("DFLASH_CUDA_TARGET_CTAS");
    cb->target_ctas = ctas && atoi(ctas) > 0 ? atoi(ctas) : 1056; /* about 4 waves of 2 CTAs per SM */
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
        dfk_set_sm_count(prop.multiProcessorCount);
        dfk_set_q_sm_count(prop.multiProcessorCount);
    }
    const char *dec = getenv("DFLASH_CUDA_DEC");
    dfk_set_use_dec(dec && strcmp(dec, "1") == 0);
    const char *occ = getenv("DFLASH_CUDA_OCC"); /* experiments: 3 = a tighter register budget (spills) */
    dfk_set_occupancy(occ && atoi(occ) == 3 ? 3 : 2);
    const char *gf = getenv("DFLASH_CUDA_GDN_FUSED");
    g_gdn_fused = !(gf && strcmp(gf, "0") == 0);
    const char *gsm = getenv("DFLASH_CUDA_GDN_SMALL");
    dfk_set_gdn_small(!(gsm && strcmp(gsm, "0") == 0));
    const char *ach = getenv("DFLASH_CUDA_ATTN_CHUNK"); /* 32 (default) or 64 positions per attention block */
    if (ach) dfk_set_attn_chunk(atoi(ach));
    const char *adg = getenv("DFLASH_CUDA_ATTN_DIAG"); /* timing experiments only (dfk_set_attn_diag) */
    dfk_set_attn_diag(adg ? atoi(adg) : 0);
    const char *hp = getenv("DFLASH_CUDA_HOST_PROFILE"); /* diagnostics: host time in weight lookups, records */
    cb->host_profile = hp && atoi(hp) > 0;
    const char *qg = getenv("DFLASH_CUDA_QGRID"); /* 0: the fewest CTAs with equal units (dfk_set_q_full_grid) */
    dfk_set_q_full_grid(!(qg && strcmp(qg, "0") == 0));
    const char *qst = getenv("DFLASH_CUDA_QSTAGE"); /* k_lin_qb's ring shape (dfk_set_q_stage) */
    dfk_set_q_stage(qst ? atoi(qst) : 0);
    const char *qdg = getenv("DFLASH_CUDA_QDIAG"); /* timing experiments only (dfk_set_q_diag) */
    dfk_set_q_diag(qdg ? atoi(qdg) : 0);
    const char *rfs = getenv("DFLASH_CUDA_RIDE_FIRST"); /* where the dense riders run (dfk_set_ride_first) */
    dfk_set_ride_first(rfs && atoi(rfs) > 0);
    const char *mgs = getenv("DFLASH_CUDA_MMA_GROUP"); /* 0: one launch per tensor-core linear (lin_group) */
    cb->mma_group = !(mgs && atoi(mgs) == 0);
    const char *graphs = getenv("DFLASH_CUDA_GRAPHS");
    cb->use_graphs = !(graphs && strcmp(graphs, "0") == 0);
    cb->sig_hash = 0xcbf29ce484222325ULL;
    if (!w_grow(cb) || !a_grow(cb) || !(cb->ids = dmalloc(cb, DFK_MAX_ROWS * sizeof(int32_t))) ||
        !(cb->dparams = dmalloc(cb, DF_CUDA_MAX_PARAMS * sizeof(int32_t))) ||
        cudaMallocHost((void **)&cb->hp_buf[0], DF_CUDA_MAX_PARAMS * sizeof(int32_t)) != cudaSuccess ||
        cudaMallocHost((void **)&cb->hp_buf[1], DF_CUDA_MAX_PARAMS * sizeof(int32_t)) != cudaSuccess ||
        cudaMallocHost((void **)&cb->hs_buf[0], DF_CUDA_STAGE_BYTES) != cudaSuccess ||
        cudaMallocHost((void **)&cb->hs_buf[1], DF_CUDA_STAGE_BYTES) != cudaSuccess ||
        cudaEventCreateWithFlags(&cb->pev[0], cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&cb->pev[1], cudaEventDisableTiming) != cudaSuccess ||
        !(cb->graphs = calloc(DF_CUDA_MAX_GRAPHS, sizeof *cb->graphs)) ||
        cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking) != cudaSuccess) {
        cudaGetLastError();
        cu_destroy(&cb->base);
        return df_error_set(err, DF_ERR_NOMEM, "CUDA backend: out of memory");
    }
    /* experiments: the kernel timeline of the process's last steps, written to this file when
     * the backend is destroyed (cuda_trace.cuh; tools/trace_report.py reads it) */
    const char *trace = getenv("DFLASH_CUDA_TRACE");
    if (trace && *trace && dfk_trace_start(23) == 0) cb->trace_path = trace;
    *out = &cb->base;
    return DF_OK;
}

const char *df_backend_cuda_last_error(df_backend *be) { return cub(be)->err; }

void df_backend_cuda_stats(df_backend *be, df_cuda_stats *st) {
    cuda_backend *cb = cub(be);
    st->steps = cb->n_steps;
    st->graph_replays = cb->n_replays;
    st->graph_captures = cb->n_captures;
    st->host_between_ms = cb->host_between_ms;
    st->host_launch_ms = cb->host_launch_ms;
    st->host_weights_ms = cb->host_weights_ms;
    st->host_record_ms = cb->host_record_ms;
    st->commands = cb->n_recorded;
    st->cur_bytes = cb->cur;
    st->peak_bytes = cb->peak;
    st->weight_bytes = cb->weight_bytes;
    int nw = 0;
    for (size_t i = 0; i < cb->w_cap; i++)
        if (cb->w[i] && cb->w[i]->d_w) nw++;
    st->n_weights = nw;
}

void df_backend_cuda_reset_peak(df_backend *be) { cub(be)->peak = cub(be)->cur; }

/* A process-wide kernel choice changed between steps: the recorded commands run first, and the
 * captured graphs (made with the other kernels) are dropped. */
static void set_between_steps(df_backend *be, void (*apply)(int), int on) {
    cuda_backend *cb = cub(be);
    step_run(cb);
    apply(on);
    for (int i = 0; i < DF_CUDA_MAX_GRAPHS; i++) graph_free(&cb->graphs[i]);
}
static void gdn_fused_apply(int on) { g_gdn_fused = on ? 1 : 0; }

void df_backend_cuda_set_gdn_fused(df_backend *be, int on) { set_between_steps(be, gdn_fused_apply, on); }

void df_backend_cuda_set_attn_chunk(df_backend *be, int chunk) { set_between_steps(be, dfk_set_attn_chunk, chunk); }

void df_backend_cuda_sync(df_backend *be) {
    step_run(cub(be));
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
