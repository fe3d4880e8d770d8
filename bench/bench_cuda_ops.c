/* bench_cuda_ops: time of single CUDA backend ops at 27B shapes, against the bytes they must
 * move (needs a GPU; prints a message and exits 0 without one).
 *
 *   bench_cuda_ops [--iters N] [--quant-only] [--shape NAME] [--block] [--attention]
 *
 * Linear (2-bit, group 128, Hadamard 1024) for the target's shapes at M = 1, 2, 4, 8, 16 rows:
 * microseconds per call and weight bytes / time; dense bf16 (drafter) at M = 8, 16; attention
 * (the q/k preparation, the chunks and their merge; graphs replayed) of the target (24/4 heads
 * x 256) at contexts 1024 and 32768 for M = 1, 4 and 16 and of the drafter (32/8 x 128, a block
 * over its context) at 1024 for M = 4, 8 and 16; Gated DeltaNet (48 heads 128 x 128) for M = 1,
 * 4 and 16. --quant-only: the 2-bit linears only; --attention: attention only; --shape NAME: the
 * linears whose name contains NAME. --block: one MLP block and the next layer's input
 * projections as the model runs them (RMSNorm + gate/up, SwiGLU + down + residual, RMSNorm +
 * in_proj_qkv/z) at M = 1, repeated: microseconds per block against its weight bytes.
 * Environment variables of the backend (DFLASH_CUDA_KW, DFLASH_CUDA_TARGET_CTAS, DFLASH_CUDA_LINEAR,
 * DFLASH_CUDA_ATTN_CHUNK, DFLASH_CUDA_ATTN_DIAG) apply, for experiments. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/threads.h"
#ifdef DFLASH_WITH_CUDA
#include "backend/cuda/cuda_backend.h"

static uint64_t rs = 88172645463325252ULL;
static uint32_t urand(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)rs;
}
static float frand(void) { return (float)(urand() >> 8) / (float)(1 << 24) * 2.0f - 1.0f; }
static uint16_t f16(float f) {
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

typedef struct wset {
    df_linear L;
    void *w;
    uint16_t *s, *b;
    float *signs;
} wset;

static void make(wset *q, int rows, int cols, int quant) {
    memset(q, 0, sizeof *q);
    q->L.name = "bench";
    q->L.rows = rows;
    q->L.cols = cols;
    if (quant == 1) {
        size_t words = (size_t)rows * (size_t)cols / 16;
        uint32_t *w = malloc(words * 4);
        for (size_t i = 0; i < words; i++) w[i] = urand() & 0x55555555u;
        size_t ng = (size_t)rows * (size_t)(cols / 128);
        q->s = malloc(ng * 2);
        q->b = malloc(ng * 2);
        for (size_t i = 0; i < ng; i++) {
            q->s[i] = f16(0.02f);
            q->b[i] = f16(-0.02f);
        }
        q->signs = malloc((size_t)cols * 4);
        for (int i = 0; i < cols; i++) q->signs[i] = (urand() & 1) ? 1.0f : -1.0f;
        q->L.bits = 2;
        q->L.group_size = 128;
        q->L.wdtype = DF_DTYPE_U32;
        q->L.sdtype = DF_DTYPE_F16;
        q->L.scales = q->s;
        q->L.biases = q->b;
        q->L.hadamard_block = 1024;
        q->L.signs = q->signs;
        q->w = w;
    } else {
        size_t n = (size_t)rows * (size_t)cols;
        uint16_t *w = malloc(n * 2);
        for (size_t i = 0; i < n; i++) w[i] = (uint16_t)(0x3c00u | (urand() & 0x03ffu)) ^ (uint16_t)(urand() & 0x8000u);
        q->L.wdtype = quant == 2 ? DF_DTYPE_F16 : DF_DTYPE_BF16;
        q->w = w;
    }
    q->L.w = q->w;
}

/* Weight bytes a call reads: 2-bit codes and 16-bit scales and biases per 128 columns (the
 * biases not, for ternary weights: the backend stores their scales alone). */
static double bytes_of(const df_linear *L) {
    if (L->bits)
        return (double)L->rows * L->cols * 2.0 / 8.0 +
               (double)L->rows * (L->cols / 128) * (df_linear_biases_negate_scales(L) ? 2.0 : 4.0);
    return (double)L->rows * L->cols * 2.0;
}

static void free_wset(wset *q) {
    free(q->w);
    free(q->s);
    free(q->b);
    free(q->signs);
}

/* --block (file comment). */
static void bench_block(df_backend *be, int iters, double bw) {
    const int H = 5120, I = 17408;
    wset gate, up, down, qkv, z;
    make(&gate, I, H, 1);
    make(&up, I, H, 1);
    make(&down, H, I, 1);
    make(&qkv, 10240, H, 1);
    make(&z, 6144, H, 1);
    float *nw = malloc(H * 4), *xh = malloc(H * 4);
    for (int i = 0; i < H; i++) {
        nw[i] = 1.0f + 0.1f * frand();
        xh[i] = frand();
    }
    float *x = be->ops->alloc(be, H * 4), *g = be->ops->alloc(be, I * 4), *u = be->ops->alloc(be, I * 4);
    float *q = be->ops->alloc(be, 10240 * 4), *zz = be->ops->alloc(be, 6144 * 4);
    const df_linear *W1[2] = {&gate.L, &up.L}, *W2[2] = {&qkv.L, &z.L};
    float *y1[2] = {g, u}, *y2[2] = {q, zz};
    const double bytes = bytes_of(&gate.L) + bytes_of(&up.L) + bytes_of(&down.L) + bytes_of(&qkv.L) + bytes_of(&z.L);
    for (int rep = 0; rep < 2; rep++) { /* rep 0: upload and warm-up */
        const int it = rep ? iters : 2;
        be->ops->to_device(be, x, xh, H * 4);
        df_backend_cuda_sync(be);
        const double t0 = df_now_ms();
        for (int i = 0; i < it; i++) {
            be->ops->linears(be, x, nw, 1e-6f, 1, H, 2, W1, y1, NULL);
            be->ops->linear_add(be, &down.L, g, u, 1, x);
            be->ops->linears(be, x, nw, 1e-6f, 1, H, 2, W2, y2, NULL);
        }
        df_backend_cuda_sync(be);
        const double us = (df_now_ms() - t0) * 1000.0 / it;
        if (rep)
            printf("block bench (norm + gate/up, SwiGLU + down + add, norm + qkv/z; M = 1): %.1f us per block, "
                   "%.1f MB: %.0f GB/s = %.1f%% of %.0f GB/s\n",
                   us, bytes / 1e6, bytes / (us * 1e3), 100.0 * bytes / (us * 1e3) / bw, bw);
    }
    if (be->failed) printf("CUDA backend error: %s\n", df_backend_cuda_last_error(be));
    float *bufs[] = {x, g, u, q, zz};
    for (int i = 0; i < 5; i++) be->ops->dealloc(be, bufs[i]);
    wset *ws[] = {&gate, &up, &down, &qkv, &z};
    for (int i = 0; i < 5; i++) free_wset(ws[i]);
    free(nw);
    free(xh);
}

int main(int argc, char **argv) {
    int iters = 50, quant_only = 0, block = 0, attn_only = 0;
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quant-only")) quant_only = 1;
        else if (!strcmp(argv[i], "--block")) block = 1;
        else if (!strcmp(argv[i], "--attention")) attn_only = 1;
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) only = argv[++i];
    }
    df_error err = {0};
    df_backend *be = NULL;
    if (df_backend_cuda_create(&be, 0, &err) != DF_OK) {
        printf("bench_cuda_ops: %s\n", err.msg);
        return 0;
    }
    double bw = 0;
    df_cuda_copy_bandwidth((size_t)2 << 30, &bw, &err);
    printf("copy bandwidth %.0f GB/s\n", bw);
    if (block) {
        bench_block(be, iters, bw);
        be->ops->destroy(be);
        return 0;
    }
    struct {
        const char *name;
        int rows, cols, quant;
    } shapes[] = {
        {"gdn in_proj_qkv", 10240, 5120, 1}, {"gdn in_proj_z", 6144, 5120, 1},  {"gdn out_proj", 5120, 6144, 1},
        {"attn q_proj", 12288, 5120, 1},     {"attn k_proj", 1024, 5120, 1},    {"attn o_proj", 5120, 6144, 1},
        {"mlp gate/up", 17408, 5120, 1},     {"mlp down", 5120, 17408, 1},      {"lm_head", 248320, 5120, 1},
        {"gdn in_proj_a f16", 48, 5120, 2},
        {"drafter gate/up bf16", 17408, 5120, 0}, {"drafter down bf16", 5120, 17408, 0}, {"drafter q bf16", 4096, 5120, 0},
    };
    float *x = malloc((size_t)16 * 17408 * 4);
    for (int i = 0; i < 16 * 17408; i++) x[i] = frand();
    float *dx = be->ops->alloc(be, (size_t)16 * 17408 * 4);
    be->ops->to_device(be, dx, x, (size_t)16 * 17408 * 4);
    float *dy = be->ops->alloc(be, (size_t)16 * 248320 * 4);
    printf("linear: us per call (GB/s of weight bytes) for M = 1 2 4 8 16\n");
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        if (attn_only || (quant_only && shapes[k].quant != 1) || (only && !strstr(shapes[k].name, only))) continue;
        wset q;
        make(&q, shapes[k].rows, shapes[k].cols, shapes[k].quant);
        be->ops->linear(be, &q.L, dx, 1, dy); /* upload */
        df_backend_cuda_sync(be);
        printf("  %-22s %6d x %5d %7.1f MB:", shapes[k].name, shapes[k].rows, shapes[k].cols, bytes_of(&q.L) / 1e6);
        const int Ms[] = {1, 2, 4, 8, 16};
        for (int mi = 0; mi < 5; mi++) {
            int it = shapes[k].rows > 100000 ? iters / 5 + 1 : iters;
            be->ops->linear(be, &q.L, dx, Ms[mi], dy);
            df_backend_cuda_sync(be);
            double t0 = df_now_ms();
            for (int i = 0; i < it; i++) be->ops->linear(be, &q.L, dx, Ms[mi], dy);
            df_backend_cuda_sync(be);
            double us = (df_now_ms() - t0) * 1000.0 / it;
            printf("  %7.1f (%4.0f)", us, bytes_of(&q.L) / (us * 1e3));
        }
        printf("\n");
        free(q.w);
        free(q.s);
        free(q.b);
        free(q.signs);
    }
    if (quant_only) {
        if (be->failed) printf("CUDA backend error: %s\n", df_backend_cuda_last_error(be));
        free(x);
        be->ops->destroy(be);
        return 0;
    }
    /* attention: the target's (24/4 heads x 256, causal) at contexts 1024 and 32768, the
     * drafter's (32/8 x 128, a block over its context) at 1024 */
    const df_attn_shape tsh = {.n_heads = 24, .n_kv_heads = 4, .head_dim = 256, .rot_dims = 64,
                               .mrope_section = {11, 11, 10}, .rope_theta = 1e7f, .eps = 1e-6f, .gated = 1,
                               .causal = 1};
    df_attn_shape dsh = tsh;
    dsh.n_heads = 32, dsh.n_kv_heads = 8, dsh.head_dim = 128, dsh.rot_dims = 128, dsh.gated = 0, dsh.causal = 0;
    const struct {
        const char *name;
        const df_attn_shape *sh;
        int ctx, Ms[3];
    } acases[] = {{"attention", &tsh, 1024, {1, 4, 16}},
                  {"attention", &tsh, 32768, {1, 4, 16}},
                  {"drafter attention", &dsh, 1024, {4, 8, 16}}};
    float *qn = malloc(256 * 4);
    for (int i = 0; i < 256; i++) qn[i] = 1.0f;
    for (size_t c = 0; c < sizeof acases / sizeof acases[0]; c++) {
        const df_attn_shape *sh = acases[c].sh;
        const int ctx = acases[c].ctx, kd = sh->n_kv_heads * sh->head_dim;
        const size_t kvb = (size_t)(ctx + 16) * (size_t)kd * 4;
        float *kc = be->ops->alloc(be, kvb), *vc = be->ops->alloc(be, kvb);
        float *q = be->ops->alloc(be, (size_t)16 * 24 * 512 * 4), *kk = be->ops->alloc(be, (size_t)16 * 1024 * 4);
        float *out = be->ops->alloc(be, (size_t)16 * 24 * 256 * 4);
        int32_t pos[16];
        for (int m = 0; m < 16; m++) pos[m] = ctx + m;
        for (int mi = 0; mi < 3; mi++) {
            const int M = acases[c].Ms[mi];
            double us = 0;
            for (int rep = 0; rep < 3; rep++) { /* the third run replays the step's captured graph */
                double t0 = df_now_ms();
                for (int i = 0; i < iters; i++) be->ops->attention(be, sh, q, kk, kk, qn, qn, pos, M, kc, vc, ctx, out);
                df_backend_cuda_sync(be);
                us = (df_now_ms() - t0) * 1000.0 / iters;
            }
            const double mb = 2.0 * (double)ctx * (double)kd * 4 / 1e6;
            printf("%s ctx %5d M %2d: %8.1f us (KV %.0f MB: %.0f GB/s)\n", acases[c].name, ctx, M, us, mb,
                   mb * 1e3 / us);
        }
        be->ops->dealloc(be, kc);
        be->ops->dealloc(be, vc);
        be->ops->dealloc(be, q);
        be->ops->dealloc(be, kk);
        be->ops->dealloc(be, out);
    }
    if (attn_only) {
        if (be->failed) printf("CUDA backend error: %s\n", df_backend_cuda_last_error(be));
        free(x);
        be->ops->destroy(be);
        return 0;
    }
    /* GDN */
    const df_gdn_shape gs = {.n_k_heads = 16, .n_v_heads = 48, .k_head_dim = 128, .v_head_dim = 128, .conv_kernel = 4,
                             .eps = 1e-6f};
    const int C = 2 * 16 * 128 + 48 * 128;
    float *cw = malloc((size_t)C * 4 * 4), *al = malloc(48 * 4), *dt = malloc(48 * 4), *nw = malloc(128 * 4);
    for (int i = 0; i < C * 4; i++) cw[i] = 0.1f * frand();
    for (int i = 0; i < 48; i++) al[i] = dt[i] = 0.5f;
    for (int i = 0; i < 128; i++) nw[i] = 1.0f;
    float *qkv = be->ops->alloc(be, (size_t)16 * C * 4), *z = be->ops->alloc(be, (size_t)16 * 6144 * 4);
    float *ab = be->ops->alloc(be, (size_t)16 * 48 * 4), *cs = be->ops->alloc(be, (size_t)3 * C * 4);
    float *S = be->ops->alloc(be, (size_t)48 * 128 * 128 * 4), *o = be->ops->alloc(be, (size_t)16 * 6144 * 4);
    const int Ms[] = {1, 4, 16};
    for (int mi = 0; mi < 3; mi++) {
        be->ops->gdn(be, &gs, qkv, z, ab, ab, cw, al, dt, nw, Ms[mi], cs, S, o);
        df_backend_cuda_sync(be);
        double t0 = df_now_ms();
        for (int i = 0; i < iters; i++) be->ops->gdn(be, &gs, qkv, z, ab, ab, cw, al, dt, nw, Ms[mi], cs, S, o);
        df_backend_cuda_sync(be);
        printf("gdn M %2d: %.1f us\n", Ms[mi], (df_now_ms() - t0) * 1000.0 / iters);
    }
    /* small ops: launch-bound floor */
    double t0 = df_now_ms();
    for (int i = 0; i < iters * 10; i++) be->ops->add(be, dy, dx, 5120);
    df_backend_cuda_sync(be);
    printf("add (5120 floats): %.1f us per call\n", (df_now_ms() - t0) * 100.0 / iters);
    if (be->failed) printf("CUDA backend error: %s\n", df_backend_cuda_last_error(be));
    be->ops->destroy(be);
    return 0;
}
#else
int main(void) {
    printf("bench_cuda_ops: this build has no CUDA backend\n");
    return 0;
}
#endif
