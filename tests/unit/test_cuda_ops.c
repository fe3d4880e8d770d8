/* CUDA backend, op by op (needs a GPU; skips with a message without one or in a build
 * without the CUDA backend):
 * - exactness: M-row results == M single-row results bit for bit for M = 1..16 (linear in
 *   every format, rmsnorm, embed, attention vs decode steps, GDN rows vs single steps);
 * - work distribution does not change bits (tiles per warp forced to the maximum);
 * - every op agrees with the CPU backend within float32 tolerance (relative 2e-5 for the
 *   linears and norms, looser where the GPU's expf/sinf differ by an ulp or fp16 rounding can
 *   flip); the fixed-point linear (2/4/8-bit weights, groups of 64/128) instead matches an
 *   exact host model of its arithmetic (cuda_qlin.cu) within float32 rounding, and the CPU
 *   within the bound of its activation rounding;
 * - the fused ops (linears with a norm, linear_add with SwiGLU) give the bits of the
 *   composition of the primitive ops on the same backend. */
#include "support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#ifdef DFLASH_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

static df_backend *g_gpu, *g_gpu_tr, *g_gpu_simple, *g_gpu_reg, *g_gpu_persist, *g_gpu_cp, *g_gpu_b8, *g_gpu_affine,
    *g_cpu;
static char g_skip[700];

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static float frand(void) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) & 0xFFFFFF) / (float)(1 << 23) - 1.0f;
}
static uint32_t urand(void) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 32);
}
static uint16_t to_f16(float f) {
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static int setup(void **state) {
    (void)state;
#ifdef DFLASH_WITH_CUDA
    df_error err = {0};
    if (df_backend_cuda_create(&g_gpu, 0, &err) != DF_OK) {
        snprintf(g_skip, sizeof g_skip, "no CUDA device: %s", err.msg);
        g_gpu = NULL;
    } else {
        setenv("DFLASH_CUDA_TARGET_CTAS", "1", 1); /* tiles per warp as large as allowed */
        if (df_backend_cuda_create(&g_gpu_tr, 0, &err) != DF_OK) return -1;
        unsetenv("DFLASH_CUDA_TARGET_CTAS");
        setenv("DFLASH_CUDA_LINEAR", "simple", 1);
        if (df_backend_cuda_create(&g_gpu_simple, 0, &err) != DF_OK) return -1;
        unsetenv("DFLASH_CUDA_LINEAR");
        /* the other schedules of the fixed-point linear: the register kernel; the ring on a
         * grid of 7 CTAs (many units per CTA: streams across their ends) */
        setenv("DFLASH_CUDA_QRING", "0", 1);
        if (df_backend_cuda_create(&g_gpu_reg, 0, &err) != DF_OK) return -1;
        unsetenv("DFLASH_CUDA_QRING");
        setenv("DFLASH_CUDA_QCTAS", "7", 1);
        setenv("DFLASH_CUDA_QSPLIT_ROWS", "3", 1); /* and M rows in launches of at most 3 */
        if (df_backend_cuda_create(&g_gpu_persist, 0, &err) != DF_OK) return -1;
        unsetenv("DFLASH_CUDA_QCTAS");
        unsetenv("DFLASH_CUDA_QSPLIT_ROWS");
        /* bulk copies up to 8 rows, on 7 CTAs */
        setenv("DFLASH_CUDA_QBULK", "2", 1);
        setenv("DFLASH_CUDA_QCTAS", "7", 1);
        if (df_backend_cuda_create(&g_gpu_b8, 0, &err) != DF_OK) return -1;
        unsetenv("DFLASH_CUDA_QBULK");
        unsetenv("DFLASH_CUDA_QCTAS");
        /* the ring fed per lane (cp.async) instead of by bulk copies */
        setenv("DFLASH_CUDA_QBULK", "0", 1);
        if (df_backend_cuda_create(&g_gpu_cp, 0, &err) != DF_OK) return -1;
        unsetenv("DFLASH_CUDA_QBULK");
        /* ternary weights stored with their biases (the others store the scales only) */
        setenv("DFLASH_CUDA_QSCALES", "0", 1);
        if (df_backend_cuda_create(&g_gpu_affine, 0, &err) != DF_OK) return -1;
        unsetenv("DFLASH_CUDA_QSCALES");
    }
#else
    snprintf(g_skip, sizeof g_skip, "this build has no CUDA backend");
#endif
    df_error err2 = {0};
    if (df_backend_cpu_create(&g_cpu, 2, &err2) != DF_OK) return -1;
    if (!g_gpu) printf("SKIP test_cuda_ops: %s (the GPU tests run on a machine with a GPU)\n", g_skip);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    df_backend *bs[] = {g_gpu, g_gpu_tr, g_gpu_simple, g_gpu_reg, g_gpu_persist, g_gpu_cp, g_gpu_b8, g_gpu_affine, g_cpu};
    for (int i = 0; i < 9; i++)
        if (bs[i]) bs[i]->ops->destroy(bs[i]);
    return 0;
}

#define NEED_GPU()                                                                                                     \
    do {                                                                                                               \
        if (!g_gpu) skip();                                                                                            \
    } while (0)

/* device helpers */
static void *dput(df_backend *be, const void *h, size_t bytes) {
    void *d = be->ops->alloc(be, bytes);
    assert_non_null(d);
    be->ops->to_device(be, d, h, bytes);
    return d;
}
static void dget(df_backend *be, void *h, const void *d, size_t bytes) { be->ops->to_host(be, h, d, bytes); }
static void dfree_(df_backend *be, void *d) { be->ops->dealloc(be, d); }

static void gpu_ok(df_backend *be, const char *what) {
#ifdef DFLASH_WITH_CUDA
    if (be->failed) fail_msg("%s: CUDA backend failed: %s", what, df_backend_cuda_last_error(be));
#else
    (void)be;
    (void)what;
#endif
}

/* ‖a − b‖∞ / max(‖b‖∞, floor) */
static double rel_err(const float *a, const float *b, size_t n, double floor) {
    double d = 0, m = floor;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]);
        if (!(e <= d)) d = e;
        if (fabs((double)b[i]) > m) m = fabs((double)b[i]);
    }
    return d / m;
}

/* ---- linear ------------------------------------------------------------------------------------ */

typedef struct qlin {
    df_linear L;
    void *w;
    uint16_t *s, *b;
    float *signs;
} qlin;

/* ternary: 0 = affine codes, 1 = ternary codes with fp16 scales and biases = −scales, 2 = the
 * same with bf16 scales, 3 = ternary but for one bias (+0 where the scale is +0: the same value
 * as −scale, not the same bits) */
static void make_linear(qlin *q, int rows, int cols, int bits, int gs, int had, df_dtype dense, int ternary) {
    memset(q, 0, sizeof *q);
    q->L.name = "test";
    q->L.rows = rows;
    q->L.cols = cols;
    q->L.bits = bits;
    if (bits > 0) {
        size_t words = (size_t)rows * (size_t)cols * (size_t)bits / 32;
        uint32_t *w = malloc(words * 4);
        for (size_t i = 0; i < words; i++) {
            w[i] = urand();
            if (ternary) { /* codes in {0,1,2} */
                uint32_t a = w[i], b2 = urand();
                w[i] = (a & 0x55555555u) | ((~a & b2 & 0x55555555u) << 1);
            }
        }
        q->w = w;
        size_t ng = (size_t)rows * (size_t)(cols / gs);
        q->s = malloc(ng * 2);
        q->b = malloc(ng * 2);
        for (size_t i = 0; i < ng; i++) {
            float s = 0.05f * frand();
            if (ternary == 2) {
                q->s[i] = to_bf16(s);
                q->b[i] = to_bf16(-s);
            } else {
                q->s[i] = to_f16(s);
                q->b[i] = ternary ? to_f16(-s) : to_f16(0.05f * frand());
            }
        }
        if (ternary == 3) q->s[ng / 2] = q->b[ng / 2] = 0; /* +0 and +0 */
        q->L.group_size = gs;
        q->L.wdtype = DF_DTYPE_U32;
        q->L.w = q->w;
        q->L.sdtype = ternary == 2 ? DF_DTYPE_BF16 : DF_DTYPE_F16;
        q->L.scales = q->s;
        q->L.biases = q->b;
    } else {
        size_t n = (size_t)rows * (size_t)cols;
        if (dense == DF_DTYPE_F32) {
            float *w = malloc(n * 4);
            for (size_t i = 0; i < n; i++) w[i] = 0.1f * frand();
            q->w = w;
        } else {
            uint16_t *w = malloc(n * 2);
            for (size_t i = 0; i < n; i++) w[i] = dense == DF_DTYPE_BF16 ? to_bf16(0.1f * frand()) : to_f16(0.1f * frand());
            q->w = w;
        }
        q->L.wdtype = dense;
        q->L.w = q->w;
    }
    if (had) {
        q->signs = malloc((size_t)cols * 4);
        for (int i = 0; i < cols; i++) q->signs[i] = (urand() & 1) ? 1.0f : -1.0f;
        q->L.hadamard_block = had;
        q->L.signs = q->signs;
    }
}

static void free_linear(qlin *q) {
    free(q->w);
    free(q->s);
    free(q->b);
    free(q->signs);
}

/* y[M] rows == single rows, bitwise, on backend be; returns the M = 16 result (host). */
static float *linear_rows_exact(df_backend *be, const df_linear *L, const float *x, const char *what) {
    const int cols = L->cols, rows = L->rows, R = DF_MAX_ROWS;
    float *dx = dput(be, x, (size_t)R * (size_t)cols * 4);
    float *dy = be->ops->alloc(be, (size_t)R * (size_t)rows * 4), *dy1 = be->ops->alloc(be, (size_t)rows * 4);
    float *y = malloc((size_t)R * (size_t)rows * 4), *y1 = malloc((size_t)rows * 4);
    for (int M = 1; M <= R; M++) {
        be->ops->linear(be, L, dx, M, dy);
        dget(be, y, dy, (size_t)M * (size_t)rows * 4);
        for (int m = 0; m < M; m++) {
            be->ops->linear(be, L, dx + (size_t)m * (size_t)cols, 1, dy1);
            dget(be, y1, dy1, (size_t)rows * 4);
            if (memcmp(y1, y + (size_t)m * (size_t)rows, (size_t)rows * 4) != 0)
                fail_msg("%s: linear row %d of M = %d differs from the single-row result", what, m, M);
        }
    }
    gpu_ok(be, what);
    dfree_(be, dx);
    dfree_(be, dy);
    dfree_(be, dy1);
    free(y1);
    return y;
}

/* The fixed-point path applies to 2/4/8-bit weights in groups of 64 or 128 (cuda_backend.c). */
static int is_qpath(const df_linear *L) {
    return (L->bits == 2 || L->bits == 4 || L->bits == 8) && (L->group_size == 64 || L->group_size == 128);
}

/* A 16-bit scale or bias (F16 or BF16) as a float. */
static float h16_to_float(uint16_t h, df_dtype dt) {
    if (dt == DF_DTYPE_BF16) {
        const uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

/* Host model of the fixed-point linear for M rows of x (cuda_qlin.cu): per row the rotated
 * input x' (float32, as the backends compute it), per group E and X_i = rint(x'_i / 2^E), then
 * in double: yref = Σ_G s·D·2^E + b·S·2^E (what the kernel computes up to float32 rounding);
 * mag = Σ_G |s·D·2^E| + |b·S·2^E| (scale of that rounding); qerr = Σ_i |w_i|·|x'_i − X_i·2^E|
 * (the most the activation rounding can move y away from the float32 CPU result). */
static void q_model(const df_linear *L, const float *x, int M, double *yref, double *mag, double *qerr) {
    const int rows = L->rows, cols = L->cols, gs = L->group_size, bits = L->bits, ng = cols / gs;
    const uint32_t *w = L->w;
    const uint16_t *sc = L->scales, *bi = L->biases;
    const size_t wpr = (size_t)cols * (size_t)bits / 32;
    float *xr = malloc((size_t)cols * 4);
    double *xq = malloc((size_t)cols * sizeof(double)), *e2 = malloc((size_t)ng * sizeof(double));
    for (int m = 0; m < M; m++) {
        for (int i = 0; i < cols; i++) xr[i] = x[(size_t)m * cols + i] * (L->hadamard_block > 0 ? L->signs[i] : 1.0f);
        if (L->hadamard_block > 0) df_hadamard_inplace(xr, cols, L->hadamard_block);
        for (int g = 0; g < ng; g++) {
            float mx = 0.0f;
            for (int i = 0; i < gs; i++) mx = fmaxf(mx, fabsf(xr[g * gs + i]));
            int E = 0, ex;
            if (mx > 0.0f) {
                frexpf(mx, &ex);
                E = ex - 14;
            }
            e2[g] = ldexp(1.0, E);
            for (int i = 0; i < gs; i++) xq[g * gs + i] = (double)rintf(ldexpf(xr[g * gs + i], -E));
        }
        for (int r = 0; r < rows; r++) {
            double y = 0, a = 0, qe = 0;
            for (int g = 0; g < ng; g++) {
                double D = 0, S = 0;
                const double s = h16_to_float(sc[(size_t)r * ng + g], L->sdtype),
                             b = h16_to_float(bi[(size_t)r * ng + g], L->sdtype);
                for (int i = g * gs; i < (g + 1) * gs; i++) {
                    const size_t bit = (size_t)i * (size_t)bits;
                    const uint32_t q = (w[(size_t)r * wpr + bit / 32] >> (bit % 32)) & ((1u << bits) - 1u);
                    D += (double)q * xq[i];
                    S += xq[i];
                    qe += fabs(s * q + b) * fabs((double)xr[i] - xq[i] * e2[g]);
                }
                y += s * D * e2[g] + b * S * e2[g];
                a += fabs(s * D * e2[g]) + fabs(b * S * e2[g]);
            }
            yref[(size_t)m * rows + r] = y;
            mag[(size_t)m * rows + r] = a;
            qerr[(size_t)m * rows + r] = qe;
        }
    }
    free(xr);
    free(xq);
    free(e2);
}

/* GPU y (fixed-point path) against the model (float32 rounding: at most 4 roundings per group
 * (the kernel's D·2^E product and two fused multiply-adds) and one per group sum, relative 2^-24
 * each, on magnitudes <= mag) and against the CPU (the
 * activation rounding qerr plus the CPU's own float32 error, 2e-6 of the row scale). */
static void check_qpath(const df_linear *L, const float *x, int R, const float *y, const float *ycpu,
                        const char *what) {
    const int rows = L->rows, ng = L->cols / L->group_size;
    double *yref = malloc((size_t)R * rows * sizeof(double)), *mag = malloc((size_t)R * rows * sizeof(double));
    double *qerr = malloc((size_t)R * rows * sizeof(double));
    q_model(L, x, R, yref, mag, qerr);
    double worst_model = 0, worst_cpu = 0, ymax = 1e-3;
    for (size_t i = 0; i < (size_t)R * rows; i++)
        if (fabs((double)ycpu[i]) > ymax) ymax = fabs((double)ycpu[i]);
    for (size_t i = 0; i < (size_t)R * rows; i++) {
        const double tol_model = (5.0 * ng + 8.0) * ldexp(1.0, -24) * mag[i] + 1e-30;
        const double dm = fabs((double)y[i] - yref[i]), dc = fabs((double)y[i] - (double)ycpu[i]);
        if (!(dm <= tol_model))
            fail_msg("%s: output %zu = %.9g, the fixed-point model gives %.9g (tolerance %.3g)", what, i, (double)y[i],
                     yref[i], tol_model);
        if (!(dc <= qerr[i] + 2e-6 * ymax))
            fail_msg("%s: output %zu = %.9g, CPU %.9g: |delta| %.3g above the activation rounding bound %.3g", what,
                     i, (double)y[i], (double)ycpu[i], dc, qerr[i] + 2e-6 * ymax);
        if (dm / (mag[i] + 1e-30) > worst_model) worst_model = dm / (mag[i] + 1e-30);
        if (dc / ymax > worst_cpu) worst_cpu = dc / ymax;
    }
    printf("linear %-36s fixed point: vs model %.2e of magnitude, vs CPU %.2e relative\n", what, worst_model,
           worst_cpu);
    free(yref);
    free(mag);
    free(qerr);
}

static void test_linear(void **state) {
    (void)state;
    NEED_GPU();
    struct {
        int rows, cols, bits, gs, had;
        df_dtype dense;
        int ternary;
        const char *name;
    } cases[] = {
        {40, 256, 2, 128, 256, 0, 1, "2-bit g128 H256 ternary"},
        {33, 512, 2, 128, 128, 0, 0, "2-bit g128 H128"},
        {70, 5120, 2, 128, 1024, 0, 1, "2-bit g128 H1024 (27B-like)"},
        {24, 128, 4, 64, 0, 0, 0, "4-bit g64"},
        {20, 256, 4, 128, 0, 0, 0, "4-bit g128"},
        {17, 256, 8, 64, 0, 0, 0, "8-bit g64"},
        {18, 256, 2, 64, 0, 0, 0, "2-bit g64"},
        {20, 192, 3, 32, 0, 0, 0, "3-bit g32 (CUDA cores)"},
        {9, 320, 5, 32, 0, 0, 0, "5-bit g32 (CUDA cores)"},
        {12, 384, 6, 64, 0, 0, 0, "6-bit g64 (CUDA cores)"},
        {8, 256, 0, 0, 0, DF_DTYPE_F16, 0, "dense f16 (CUDA cores)"},
        {8, 200, 0, 0, 0, DF_DTYPE_BF16, 0, "dense bf16 cols 200 (CUDA cores)"},
        {37, 320, 0, 0, 0, DF_DTYPE_BF16, 0, "dense bf16 (tensor cores)"},
        {5, 130, 0, 0, 0, DF_DTYPE_F32, 0, "dense f32 (CUDA cores)"},
        {600, 768, 2, 128, 256, 0, 1, "2-bit 600 rows (several K slices)"},
        {40, 17408, 2, 128, 1024, 0, 1, "2-bit cols 17408 H1024 (down_proj)"},
        {48, 5120, 0, 0, 0, DF_DTYPE_F16, 0, "dense f16 48 x 5120 (in_proj_a)"},
        {36, 1024, 8, 128, 0, 0, 0, "8-bit g128"},
        {44, 512, 4, 128, 512, 0, 0, "4-bit g128 H512"},
        {2000, 640, 2, 128, 128, 0, 1, "2-bit 2000 rows (many units)"},
        {56, 1024, 2, 128, 1024, 0, 2, "2-bit ternary bf16 scales"},
        {24, 512, 2, 64, 0, 0, 1, "2-bit g64 ternary"},
        {40, 512, 2, 128, 512, 0, 3, "2-bit ternary but one bias"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        qlin q;
        make_linear(&q, cases[c].rows, cases[c].cols, cases[c].bits, cases[c].gs, cases[c].had, cases[c].dense,
                    cases[c].ternary);
        const int R = DF_MAX_ROWS, cols = cases[c].cols, rows = cases[c].rows;
        float *x = malloc((size_t)R * (size_t)cols * 4);
        for (int i = 0; i < R * cols; i++) x[i] = frand();
        float *y = linear_rows_exact(g_gpu, &q.L, x, cases[c].name);
        /* ternary weights are stored as their scales alone (test_scales_only): the same bits as
         * with their biases */
        float *yaff = linear_rows_exact(g_gpu_affine, &q.L, x, cases[c].name);
        if (memcmp(y, yaff, (size_t)R * (size_t)rows * 4) != 0)
            fail_msg("%s: the weight stored with its biases gives other bits", cases[c].name);
        free(yaff);
        /* more tiles per warp: same bits */
        float *ytr = linear_rows_exact(g_gpu_tr, &q.L, x, cases[c].name);
        if (memcmp(y, ytr, (size_t)R * (size_t)rows * 4) != 0)
            fail_msg("%s: result depends on the tiles per warp", cases[c].name);
        /* the register kernel and the persistent ring: same bits */
        float *yreg = linear_rows_exact(g_gpu_reg, &q.L, x, cases[c].name);
        float *ype = linear_rows_exact(g_gpu_persist, &q.L, x, cases[c].name);
        float *ycp = linear_rows_exact(g_gpu_cp, &q.L, x, cases[c].name);
        float *yb8 = linear_rows_exact(g_gpu_b8, &q.L, x, cases[c].name);
        if (memcmp(y, yreg, (size_t)R * (size_t)rows * 4) != 0)
            fail_msg("%s: the ring kernel and the register kernel differ", cases[c].name);
        if (memcmp(y, ype, (size_t)R * (size_t)rows * 4) != 0)
            fail_msg("%s: the ring kernel on 7 CTAs differs", cases[c].name);
        if (memcmp(y, ycp, (size_t)R * (size_t)rows * 4) != 0)
            fail_msg("%s: the ring fed by bulk copies and the ring fed per lane differ", cases[c].name);
        if (memcmp(y, yb8, (size_t)R * (size_t)rows * 4) != 0)
            fail_msg("%s: bulk copies up to 8 rows differ", cases[c].name);
        free(yb8);
        free(yreg);
        free(ype);
        free(ycp);
        /* CPU reference and the CUDA-core path */
        float *ycpu = malloc((size_t)R * (size_t)rows * 4);
        g_cpu->ops->linear(g_cpu, &q.L, x, R, ycpu);
        float *ys = linear_rows_exact(g_gpu_simple, &q.L, x, cases[c].name);
        double e1 = rel_err(y, ycpu, (size_t)R * (size_t)rows, 1e-3), e2 = rel_err(ys, ycpu, (size_t)R * (size_t)rows, 1e-3);
        printf("linear %-36s rows %4d cols %5d: rel err vs CPU %.2e (CUDA cores %.2e)\n", cases[c].name, rows, cols, e1,
               e2);
        if (is_qpath(&q.L)) check_qpath(&q.L, x, R, y, ycpu, cases[c].name);
        else if (!(e1 <= 2e-5)) fail_msg("%s: GPU linear differs from the CPU", cases[c].name);
        if (!(e2 <= 2e-5)) fail_msg("%s: GPU CUDA-core linear differs from the CPU", cases[c].name);
        free(y);
        free(ytr);
        free(ys);
        free(ycpu);
        free(x);
        free_linear(&q);
    }
}

/* A 2-bit weight whose biases are its scales negated, bit for bit, is stored as its scales
 * alone, 32 bytes fewer per 16 rows and group (and the one whose biases differ in a single
 * bit is not), in backends of their own (weight_bytes of nothing else). test_linear checks the
 * bits of every kernel against the weight stored with its biases. */
static void test_scales_only(void **state) {
    (void)state;
    NEED_GPU();
#ifdef DFLASH_WITH_CUDA /* df_backend_cuda_stats */
    struct {
        int ternary, rows, cols, gs;
    } cases[] = {{1, 70, 1024, 128}, {2, 33, 512, 64}, {3, 40, 512, 128}, {0, 40, 512, 128}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        qlin q;
        make_linear(&q, cases[c].rows, cases[c].cols, 2, cases[c].gs, 0, 0, cases[c].ternary);
        size_t bytes[2];
        for (int k = 0; k < 2; k++) {
            if (k == 1) setenv("DFLASH_CUDA_QSCALES", "0", 1);
            df_backend *be = NULL;
            df_error err = {0};
            assert_int_equal(df_backend_cuda_create(&be, 0, &err), DF_OK);
            unsetenv("DFLASH_CUDA_QSCALES");
            float *x = calloc((size_t)cases[c].cols, 4), *dx = dput(be, x, (size_t)cases[c].cols * 4);
            float *dy = be->ops->alloc(be, (size_t)cases[c].rows * 4);
            be->ops->linear(be, &q.L, dx, 1, dy);
            gpu_ok(be, "scales only");
            df_cuda_stats st;
            df_backend_cuda_stats(be, &st);
            bytes[k] = st.weight_bytes;
            dfree_(be, dx);
            dfree_(be, dy);
            free(x);
            be->ops->destroy(be);
        }
        const size_t want = cases[c].ternary == 1 || cases[c].ternary == 2
                                ? (size_t)((cases[c].rows + 15) / 16) * (size_t)(cases[c].cols / cases[c].gs) * 32
                                : 0;
        if (bytes[1] - bytes[0] != want)
            fail_msg("scales only, case %zu: %zu bytes saved, expected %zu", c, bytes[1] - bytes[0], want);
        free_linear(&q);
    }
#endif
}

/* The weight table notices a host buffer reused for different data at the same address. */
static void test_weight_reupload(void **state) {
    (void)state;
    NEED_GPU();
    qlin q;
    make_linear(&q, 32, 256, 2, 128, 0, 0, 0);
    const int cols = 256, rows = 32;
    float x[256], y[32], yc[32];
    for (int i = 0; i < cols; i++) x[i] = frand();
    float *dx = dput(g_gpu, x, sizeof x), *dy = g_gpu->ops->alloc(g_gpu, sizeof y);
    for (int round = 0; round < 2; round++) {
        uint32_t *w = q.w;
        for (int i = 0; i < rows * cols * 2 / 32; i++) w[i] = urand(); /* same pointer, new codes */
        g_gpu->ops->linear(g_gpu, &q.L, dx, 1, dy);
        dget(g_gpu, y, dy, sizeof y);
        g_cpu->ops->linear(g_cpu, &q.L, x, 1, yc);
        check_qpath(&q.L, x, 1, y, yc, "reupload"); /* the stale codes would miss both bounds */
    }
    gpu_ok(g_gpu, "reupload");
    dfree_(g_gpu, dx);
    dfree_(g_gpu, dy);
    free_linear(&q);
}

/* A host range declared constant (host_const): its weights are taken by pointer and shape,
 * not checked (new codes at the same pointer keep the first upload's results, bit for bit);
 * once the range is dropped, the next use uploads the new codes. */
static void test_weight_const_range(void **state) {
    (void)state;
    NEED_GPU();
    qlin q;
    make_linear(&q, 32, 256, 2, 128, 0, 0, 0);
    const int cols = 256, rows = 32;
    const size_t wbytes = (size_t)rows * cols * 2 / 8;
    float x[256], y0[32], y1[32], yc[32];
    for (int i = 0; i < cols; i++) x[i] = frand();
    float *dx = dput(g_gpu, x, sizeof x), *dy = g_gpu->ops->alloc(g_gpu, sizeof y0);
    uint32_t *w = q.w;
    assert_non_null(g_gpu->ops->host_const);
    g_gpu->ops->host_const(g_gpu, w, wbytes, 1);
    g_gpu->ops->linear(g_gpu, &q.L, dx, 1, dy);
    dget(g_gpu, y0, dy, sizeof y0);
    g_cpu->ops->linear(g_cpu, &q.L, x, 1, yc);
    check_qpath(&q.L, x, 1, y0, yc, "constant range, first upload");
    for (int i = 0; i < rows * cols * 2 / 32; i++) w[i] = urand(); /* breaks the promise, to see it kept */
    g_gpu->ops->linear(g_gpu, &q.L, dx, 1, dy);
    dget(g_gpu, y1, dy, sizeof y1);
    if (memcmp(y0, y1, sizeof y0) != 0) fail_msg("constant range: the weight was read again");
    g_gpu->ops->host_const(g_gpu, w, 0, 0);
    g_gpu->ops->linear(g_gpu, &q.L, dx, 1, dy);
    dget(g_gpu, y1, dy, sizeof y1);
    g_cpu->ops->linear(g_cpu, &q.L, x, 1, yc);
    check_qpath(&q.L, x, 1, y1, yc, "constant range dropped: new codes");
    gpu_ok(g_gpu, "constant range");
    dfree_(g_gpu, dx);
    dfree_(g_gpu, dy);
    free_linear(&q);
}

/* ---- rmsnorm, add, swiglu, argmax ------------------------------------------------------------------ */

static void test_elementwise(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    const int W = 5120, R = DF_MAX_ROWS;
    float *x = malloc((size_t)R * W * 4), *w = malloc(W * 4), *y = malloc((size_t)R * W * 4), *y1 = malloc(W * 4);
    float *yc = malloc((size_t)R * W * 4), *u = malloc((size_t)R * W * 4);
    for (int i = 0; i < R * W; i++) {
        x[i] = 3.0f * frand();
        u[i] = frand();
    }
    for (int i = 0; i < W; i++) w[i] = 1.0f + frand();
    float *dx = dput(be, x, (size_t)R * W * 4), *dy = be->ops->alloc(be, (size_t)R * W * 4), *d1 = be->ops->alloc(be, W * 4);
    for (int M = 1; M <= R; M++) {
        be->ops->rmsnorm(be, dx, w, M, W, 1e-6f, dy);
        dget(be, y, dy, (size_t)M * W * 4);
        for (int m = 0; m < M; m++) {
            be->ops->rmsnorm(be, dx + (size_t)m * W, w, 1, W, 1e-6f, d1);
            dget(be, y1, d1, W * 4);
            if (memcmp(y1, y + (size_t)m * W, W * 4) != 0) fail_msg("rmsnorm row %d of M = %d differs", m, M);
        }
    }
    g_cpu->ops->rmsnorm(g_cpu, x, w, R, W, 1e-6f, yc);
    double e = rel_err(y, yc, (size_t)R * W, 1.0);
    printf("rmsnorm: rel err vs CPU %.2e\n", e);
    assert_true(e <= 1e-5);
    /* swiglu and add */
    float *du = dput(be, u, (size_t)R * W * 4);
    be->ops->swiglu(be, dx, du, (size_t)R * W, dy);
    dget(be, y, dy, (size_t)R * W * 4);
    g_cpu->ops->swiglu(g_cpu, x, u, (size_t)R * W, yc);
    e = rel_err(y, yc, (size_t)R * W, 1.0);
    printf("swiglu: rel err vs CPU %.2e\n", e);
    assert_true(e <= 1e-6);
    be->ops->add(be, dy, du, (size_t)R * W);
    dget(be, y, dy, (size_t)R * W * 4);
    g_cpu->ops->add(g_cpu, yc, u, (size_t)R * W);
    e = rel_err(y, yc, (size_t)R * W, 1.0);
    assert_true(e <= 1e-6);
    /* argmax with ties (lowest index wins) and a big width */
    const int V = 248320;
    float *lg = malloc((size_t)4 * V * 4);
    for (int i = 0; i < 4 * V; i++) lg[i] = frand();
    lg[0 * V + 1000] = 5.0f;
    lg[0 * V + 200000] = 5.0f;
    lg[1 * V + V - 1] = 7.0f;
    lg[2 * V + 0] = 9.0f;
    float *dl = dput(be, lg, (size_t)4 * V * 4);
    int32_t ig[4], ic[4];
    be->ops->argmax(be, dl, 4, V, ig);
    g_cpu->ops->argmax(g_cpu, lg, 4, V, ic);
    assert_memory_equal(ig, ic, sizeof ig);
    assert_int_equal(ig[0], 1000);
    assert_int_equal(ig[1], V - 1);
    assert_int_equal(ig[2], 0);
    /* more rows than a verify pass (the one-block-per-row kernel), ties included */
    {
        const int RR = DF_MAX_ROWS + 4, VV = 3000;
        float *l2 = malloc((size_t)RR * VV * 4);
        for (int i = 0; i < RR * VV; i++) l2[i] = frand();
        for (int r = 0; r < RR; r++) l2[(size_t)r * VV + (size_t)(r * 97) % VV] = l2[(size_t)r * VV + VV - 1] = 3.0f;
        float *d2 = dput(be, l2, (size_t)RR * VV * 4);
        int32_t g2[DF_MAX_ROWS + 4], c2[DF_MAX_ROWS + 4];
        be->ops->argmax(be, d2, RR, VV, g2);
        g_cpu->ops->argmax(g_cpu, l2, RR, VV, c2);
        assert_memory_equal(g2, c2, sizeof g2);
        for (int r = 0; r < RR; r++) assert_int_equal(g2[r], (r * 97) % VV);
        dfree_(be, d2);
        free(l2);
    }
    /* non-finite rows give -1 (as the CPU): a NaN anywhere (first, middle, last), an infinite
     * maximum, every logit -inf; one -inf among finite logits is fine; both kernels */
    for (int wide = 0; wide < 2; wide++) {
        const int RR = 7, VV = wide ? V : 3000;
        float *l3 = malloc((size_t)RR * VV * 4);
        for (size_t i = 0; i < (size_t)RR * VV; i++) l3[i] = frand();
        l3[(size_t)0 * VV + 0] = NAN;
        l3[(size_t)1 * VV + VV / 2 + 3] = NAN;
        l3[(size_t)2 * VV + VV - 1] = NAN;
        l3[(size_t)3 * VV + 17] = INFINITY;
        for (int i = 0; i < VV; i++) l3[(size_t)4 * VV + i] = -INFINITY;
        l3[(size_t)5 * VV + 5] = -INFINITY;
        l3[(size_t)6 * VV + 1] = NAN;
        l3[(size_t)6 * VV + 2] = 100.0f;
        float *d3 = dput(be, l3, (size_t)RR * VV * 4);
        int32_t g3[7], c3[7];
        be->ops->argmax(be, d3, RR, VV, g3);
        g_cpu->ops->argmax(g_cpu, l3, RR, VV, c3);
        assert_memory_equal(g3, c3, sizeof g3);
        for (int r = 0; r < RR; r++) assert_int_equal(g3[r] < 0, r != 5);
        dfree_(be, d3);
        free(l3);
    }
    gpu_ok(be, "elementwise");
    dfree_(be, dl);
    dfree_(be, dx);
    dfree_(be, dy);
    dfree_(be, d1);
    dfree_(be, du);
    free(lg);
    free(x);
    free(w);
    free(y);
    free(y1);
    free(yc);
    free(u);
}

/* ---- embedding ------------------------------------------------------------------------------------- */

static void test_embed(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    struct {
        int bits, gs, had;
        df_dtype dense;
    } cases[] = {{2, 128, 1024, 0}, {2, 128, 0, 0}, {4, 64, 256, 0}, {0, 0, 0, DF_DTYPE_F16}, {0, 0, 512, DF_DTYPE_BF16}};
    const int rows = 300, cols = 5120, R = DF_MAX_ROWS;
    int32_t ids[DF_MAX_ROWS];
    for (int m = 0; m < R; m++) ids[m] = (int32_t)((m * 37 + 5) % rows);
    ids[3] = rows + 7; /* out of range: zeros */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        qlin q;
        make_linear(&q, rows, cols, cases[c].bits, cases[c].gs, cases[c].had, cases[c].dense, cases[c].bits == 2);
        float *y = malloc((size_t)R * cols * 4), *y1 = malloc((size_t)cols * 4), *yc = malloc((size_t)R * cols * 4);
        float *dy = be->ops->alloc(be, (size_t)R * cols * 4), *d1 = be->ops->alloc(be, (size_t)cols * 4);
        be->ops->embed(be, &q.L, ids, R, dy);
        dget(be, y, dy, (size_t)R * cols * 4);
        for (int m = 0; m < R; m++) {
            be->ops->embed(be, &q.L, ids + m, 1, d1);
            dget(be, y1, d1, (size_t)cols * 4);
            if (memcmp(y1, y + (size_t)m * cols, (size_t)cols * 4) != 0) fail_msg("embed case %zu row %d differs", c, m);
        }
        g_cpu->ops->embed(g_cpu, &q.L, ids, R, yc);
        double e = rel_err(y, yc, (size_t)R * cols, 1e-3);
        printf("embed case %zu (bits %d, H %d): rel err vs CPU %.2e\n", c, cases[c].bits, cases[c].had, e);
        assert_true(e <= 2e-3); /* fp16 rounding of the rotated row may differ by one fp16 ulp */
        for (int i = 0; i < cols; i++) assert_true(y[3 * cols + i] == 0.0f);
        gpu_ok(be, "embed");
        dfree_(be, dy);
        dfree_(be, d1);
        free(y);
        free(y1);
        free(yc);
        free_linear(&q);
    }
}

/* Host data staged into a step (to_device) reaches the device at each run of the step, also
 * when the step repeats and runs as a replayed graph: copies of 4 bytes to 64 KB, five rounds
 * of the same commands with new data each round. */
static void test_staged_copies_replayed(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    const size_t sizes[] = {4, 12, 64, 256, 1024, 4096, 65536};
    int bad = 0;
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        const size_t n = sizes[k] / 4;
        float *v = malloc(n * 4), *got = malloc(n * 4), *d = be->ops->alloc(be, n * 4), *e = be->ops->alloc(be, n * 4);
        for (int r = 0; r < 5; r++) {
            for (size_t i = 0; i < n; i++) v[i] = (float)(r * 1000 + (int)i);
            be->ops->zero(be, e, n * 4);
            be->ops->to_device(be, d, v, n * 4);
            be->ops->add(be, e, d, n);
            dget(be, got, e, n * 4);
            if (memcmp(got, v, n * 4) != 0) {
                printf("staged copy of %zu bytes, round %d: got %g, want %g\n", sizes[k], r, (double)got[0], (double)v[0]);
                bad++;
            }
        }
        dfree_(be, d);
        dfree_(be, e);
        free(v);
        free(got);
    }
    gpu_ok(be, "staged copies");
    assert_int_equal(bad, 0);
}

/* Ids kept on the device: argmax_dev == argmax with `bad` for the non-finite rows, embed_dev ==
 * embed with the same ids from the host; and steps started by `submit` (the speculative round's
 * drafter pass queued before its verify is recorded): six rounds of three steps, each staging
 * new host data and reading the previous step's ids on the device, give the bits of the same
 * ops run without submit (the rounds repeat, so the steps are captured as graphs and replayed
 * with both pinned buffer pairs). */
/* top_k on the GPU == df_top_k_host (the CPU backend's): ids and values, for k = 1..64, widths
 * from 1 to the vocabulary's and beyond the kernels' limit (the host fallback), rows with many
 * ties (signed zeros among them), -inf entries, and a NaN (ids[0] = -1). */
static void test_top_k_gpu(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    const int widths[6] = {1, 70, 3000, 65536, 248320, 300000};
    const int ks[5] = {1, 5, 20, 40, 64};
    int32_t gi[64], ci[64];
    float gv[64], cv[64];
    for (int w = 0; w < 6; w++) {
        const int W = widths[w];
        float *x = malloc((size_t)W * 4);
        for (int variant = 0; variant < 3; variant++) {
            for (int i = 0; i < W; i++) {
                x[i] = variant == 1 ? (float)(int)(frand() * 8.0f) : frand(); /* variant 1: mostly ties */
                if (variant == 2 && i % 13 == 0) x[i] = -INFINITY;
                if (variant == 1 && i % 7 == 0) x[i] = i % 14 ? -0.0f : 0.0f; /* signed zeros tie */
            }
            if (variant == 2 && W > 100) x[W / 3] = NAN;
            float *dx = dput(be, x, (size_t)W * 4);
            for (int kk = 0; kk < 5; kk++) {
                const int k = ks[kk] < W ? ks[kk] : W;
                be->ops->top_k(be, dx, W, k, gi, gv);
                df_top_k_host(x, W, k, ci, cv);
                gpu_ok(be, "top_k");
                if (ci[0] < 0) {
                    assert_int_equal(gi[0], -1);
                    continue;
                }
                if (memcmp(gi, ci, (size_t)k * 4) != 0 || memcmp(gv, cv, (size_t)k * 4) != 0)
                    fail_msg("top_k: width %d, k %d, variant %d: GPU list differs from the CPU's", W, k, variant);
            }
            /* sample_top_dev: the token the host draws from its list (df_sample_top_list), for
             * several filters and random bits, steps of the same commands replayed with new bits */
            const df_top_draw draws[4] = {{20, 1.0f, 1.0f, 0.0f}, {64, 0.7f, 0.9f, 0.0f}, {5, 1.5f, 1.0f, 0.1f},
                                          {40, 1e-40f, 0.5f, 0.05f}};
            int32_t *dout = be->ops->alloc(be, sizeof(int32_t));
            for (int di = 0; di < 4; di++) {
                df_top_draw d = draws[di];
                if (d.k > W) d.k = W;
                df_top_k_host(x, W, d.k, ci, cv);
                for (int r = 0; r < 6; r++) {
                    const uint64_t u = r == 0 ? 0 : r == 1 ? (1ull << 53) - 1 : ((uint64_t)urand() << 21) ^ urand();
                    int32_t got = -2;
                    be->ops->sample_top_dev(be, dx, W, &d, u, dout);
                    be->ops->to_host(be, &got, dout, sizeof got);
                    gpu_ok(be, "sample_top_dev");
                    const int32_t want = ci[0] < 0 || !isfinite(cv[0]) ? -1 : df_sample_top_list(ci, cv, d.k, &d, u);
                    if (got != want)
                        fail_msg("sample_top_dev: width %d, variant %d, draw %d, bits %llu: GPU %d, CPU %d", W, variant,
                                 di, (unsigned long long)u, got, want);
                }
            }
            be->ops->dealloc(be, dout);
            dfree_(be, dx);
        }
        free(x);
    }
}

/* read_ahead in the greedy loop's pattern: step t embeds token t - 1 (in backend memory) and
 * writes token t = the argmax of that row, with a long add in between; step t + 1 is recorded
 * and submitted before token t is read with read_ahead. The tokens equal those of the same
 * steps run one at a time (to_host after each). */
static void test_read_ahead_chain(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    const int V = 3000, cols = 1024, T = 24;
    const size_t nbig = (size_t)4 << 20;
    qlin q;
    make_linear(&q, V, cols, 2, 128, 1024, 0, 1);
    int32_t *dd = be->ops->alloc(be, 2 * sizeof(int32_t));
    float *row = be->ops->alloc(be, (size_t)cols * 4), *big = be->ops->alloc(be, nbig * 4);
    float *one = malloc(nbig * 4);
    for (size_t i = 0; i < nbig; i++) one[i] = 1.0f;
    float *done = dput(be, one, nbig * 4);
    int32_t want[24], got[24];
    for (int mode = 0; mode < 2; mode++) {
        int32_t *out = mode ? got : want, first = 17;
        be->ops->to_device(be, dd, &first, sizeof first);
        for (int t = 1; t <= T; t++) {
            int32_t *cur = dd + ((t - 1) & 1), *nxt = dd + (t & 1);
            if (mode == 0 || t == 1) { /* step t */
                be->ops->embed_dev(be, &q.L, cur, 1, row);
                be->ops->add(be, big, done, nbig);
                be->ops->argmax_dev(be, row, 1, cols, nxt, 0);
                if (mode == 0) {
                    be->ops->to_host(be, &out[t - 1], nxt, sizeof(int32_t));
                    continue;
                }
                be->ops->submit(be);
            }
            if (t < T) { /* step t + 1, queued behind step t, fed with its token */
                be->ops->embed_dev(be, &q.L, nxt, 1, row);
                be->ops->add(be, big, done, nbig);
                be->ops->argmax_dev(be, row, 1, cols, cur, 0);
                be->ops->submit(be);
                be->ops->read_ahead(be, &out[t - 1], nxt, sizeof(int32_t));
            } else {
                be->ops->to_host(be, &out[t - 1], nxt, sizeof(int32_t));
            }
        }
        gpu_ok(be, "read_ahead chain");
    }
    int changes = 0;
    for (int t = 1; t < T; t++) changes += want[t] != want[t - 1];
    assert_true(changes > 0);
    if (memcmp(want, got, sizeof want) != 0) fail_msg("tokens read ahead differ from the same steps one at a time");
    free(one);
    dfree_(be, done);
    dfree_(be, big);
    dfree_(be, row);
    dfree_(be, dd);
    free_linear(&q);
}

static void test_ids_on_device(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    const int R = 6, V = 3000, cols = 1024;
    float *lg = malloc((size_t)R * V * 4);
    for (int i = 0; i < R * V; i++) lg[i] = frand();
    lg[(size_t)1 * V + 7] = NAN;
    lg[(size_t)4 * V + 9] = INFINITY;
    float *dl = dput(be, lg, (size_t)R * V * 4);
    int32_t *di = be->ops->alloc(be, 2 * DF_MAX_ROWS * sizeof(int32_t));
    int32_t host[DF_MAX_ROWS], got[DF_MAX_ROWS];
    g_cpu->ops->argmax(g_cpu, lg, R, V, host);
    for (int bad = -1; bad <= 0; bad++) {
        be->ops->argmax_dev(be, dl, R, V, di, bad);
        dget(be, got, di, (size_t)R * 4);
        for (int r = 0; r < R; r++) assert_int_equal(got[r], host[r] < 0 ? bad : host[r]);
    }
    assert_true(host[1] < 0 && host[4] < 0 && host[0] >= 0);
    qlin q;
    make_linear(&q, V, cols, 2, 128, 1024, 0, 1);
    int32_t ids[DF_MAX_ROWS] = {5, V - 1, 0, V + 3, 77, 1234};
    float *e1 = malloc((size_t)R * cols * 4), *e2 = malloc((size_t)R * cols * 4);
    float *de = be->ops->alloc(be, (size_t)R * cols * 4);
    be->ops->embed(be, &q.L, ids, R, de);
    dget(be, e1, de, (size_t)R * cols * 4);
    be->ops->to_device(be, di, ids, (size_t)R * 4);
    be->ops->embed_dev(be, &q.L, di, R, de);
    dget(be, e2, de, (size_t)R * cols * 4);
    if (memcmp(e1, e2, (size_t)R * cols * 4) != 0) fail_msg("embed_dev differs from embed");
    /* rounds with and without submit */
    const size_t nx = (size_t)R * V, nz = (size_t)R * cols;
    float *vx = malloc(nx * 4), *vz = malloc(nz * 4), *z[2];
    const uint64_t rs = rng_state;
    for (int mode = 0; mode < 2; mode++) {
        rng_state = rs; /* the same data in both modes */
        float *dx = be->ops->alloc(be, nx * 4), *dy = be->ops->alloc(be, nx * 4);
        float *dz = be->ops->alloc(be, nz * 4), *dw = be->ops->alloc(be, nz * 4);
        int32_t *dd = be->ops->alloc(be, DF_MAX_ROWS * sizeof(int32_t));
        z[mode] = malloc(6 * nz * 4);
        for (int r = 0; r < 6; r++) {
            for (size_t i = 0; i < nx; i++) vx[i] = frand();
            for (size_t i = 0; i < nz; i++) vz[i] = (float)(r + 1) * frand();
            be->ops->to_device(be, dx, vx, nx * 4);
            be->ops->add(be, dy, dx, nx);
            be->ops->argmax_dev(be, dy, R, V, dd, 0);
            if (mode) be->ops->submit(be);
            be->ops->embed_dev(be, &q.L, dd, R, dz);
            be->ops->to_device(be, dw, vz, nz * 4);
            be->ops->add(be, dz, dw, nz);
            if (mode) be->ops->submit(be);
            for (size_t i = 0; i < nz; i++) vz[i] = -frand();
            be->ops->to_device(be, dw, vz, nz * 4);
            be->ops->add(be, dz, dw, nz);
            dget(be, z[mode] + (size_t)r * nz, dz, nz * 4);
        }
        gpu_ok(be, "submitted steps");
        dfree_(be, dx);
        dfree_(be, dy);
        dfree_(be, dz);
        dfree_(be, dw);
        dfree_(be, dd);
    }
    if (memcmp(z[0], z[1], 6 * nz * 4) != 0) fail_msg("steps run with submit differ from the same ops without it");
    gpu_ok(be, "ids on the device");
    free(z[0]);
    free(z[1]);
    free(vx);
    free(vz);
    free(e1);
    free(e2);
    free(lg);
    dfree_(be, dl);
    dfree_(be, di);
    dfree_(be, de);
    free_linear(&q);
}

/* Tensor-core linears of one input recorded in one step share one input preparation (the
 * backend skips a repeated identical one): their outputs == each linear alone in its own step,
 * bit for bit; and a linear that writes into its input's range in between stops the sharing. */
static void test_prep_shared(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    const int cols = 320, M = 5, rows[3] = {40, 24, 320};
    qlin q[3];
    for (int i = 0; i < 3; i++) make_linear(&q[i], rows[i], cols, 0, 0, 0, DF_DTYPE_BF16, 0);
    float *x = malloc((size_t)M * cols * 4), *ya = malloc((size_t)M * cols * 4), *yb = malloc((size_t)M * cols * 4);
    for (int i = 0; i < M * cols; i++) x[i] = frand();
    float *dx = dput(be, x, (size_t)M * cols * 4), *dy[3];
    for (int i = 0; i < 3; i++) dy[i] = be->ops->alloc(be, (size_t)M * rows[i] * 4);
    /* one step: W0·x, W1·x (shared preparation), then W2·x written over x itself, then W0·x again (x
     * changed: a new preparation) */
    be->ops->linear(be, &q[0].L, dx, M, dy[0]);
    be->ops->linear(be, &q[1].L, dx, M, dy[1]);
    be->ops->linear(be, &q[2].L, dx, M, dx); /* in place: reads only its prepared input */
    be->ops->linear(be, &q[0].L, dx, M, dy[2]);
    float *got[3];
    for (int i = 0; i < 3; i++) {
        got[i] = malloc((size_t)M * cols * 4);
        dget(be, got[i], dy[i], (size_t)M * rows[i] * 4);
    }
    /* each alone */
    be->ops->to_device(be, dx, x, (size_t)M * cols * 4);
    for (int i = 0; i < 2; i++) {
        be->ops->linear(be, &q[i].L, dx, M, dy[i]);
        dget(be, ya, dy[i], (size_t)M * rows[i] * 4);
        if (memcmp(ya, got[i], (size_t)M * rows[i] * 4) != 0) fail_msg("linear %d with a shared preparation differs", i);
    }
    be->ops->linear(be, &q[2].L, dx, M, dy[2]);
    dget(be, ya, dy[2], (size_t)M * cols * 4);
    be->ops->to_device(be, dx, ya, (size_t)M * cols * 4);
    be->ops->linear(be, &q[0].L, dx, M, dy[2]);
    dget(be, yb, dy[2], (size_t)M * rows[0] * 4);
    if (memcmp(yb, got[2], (size_t)M * rows[0] * 4) != 0) fail_msg("linear after its input changed differs");
    gpu_ok(be, "shared preparation");
    printf("tensor-core linears sharing one input preparation == alone; input rewritten in between: prepared again\n");
    for (int i = 0; i < 3; i++) {
        dfree_(be, dy[i]);
        free(got[i]);
        free_linear(&q[i]);
    }
    dfree_(be, dx);
    free(x);
    free(ya);
    free(yb);
}

/* copy_rows on the device == the host's row loop: 16 rows of a tap (5120 floats) into their
 * columns of a [16, 5·5120] buffer, nothing else touched. */
static void test_copy_rows_gpu(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    const size_t H = 5120, F = 5 * H, R = DF_MAX_ROWS;
    float *src = malloc(R * H * 4), *dst = malloc(R * F * 4), *got = malloc(R * F * 4);
    for (size_t i = 0; i < R * H; i++) src[i] = (float)i;
    for (size_t i = 0; i < R * F; i++) dst[i] = -1.0f;
    float *ds = dput(be, src, R * H * 4), *dd = dput(be, dst, R * F * 4);
    be->ops->copy_rows(be, dd + 3 * H, F * 4, ds, H * 4, H * 4, (int)R);
    dget(be, got, dd, R * F * 4);
    gpu_ok(be, "copy_rows");
    for (size_t r = 0; r < R; r++) memcpy(dst + r * F + 3 * H, src + r * H, H * 4);
    if (memcmp(got, dst, R * F * 4) != 0) fail_msg("copy_rows on the device differs from the row loop");
    dfree_(be, ds);
    dfree_(be, dd);
    free(src);
    free(dst);
    free(got);
}

/* copy has memmove semantics on the device too: overlapping ranges in both directions (the
 * drafter shifts its KV cache down in place once its window is full), and a disjoint copy. */
static void test_copy_overlap(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    const size_t n = 1 << 20, shifts[] = {4, 4096, 300000};
    float *h = malloc(n * 4), *ref = malloc(n * 4), *got = malloc(n * 4);
    for (size_t i = 0; i < n; i++) h[i] = (float)i;
    float *d = dput(be, h, n * 4);
    for (size_t k = 0; k < 3; k++) {
        for (int dir = 0; dir < 2; dir++) {
            const size_t sh = shifts[k], len = n - sh;
            memcpy(ref, h, n * 4);
            be->ops->to_device(be, d, h, n * 4);
            if (dir == 0) { /* down: dst < src */
                memmove(ref, ref + sh, len * 4);
                be->ops->copy(be, d, d + sh, len * 4);
            } else {
                memmove(ref + sh, ref, len * 4);
                be->ops->copy(be, d + sh, d, len * 4);
            }
            dget(be, got, d, n * 4);
            if (memcmp(got, ref, n * 4) != 0) fail_msg("overlapping copy (shift %zu, %s) differs from memmove", sh,
                                                      dir == 0 ? "down" : "up");
        }
    }
    gpu_ok(be, "copy");
    printf("copy: overlapping ranges (shifts 4, 4096, 300000 floats, both directions) == memmove\n");
    dfree_(be, d);
    free(h);
    free(ref);
    free(got);
}

/* ---- attention ---------------------------------------------------------------------------------------- */

static void attention_case(int nh, int nkv, int hd, int rot, int gated, int p0) {
    df_backend *be = g_gpu;
    const df_attn_shape sh = {.n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .rot_dims = rot,
                              .mrope_section = {11, 11, 10}, .rope_theta = 1e7f, .eps = 1e-6f, .gated = gated,
                              .causal = 1};
    const int R = DF_MAX_ROWS, qd = nh * (gated ? 2 : 1) * hd, kd = nkv * hd, od = nh * hd, cap = p0 + R;
    float *qn = malloc((size_t)hd * 4), *kn = malloc((size_t)hd * 4);
    for (int i = 0; i < hd; i++) {
        qn[i] = 1.0f + 0.2f * frand();
        kn[i] = 1.0f + 0.2f * frand();
    }
    float *kc0 = malloc((size_t)cap * kd * 4), *vc0 = malloc((size_t)cap * kd * 4);
    for (int i = 0; i < cap * kd; i++) {
        kc0[i] = frand();
        vc0[i] = frand();
    }
    float *q = malloc((size_t)R * qd * 4), *k = malloc((size_t)R * kd * 4), *v = malloc((size_t)R * kd * 4);
    for (int i = 0; i < R * qd; i++) q[i] = 2.0f * frand();
    for (int i = 0; i < R * kd; i++) {
        k[i] = 2.0f * frand();
        v[i] = frand();
    }
    float *oa = malloc((size_t)R * od * 4), *ob = malloc((size_t)od * 4), *oc = malloc((size_t)R * od * 4);
    float *dkcA = dput(be, kc0, (size_t)cap * kd * 4), *dvcA = dput(be, vc0, (size_t)cap * kd * 4);
    float *dkcB = dput(be, kc0, (size_t)cap * kd * 4), *dvcB = dput(be, vc0, (size_t)cap * kd * 4);
    float *dv = dput(be, v, (size_t)R * kd * 4);
    float *dq = be->ops->alloc(be, (size_t)R * qd * 4), *dk = be->ops->alloc(be, (size_t)R * kd * 4);
    float *doa = be->ops->alloc(be, (size_t)R * od * 4), *dob = be->ops->alloc(be, (size_t)od * 4);
    int32_t pos[DF_MAX_ROWS];
    for (int m = 0; m < R; m++) pos[m] = p0 + m;
    for (int M = 1; M <= R; M++) {
        be->ops->to_device(be, dq, q, (size_t)M * qd * 4);
        be->ops->to_device(be, dk, k, (size_t)M * kd * 4);
        be->ops->attention(be, &sh, dq, dk, dv, qn, kn, pos, M, dkcA, dvcA, p0, doa);
        dget(be, oa, doa, (size_t)M * od * 4);
        for (int m = 0; m < M; m++) {
            be->ops->to_device(be, dq, q + (size_t)m * qd, (size_t)qd * 4);
            be->ops->to_device(be, dk, k + (size_t)m * kd, (size_t)kd * 4);
            be->ops->attention(be, &sh, dq, dk, dv + (size_t)m * kd, qn, kn, pos + m, 1, dkcB, dvcB, p0 + m, dob);
            dget(be, ob, dob, (size_t)od * 4);
            if (memcmp(ob, oa + (size_t)m * od, (size_t)od * 4) != 0)
                fail_msg("attention (hd %d, p0 %d): row %d of M = %d differs from the decode step", hd, p0, m, M);
        }
    }
    gpu_ok(be, "attention");
    /* two calls of 8 rows in one step (as a prefill's tiles): the second reads the rows the
     * first wrote (after the cache rows were reset to other values), never an early copy of
     * them, so each row == its row of the 16-row call */
    {
        const int H = R / 2;
        be->ops->to_device(be, dkcA, kc0, (size_t)cap * kd * 4);
        be->ops->to_device(be, dvcA, vc0, (size_t)cap * kd * 4);
        be->ops->to_device(be, dq, q, (size_t)R * qd * 4);
        be->ops->to_device(be, dk, k, (size_t)R * kd * 4);
        for (int h = 0; h < 2; h++)
            be->ops->attention(be, &sh, dq + (size_t)h * H * qd, dk + (size_t)h * H * kd, dv + (size_t)h * H * kd, qn,
                               kn, pos + h * H, H, dkcA, dvcA, p0 + h * H, doa + (size_t)h * H * od);
        float *o2 = malloc((size_t)R * od * 4);
        dget(be, o2, doa, (size_t)R * od * 4);
        gpu_ok(be, "attention (two calls in one step)");
        if (memcmp(o2, oa, (size_t)R * od * 4) != 0)
            fail_msg("attention (hd %d, p0 %d): two 8-row calls in one step differ from the 16-row call", hd, p0);
        free(o2);
    }
    /* CPU reference for M = 16 */
    float *kc = malloc((size_t)cap * kd * 4), *vc = malloc((size_t)cap * kd * 4), *qq = malloc((size_t)R * qd * 4),
          *kk = malloc((size_t)R * kd * 4);
    memcpy(kc, kc0, (size_t)cap * kd * 4);
    memcpy(vc, vc0, (size_t)cap * kd * 4);
    memcpy(qq, q, (size_t)R * qd * 4);
    memcpy(kk, k, (size_t)R * kd * 4);
    g_cpu->ops->attention(g_cpu, &sh, qq, kk, v, qn, kn, pos, R, kc, vc, p0, oc);
    double e = rel_err(oa, oc, (size_t)R * od, 1e-2);
    float *kcg = malloc((size_t)cap * kd * 4);
    dget(be, kcg, dkcA, (size_t)cap * kd * 4);
    double ek = rel_err(kcg, kc, (size_t)cap * kd, 1.0);
    printf("attention nh %d/%d hd %d rot %d gated %d p0 %d: rel err vs CPU %.2e (K cache %.2e)\n", nh, nkv, hd, rot,
           gated, p0, e, ek);
    assert_true(e <= 1e-4);
    assert_true(ek <= 1e-5);
    /* non-causal (drafter block attention) vs CPU */
    df_attn_shape nc = sh;
    nc.causal = 0;
    memcpy(kc, kc0, (size_t)cap * kd * 4);
    memcpy(vc, vc0, (size_t)cap * kd * 4);
    memcpy(qq, q, (size_t)R * qd * 4);
    memcpy(kk, k, (size_t)R * kd * 4);
    g_cpu->ops->attention(g_cpu, &nc, qq, kk, v, qn, kn, pos, R, kc, vc, p0, oc);
    be->ops->to_device(be, dkcA, kc0, (size_t)cap * kd * 4);
    be->ops->to_device(be, dvcA, vc0, (size_t)cap * kd * 4);
    be->ops->to_device(be, dq, q, (size_t)R * qd * 4);
    be->ops->to_device(be, dk, k, (size_t)R * kd * 4);
    be->ops->attention(be, &nc, dq, dk, dv, qn, kn, pos, R, dkcA, dvcA, p0, doa);
    dget(be, oa, doa, (size_t)R * od * 4);
    e = rel_err(oa, oc, (size_t)R * od, 1e-2);
    printf("  non-causal: rel err vs CPU %.2e\n", e);
    assert_true(e <= 1e-4);
    /* kv_append vs CPU */
    memcpy(kk, k, (size_t)R * kd * 4);
    g_cpu->ops->kv_append(g_cpu, &sh, kk, v, kn, pos, R, kc, vc, p0);
    be->ops->to_device(be, dk, k, (size_t)R * kd * 4);
    be->ops->kv_append(be, &sh, dk, dv, kn, pos, R, dkcA, dvcA, p0);
    dget(be, kcg, dkcA, (size_t)cap * kd * 4);
    assert_true(rel_err(kcg, kc, (size_t)cap * kd, 1.0) <= 1e-5);
    gpu_ok(be, "attention");
    void *ds[] = {dkcA, dvcA, dkcB, dvcB, dv, dq, dk, doa, dob};
    for (size_t i = 0; i < sizeof ds / sizeof ds[0]; i++) dfree_(be, ds[i]);
    free(kcg);
    free(kc);
    free(vc);
    free(qq);
    free(kk);
    free(qn);
    free(kn);
    free(kc0);
    free(vc0);
    free(q);
    free(k);
    free(v);
    free(oa);
    free(ob);
    free(oc);
}

static void test_attention(void **state) {
    (void)state;
    NEED_GPU();
    for (int ch = 32; ch <= 64; ch *= 2) { /* both chunk sizes: M rows == single rows, CPU tolerance */
        printf("attention chunks of %d positions\n", ch);
#ifdef DFLASH_WITH_CUDA
        df_backend_cuda_set_attn_chunk(g_gpu, ch);
#endif
        attention_case(4, 2, 64, 16, 1, 37);    /* tiny target */
        attention_case(24, 4, 256, 64, 1, 600); /* 27B shape, 10 or 19 cache chunks */
        attention_case(32, 8, 128, 128, 0, 70); /* drafter shape */
        attention_case(24, 4, 256, 64, 1, 4200); /* past 128 chunks of 32: the finer chunk bound */
    }
#ifdef DFLASH_WITH_CUDA
    df_backend_cuda_set_attn_chunk(g_gpu, 32);
#endif
}

/* ---- Gated DeltaNet --------------------------------------------------------------------------------------- */

/* gdn_states over NL layers (each its own states, inputs and A_log) == one `gdn` per layer
 * with out = NULL, bit for bit, for several row counts. */
static void gdn_states_check(df_backend *be, const df_gdn_shape *sh, const float *dqkv, const float *dz,
                             const float *da, const float *db, const float *conv_w, const float *dt, const float *nw,
                             const float *cs0, const float *S0) {
    enum { NL = 3 };
    const int nk = sh->n_k_heads, nv = sh->n_v_heads, dk = sh->k_head_dim, dv = sh->v_head_dim;
    const int C = 2 * nk * dk + nv * dv, Vd = nv * dv;
    const size_t ssz = (size_t)nv * dk * dv, csz = (size_t)3 * C;
    float *A_log[NL], *dcs[2][NL], *dS[2][NL];
    float *h1 = malloc(ssz * 4), *h2 = malloc(ssz * 4);
    for (int l = 0; l < NL; l++) {
        A_log[l] = malloc((size_t)nv * 4);
        for (int i = 0; i < nv; i++) A_log[l][i] = frand();
        for (int k = 0; k < 2; k++) {
            dcs[k][l] = be->ops->alloc(be, csz * 4);
            dS[k][l] = be->ops->alloc(be, ssz * 4);
        }
    }
    const int Ms[] = {1, 3, 7};
    for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
        const int M = Ms[mi];
        df_gdn_layer L[NL];
        for (int l = 0; l < NL; l++) {
            for (int k = 0; k < 2; k++) {
                be->ops->to_device(be, dcs[k][l], cs0, csz * 4);
                be->ops->to_device(be, dS[k][l], S0, ssz * 4);
            }
            /* layer l reads rows l .. l + M - 1 of the inputs */
            L[l] = (df_gdn_layer){.qkv = dqkv + (size_t)l * C, .z = dz + (size_t)l * Vd, .a = da + (size_t)l * nv,
                                  .b = db + (size_t)l * nv, .conv_w = conv_w, .A_log = A_log[l], .dt_bias = dt,
                                  .norm_w = nw, .conv_state = dcs[0][l], .S = dS[0][l]};
            be->ops->gdn(be, sh, L[l].qkv, L[l].z, L[l].a, L[l].b, conv_w, A_log[l], dt, nw, M, dcs[1][l], dS[1][l],
                         NULL);
        }
        assert_non_null(be->ops->gdn_states);
        be->ops->gdn_states(be, sh, M, NL, L);
        for (int l = 0; l < NL; l++) {
            dget(be, h1, dS[0][l], ssz * 4);
            dget(be, h2, dS[1][l], ssz * 4);
            if (memcmp(h1, h2, ssz * 4) != 0) fail_msg("gdn_states (dk %d): layer %d, M = %d: state differs", dk, l, M);
            dget(be, h1, dcs[0][l], csz * 4);
            dget(be, h2, dcs[1][l], csz * 4);
            if (memcmp(h1, h2, csz * 4) != 0) fail_msg("gdn_states (dk %d): layer %d, M = %d: conv state differs", dk, l, M);
        }
        /* a gdn recorded right after gdn_states in one step reads the states it wrote: the same
         * bits as after the per-layer calls */
        be->ops->gdn_states(be, sh, M, NL, L);
        be->ops->gdn(be, sh, L[0].qkv, L[0].z, L[0].a, L[0].b, conv_w, A_log[0], dt, nw, M, dcs[0][0], dS[0][0], NULL);
        for (int l = 0; l < NL; l++)
            be->ops->gdn(be, sh, L[l].qkv, L[l].z, L[l].a, L[l].b, conv_w, A_log[l], dt, nw, M, dcs[1][l], dS[1][l],
                         NULL);
        be->ops->gdn(be, sh, L[0].qkv, L[0].z, L[0].a, L[0].b, conv_w, A_log[0], dt, nw, M, dcs[1][0], dS[1][0], NULL);
        dget(be, h1, dS[0][0], ssz * 4);
        dget(be, h2, dS[1][0], ssz * 4);
        if (memcmp(h1, h2, ssz * 4) != 0) fail_msg("gdn after gdn_states in one step (dk %d, M = %d): state differs", dk, M);
        /* copies into the states it writes, recorded after it in one step, land after it */
        be->ops->gdn_states(be, sh, M, NL, L);
        be->ops->to_device(be, dS[0][1], S0, ssz * 4);
        be->ops->zero(be, dcs[0][2], csz * 4);
        be->ops->copy(be, dS[0][2], dS[0][1], ssz * 4);
        dget(be, h1, dS[0][2], ssz * 4);
        if (memcmp(h1, S0, ssz * 4) != 0) fail_msg("a copy after gdn_states in one step (dk %d, M = %d) was overwritten", dk, M);
        dget(be, h1, dcs[0][2], csz * 4);
        for (size_t i = 0; i < csz; i++)
            if (h1[i] != 0.0f) fail_msg("a zero after gdn_states in one step (dk %d, M = %d) was overwritten", dk, M);
    }
    gpu_ok(be, "gdn_states");
    printf("gdn_states (dk %d): %d layers at once == one gdn per layer, M = 1, 3, 7\n", dk, NL);
    for (int l = 0; l < NL; l++) {
        free(A_log[l]);
        for (int k = 0; k < 2; k++) {
            dfree_(be, dcs[k][l]);
            dfree_(be, dS[k][l]);
        }
    }
    free(h1);
    free(h2);
}

static void gdn_case(int nk, int nv, int dk, int dv) {
    df_backend *be = g_gpu;
    const df_gdn_shape sh = {.n_k_heads = nk, .n_v_heads = nv, .k_head_dim = dk, .v_head_dim = dv, .conv_kernel = 4,
                             .eps = 1e-6f};
    const int C = 2 * nk * dk + nv * dv, Vd = nv * dv, K = 4, R = DF_MAX_ROWS;
    const size_t ssz = (size_t)nv * dk * dv;
    float *conv_w = malloc((size_t)C * K * 4), *A_log = malloc((size_t)nv * 4), *dt = malloc((size_t)nv * 4),
          *nw = malloc((size_t)dv * 4);
    for (int i = 0; i < C * K; i++) conv_w[i] = 0.5f * frand();
    for (int i = 0; i < nv; i++) {
        A_log[i] = frand();
        dt[i] = frand();
    }
    for (int i = 0; i < dv; i++) nw[i] = 1.0f + 0.1f * frand();
    float *qkv = malloc((size_t)R * C * 4), *z = malloc((size_t)R * Vd * 4), *a = malloc((size_t)R * nv * 4),
          *b = malloc((size_t)R * nv * 4);
    for (int i = 0; i < R * C; i++) qkv[i] = frand();
    for (int i = 0; i < R * Vd; i++) z[i] = frand();
    for (int i = 0; i < R * nv; i++) {
        a[i] = frand();
        b[i] = frand();
    }
    float *cs0 = malloc((size_t)3 * C * 4), *S0 = malloc(ssz * 4);
    for (int i = 0; i < 3 * C; i++) cs0[i] = frand();
    for (size_t i = 0; i < ssz; i++) S0[i] = 0.1f * frand();
    float *dqkv = dput(be, qkv, (size_t)R * C * 4), *dz = dput(be, z, (size_t)R * Vd * 4), *da = dput(be, a, (size_t)R * nv * 4),
          *db = dput(be, b, (size_t)R * nv * 4);
    float *dcsA = be->ops->alloc(be, (size_t)3 * C * 4), *dSA = be->ops->alloc(be, ssz * 4);
    float *dcsB = be->ops->alloc(be, (size_t)3 * C * 4), *dSB = be->ops->alloc(be, ssz * 4);
    float *doa = be->ops->alloc(be, (size_t)R * Vd * 4), *dob = be->ops->alloc(be, (size_t)Vd * 4);
    float *oa = malloc((size_t)R * Vd * 4), *ob = malloc((size_t)Vd * 4), *SA = malloc(ssz * 4), *SB = malloc(ssz * 4);
    float *csA = malloc((size_t)3 * C * 4), *csB = malloc((size_t)3 * C * 4);
    for (int M = 1; M <= R; M++) {
        be->ops->to_device(be, dcsA, cs0, (size_t)3 * C * 4);
        be->ops->to_device(be, dcsB, cs0, (size_t)3 * C * 4);
        be->ops->to_device(be, dSA, S0, ssz * 4);
        be->ops->to_device(be, dSB, S0, ssz * 4);
        be->ops->gdn(be, &sh, dqkv, dz, da, db, conv_w, A_log, dt, nw, M, dcsA, dSA, doa);
        dget(be, oa, doa, (size_t)M * Vd * 4);
        for (int m = 0; m < M; m++) {
            be->ops->gdn(be, &sh, dqkv + (size_t)m * C, dz + (size_t)m * Vd, da + (size_t)m * nv, db + (size_t)m * nv,
                         conv_w, A_log, dt, nw, 1, dcsB, dSB, dob);
            dget(be, ob, dob, (size_t)Vd * 4);
            if (memcmp(ob, oa + (size_t)m * Vd, (size_t)Vd * 4) != 0)
                fail_msg("gdn (dk %d): row %d of M = %d differs from the single step", dk, m, M);
        }
        dget(be, SA, dSA, ssz * 4);
        dget(be, SB, dSB, ssz * 4);
        dget(be, csA, dcsA, (size_t)3 * C * 4);
        dget(be, csB, dcsB, (size_t)3 * C * 4);
        assert_memory_equal(SA, SB, ssz * 4);
        assert_memory_equal(csA, csB, (size_t)3 * C * 4);
    }
    /* rows 0..7 then 8..15 as two calls in one step (as a prefill's tiles): the second reads the
     * states the first wrote, never an early copy of them, so outputs and states == the 16-row
     * call's (oa, SA, csA: the loop's last M) */
    {
        const int H = R / 2;
        float *o2 = malloc((size_t)R * Vd * 4);
        be->ops->to_device(be, dcsB, cs0, (size_t)3 * C * 4);
        be->ops->to_device(be, dSB, S0, ssz * 4);
        for (int h = 0; h < 2; h++)
            be->ops->gdn(be, &sh, dqkv + (size_t)h * H * C, dz + (size_t)h * H * Vd, da + (size_t)h * H * nv,
                         db + (size_t)h * H * nv, conv_w, A_log, dt, nw, H, dcsB, dSB, doa + (size_t)h * H * Vd);
        dget(be, o2, doa, (size_t)R * Vd * 4);
        dget(be, SB, dSB, ssz * 4);
        dget(be, csB, dcsB, (size_t)3 * C * 4);
        if (memcmp(o2, oa, (size_t)R * Vd * 4) != 0 || memcmp(SB, SA, ssz * 4) != 0 ||
            memcmp(csB, csA, (size_t)3 * C * 4) != 0)
            fail_msg("gdn (dk %d): two 8-row calls in one step differ from the 16-row call", dk);
        free(o2);
    }
    /* states-only replay (out = NULL) advances the same states */
    be->ops->to_device(be, dcsB, cs0, (size_t)3 * C * 4);
    be->ops->to_device(be, dSB, S0, ssz * 4);
    be->ops->gdn(be, &sh, dqkv, dz, da, db, conv_w, A_log, dt, nw, R, dcsB, dSB, NULL);
    dget(be, SB, dSB, ssz * 4);
    assert_memory_equal(SA, SB, ssz * 4);
    gpu_ok(be, "gdn");
    gdn_states_check(be, &sh, dqkv, dz, da, db, conv_w, dt, nw, cs0, S0);
#ifdef DFLASH_WITH_CUDA
    /* conv + recurrence as one kernel (default) == as two, bit for bit: outputs and both states */
    for (int M = 1; M <= R; M += 5) {
        float *o2 = malloc((size_t)M * Vd * 4), *S2 = malloc(ssz * 4), *cs2 = malloc((size_t)3 * C * 4);
        for (int f = 0; f < 2; f++) {
            df_backend_cuda_set_gdn_fused(be, f == 0);
            be->ops->to_device(be, f ? dcsB : dcsA, cs0, (size_t)3 * C * 4);
            be->ops->to_device(be, f ? dSB : dSA, S0, ssz * 4);
            be->ops->gdn(be, &sh, dqkv, dz, da, db, conv_w, A_log, dt, nw, M, f ? dcsB : dcsA, f ? dSB : dSA, doa);
            dget(be, f ? o2 : oa, doa, (size_t)M * Vd * 4);
        }
        df_backend_cuda_set_gdn_fused(be, 1);
        assert_memory_equal(oa, o2, (size_t)M * Vd * 4);
        dget(be, SA, dSA, ssz * 4);
        dget(be, S2, dSB, ssz * 4);
        assert_memory_equal(SA, S2, ssz * 4);
        dget(be, csA, dcsA, (size_t)3 * C * 4);
        dget(be, cs2, dcsB, (size_t)3 * C * 4);
        assert_memory_equal(csA, cs2, (size_t)3 * C * 4);
        free(o2);
        free(S2);
        free(cs2);
    }
    printf("gdn (dk %d): conv + recurrence in one kernel == two kernels, M = 1, 6, 11, 16\n", dk);
#endif
    /* the CPU reference below is compared with the default kernels from the first rows of oa/SA */
    be->ops->to_device(be, dcsA, cs0, (size_t)3 * C * 4);
    be->ops->to_device(be, dSA, S0, ssz * 4);
    be->ops->gdn(be, &sh, dqkv, dz, da, db, conv_w, A_log, dt, nw, R, dcsA, dSA, doa);
    dget(be, oa, doa, (size_t)R * Vd * 4);
    dget(be, SA, dSA, ssz * 4);
    dget(be, csA, dcsA, (size_t)3 * C * 4);
    /* CPU reference */
    float *cs = malloc((size_t)3 * C * 4), *S = malloc(ssz * 4), *oc = malloc((size_t)R * Vd * 4);
    memcpy(cs, cs0, (size_t)3 * C * 4);
    memcpy(S, S0, ssz * 4);
    g_cpu->ops->gdn(g_cpu, &sh, qkv, z, a, b, conv_w, A_log, dt, nw, R, cs, S, oc);
    double e = rel_err(oa, oc, (size_t)R * Vd, 1e-2), es = rel_err(SA, S, ssz, 1e-2);
    printf("gdn nk %d nv %d dk %d dv %d: rel err vs CPU out %.2e, state %.2e\n", nk, nv, dk, dv, e, es);
    assert_true(e <= 1e-4);
    assert_true(es <= 1e-4);
    assert_memory_equal(csA, cs, (size_t)3 * C * 4);
    void *ds[] = {dqkv, dz, da, db, dcsA, dSA, dcsB, dSB, doa, dob};
    for (size_t i = 0; i < sizeof ds / sizeof ds[0]; i++) dfree_(be, ds[i]);
    free(cs);
    free(S);
    free(oc);
    free(conv_w);
    free(A_log);
    free(dt);
    free(nw);
    free(qkv);
    free(z);
    free(a);
    free(b);
    free(cs0);
    free(S0);
    free(oa);
    free(ob);
    free(SA);
    free(SB);
    free(csA);
    free(csB);
}

static void test_gdn(void **state) {
    (void)state;
    NEED_GPU();
    gdn_case(2, 4, 64, 64);     /* tiny */
    gdn_case(16, 48, 128, 128); /* 27B */
    /* more heads than the device holds at once, 64 value heads per key head: the blocks of a
     * key head run in different waves, and each must read the shared q/k conv windows as they
     * were before the step, never as a sibling that already finished advanced them in place */
    gdn_case(32, 2048, 32, 32);
}

/* DFlash2 grouped dynamic convolution: equals the CPU backend; rows are causal (a prefix of
 * the block gives the same rows). */
static void test_dyn_conv(void **state) {
    (void)state;
    NEED_GPU();
    df_backend *be = g_gpu;
    const int H = 256, gs = 64, G = H / gs, K = 3, R = DF_MAX_ROWS, stride = 2 * K * G;
    float *x = malloc((size_t)R * H * 4), *dyn = malloc((size_t)R * stride * 4), *base = malloc((size_t)K * H * 4);
    float *yc = malloc((size_t)R * H * 4), *yg = malloc((size_t)R * H * 4), *yp = malloc((size_t)R * H * 4);
    for (int i = 0; i < R * H; i++) x[i] = frand();
    for (int i = 0; i < R * stride; i++) dyn[i] = 0.3f * frand();
    for (int i = 0; i < K * H; i++) base[i] = 0.5f * frand();
    float *dx = dput(be, x, (size_t)R * H * 4), *dd = dput(be, dyn, (size_t)R * stride * 4);
    float *dy = be->ops->alloc(be, (size_t)R * H * 4);
    g_cpu->ops->dyn_conv(g_cpu, x, dyn + K * G, stride, base, K, gs, R, H, yc);
    be->ops->dyn_conv(be, dx, dd + K * G, stride, base, K, gs, R, H, dy);
    dget(be, yg, dy, (size_t)R * H * 4);
    double e = rel_err(yg, yc, (size_t)R * H, 1e-3);
    printf("dyn_conv: rel err vs CPU %.2e\n", e);
    assert_true(e <= 1e-6);
    for (int M = 1; M < R; M += 5) {
        be->ops->dyn_conv(be, dx, dd + K * G, stride, base, K, gs, M, H, dy);
        dget(be, yp, dy, (size_t)M * H * 4);
        assert_memory_equal(yp, yg, (size_t)M * H * 4);
    }
    gpu_ok(be, "dyn_conv");
    dfree_(be, dx);
    dfree_(be, dd);
    dfree_(be, dy);
    free(x);
    free(dyn);
    free(base);
    free(yc);
    free(yg);
    free(yp);
}

/* ---- fused ops -------------------------------------------------------------------------------------- */

/* linears (RMSNorm + several linears, fixed-point and dense mixed) and linear_add (SwiGLU +
 * linear + residual add): M-row == single-row bits, and == the primitive ops in sequence on
 * the same backend. */
/* Outputs dy[i] == dz[i] bit for bit ([M, q[i].L.rows] each; hy, hz: host scratch). */
static void same_outputs(df_backend *be, int n, const qlin *q, int M, float *const *dy, float *const *dz, float *hy,
                         float *hz, const char *what) {
    for (int i = 0; i < n; i++) {
        const size_t k = (size_t)M * (size_t)q[i].L.rows;
        dget(be, hy, dy[i], k * 4);
        dget(be, hz, dz[i], k * 4);
        if (memcmp(hy, hz, k * 4) != 0) fail_msg("%s: output %d (M = %d) differs from rmsnorm + linear", what, i, M);
    }
}

/* got [M, d.rows] (linear_add of d on gate, up over the residual r0) == swiglu + linear + add
 * computed here into ref (da: [M, d.cols], dl: [M, d.rows] device scratch; ha, hb: host). */
static void same_as_composition(df_backend *be, const qlin *d, const float *gate, const float *up, int M,
                                const float *r0, const float *got, float *ref, float *da, float *dl, float *ha,
                                float *hb, const char *what) {
    const size_t H = (size_t)d->L.rows, I = (size_t)d->L.cols;
    be->ops->to_device(be, ref, r0, (size_t)M * H * 4);
    be->ops->swiglu(be, gate, up, (size_t)M * I, da);
    be->ops->linear(be, &d->L, da, M, dl);
    be->ops->add(be, ref, dl, (size_t)M * H);
    dget(be, ha, got, (size_t)M * H * 4);
    dget(be, hb, ref, (size_t)M * H * 4);
    if (memcmp(ha, hb, (size_t)M * H * 4) != 0) fail_msg("%s (M = %d) differs from swiglu + linear + add", what, M);
}

/* linear_add of d (SwiGLU of gate, up: device [R, d.cols]) over the residual r0 (host [R, d.rows])
 * for M = 1..R == swiglu + linear + add (same_as_composition), and its last row alone == that
 * row of M (for every M when each_M, else at M = R). dr, dr2 [R, rows], da [R, cols], dl
 * [R, rows]: device scratch; ha, hb: host scratch [R, rows]. */
static void linear_add_rows(df_backend *be, const qlin *d, const float *gate, const float *up, const float *r0, int R,
                            int each_M, float *dr, float *dr2, float *da, float *dl, float *ha, float *hb,
                            const char *what) {
    const size_t H = (size_t)d->L.rows, I = (size_t)d->L.cols;
    for (int M = 1; M <= R; M++) {
        be->ops->to_device(be, dr, r0, (size_t)R * H * 4);
        be->ops->linear_add(be, &d->L, gate, up, M, dr);
        same_as_composition(be, d, gate, up, M, r0, dr, dr2, da, dl, ha, hb, what);
        if (!each_M && M < R) continue;
        be->ops->to_device(be, dr2, r0 + (size_t)(M - 1) * H, H * 4);
        be->ops->linear_add(be, &d->L, gate + (size_t)(M - 1) * I, up + (size_t)(M - 1) * I, 1, dr2);
        dget(be, hb, dr2, H * 4);
        if (memcmp(ha + (size_t)(M - 1) * H, hb, H * 4) != 0)
            fail_msg("%s: row %d of M = %d differs from the single-row result", what, M - 1, M);
    }
}

static void fused_case(df_backend *be, const char *kernel) {
    const int H = 1024, R = DF_MAX_ROWS, I = 2048;
    qlin q[4], d;
    make_linear(&q[0], 200, H, 2, 128, 1024, 0, 1);
    make_linear(&q[1], 96, H, 2, 128, 1024, 0, 1);
    make_linear(&q[2], 24, H, 0, 0, 0, DF_DTYPE_F16, 0);
    make_linear(&q[3], 24, H, 0, 0, 0, DF_DTYPE_F16, 0);
    make_linear(&d, H, I, 2, 128, 1024, 0, 1);
    float *x = malloc((size_t)R * I * 4), *u = malloc((size_t)R * I * 4), *nw = malloc(H * 4);
    for (int i = 0; i < R * I; i++) {
        x[i] = 2.0f * frand();
        u[i] = frand();
    }
    for (int i = 0; i < H; i++) nw[i] = 1.0f + 0.5f * frand();
    float *dx = dput(be, x, (size_t)R * I * 4), *du = dput(be, u, (size_t)R * I * 4);
    float *dh = be->ops->alloc(be, (size_t)R * H * 4), *dh2 = be->ops->alloc(be, (size_t)R * H * 4);
    float *dy[4], *dz[4];
    const df_linear *Ws[4];
    for (int i = 0; i < 4; i++) {
        dy[i] = be->ops->alloc(be, (size_t)R * q[i].L.rows * 4);
        dz[i] = be->ops->alloc(be, (size_t)R * q[i].L.rows * 4);
        Ws[i] = &q[i].L;
    }
    float *hy = malloc((size_t)R * H * 4), *hz = malloc((size_t)R * H * 4); /* >= every output */
    for (int M = 1; M <= R; M++) {
        be->ops->linears(be, dx, nw, 1e-6f, M, H, 4, Ws, dy, dh);
        be->ops->rmsnorm(be, dx, nw, M, H, 1e-6f, dh2);
        for (int i = 0; i < 4; i++) be->ops->linear(be, Ws[i], dh2, M, dz[i]);
        same_outputs(be, 4, q, M, dy, dz, hy, hz, "linears");
        dget(be, hy, dh, (size_t)M * H * 4);
        dget(be, hz, dh2, (size_t)M * H * 4);
        if (memcmp(hy, hz, (size_t)M * H * 4) != 0) fail_msg("linears: h differs from rmsnorm (M = %d)", M);
        /* rows of M == single rows */
        for (int m = 0; m < M; m += 3) {
            float *y1[4] = {dz[0], dz[1], dz[2], dz[3]};
            be->ops->linears(be, dx + (size_t)m * H, nw, 1e-6f, 1, H, 4, Ws, y1, NULL);
            for (int i = 0; i < 4; i++) {
                const size_t n = (size_t)q[i].L.rows;
                dget(be, hy, dy[i], (size_t)M * n * 4);
                dget(be, hz, dz[i], n * 4);
                if (memcmp(hy + (size_t)m * n, hz, n * 4) != 0)
                    fail_msg("linears: row %d of M = %d differs from the single-row result (output %d)", m, M, i);
            }
        }
    }
    /* linear_add with SwiGLU == swiglu, linear, add */
    float *r0 = malloc((size_t)R * H * 4);
    for (int i = 0; i < R * H; i++) r0[i] = frand();
    float *dr = be->ops->alloc(be, (size_t)R * H * 4), *dr2 = be->ops->alloc(be, (size_t)R * H * 4);
    float *da = be->ops->alloc(be, (size_t)R * I * 4), *dl = be->ops->alloc(be, (size_t)R * H * 4);
    float *ha = malloc((size_t)R * H * 4), *hb = malloc((size_t)R * H * 4);
    linear_add_rows(be, &d, dx, du, r0, R, 0, dr, dr2, da, dl, ha, hb, "linear_add");
    /* an input preparation right after the fixed-point launch that writes its input: linears
     * after linear_add (RMSNorm of the residual), linear_add after linears (SwiGLU of gate and
     * up) == the same with another kernel in between */
    qlin gu[2];
    make_linear(&gu[0], I, H, 2, 128, 1024, 0, 1);
    make_linear(&gu[1], I, H, 2, 128, 1024, 0, 1);
    const df_linear *Wg[2] = {&gu[0].L, &gu[1].L};
    float *dg = be->ops->alloc(be, (size_t)R * I * 4), *dup = be->ops->alloc(be, (size_t)R * I * 4);
    for (int M = 1; M <= R; M++) {
        be->ops->to_device(be, dr, r0, (size_t)R * H * 4);
        be->ops->to_device(be, dr2, r0, (size_t)R * H * 4);
        be->ops->linear_add(be, &d.L, dx, du, M, dr);
        be->ops->linears(be, dr, nw, 1e-6f, M, H, 4, Ws, dy, dh);
        be->ops->linear_add(be, &d.L, dx, du, M, dr2);
        be->ops->rmsnorm(be, dr2, nw, M, H, 1e-6f, dh2);
        for (int i = 0; i < 4; i++) be->ops->linear(be, Ws[i], dh2, M, dz[i]);
        same_outputs(be, 4, q, M, dy, dz, hy, hz, "linears after linear_add");
        float *yg[2] = {dg, dup};
        be->ops->to_device(be, dh, r0, (size_t)R * H * 4);
        be->ops->linears(be, dr, NULL, 1e-6f, M, H, 2, Wg, yg, NULL);
        be->ops->linear_add(be, &d.L, dg, dup, M, dh);
        same_as_composition(be, &d, dg, dup, M, r0, dh, dh2, da, dl, ha, hb, "linear_add after linears");
    }
    dfree_(be, dg);
    dfree_(be, dup);
    free_linear(&gu[0]);
    free_linear(&gu[1]);
    gpu_ok(be, "fused");
    printf("fused ops (%s): linears (norm + 2 fixed-point + 2 dense) and linear_add (SwiGLU) == composition, "
           "also one after the other; M = 1..16 rows == single rows\n", kernel);
    float *bufs[] = {dx, du, dh, dh2, dr, dr2, da, dl, dy[0], dy[1], dy[2], dy[3], dz[0], dz[1], dz[2], dz[3]};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) dfree_(be, bufs[i]);
    for (int i = 0; i < 4; i++) free_linear(&q[i]);
    free_linear(&d);
    free(x);
    free(u);
    free(nw);
    free(hy);
    free(hz);
    free(r0);
    free(ha);
    free(hb);
}

/* bf16 tensor-core linears of one input in one `linears` call run as one launch (with a dense
 * f16 linear beside them): each output == that linear alone on rmsnorm's output, bit for bit,
 * with and without the norm, for M = 1..16; and rows of M == single rows. */
static void mma_multi_case(df_backend *be, const char *what) {
    const int H = 640, R = DF_MAX_ROWS, rows[4] = {200, 48, 1000, 24};
    qlin q[4];
    for (int i = 0; i < 3; i++) make_linear(&q[i], rows[i], H, 0, 0, 0, DF_DTYPE_BF16, 0);
    make_linear(&q[3], rows[3], H, 0, 0, 0, DF_DTYPE_F16, 0);
    float *x = malloc((size_t)R * H * 4), *nw = malloc(H * 4);
    for (int i = 0; i < R * H; i++) x[i] = 3.0f * frand();
    for (int i = 0; i < H; i++) nw[i] = 1.0f + 0.5f * frand();
    float *dx = dput(be, x, (size_t)R * H * 4);
    float *dh = be->ops->alloc(be, (size_t)R * H * 4), *dh2 = be->ops->alloc(be, (size_t)R * H * 4);
    float *dy[4], *dz[4];
    const df_linear *Ws[4];
    for (int i = 0; i < 4; i++) {
        dy[i] = be->ops->alloc(be, (size_t)R * rows[i] * 4);
        dz[i] = be->ops->alloc(be, (size_t)R * rows[i] * 4);
        Ws[i] = &q[i].L;
    }
    float *hy = malloc((size_t)R * 1000 * 4), *hz = malloc((size_t)R * 1000 * 4);
    for (int norm = 0; norm < 2; norm++)
        for (int n = 2; n <= 4; n++)
            for (int M = 1; M <= R; M++) {
                be->ops->linears(be, dx, norm ? nw : NULL, 1e-6f, M, H, n, Ws, dy, norm ? dh : NULL);
                const float *in = dx;
                if (norm) {
                    be->ops->rmsnorm(be, dx, nw, M, H, 1e-6f, dh2);
                    in = dh2;
                }
                for (int i = 0; i < n; i++) be->ops->linear(be, Ws[i], in, M, dz[i]);
                same_outputs(be, n, q, M, dy, dz, hy, hz, "bf16 linears in one launch");
                const int m = M - 1; /* the last row alone */
                float *y1[4] = {dz[0], dz[1], dz[2], dz[3]};
                be->ops->linears(be, dx + (size_t)m * H, norm ? nw : NULL, 1e-6f, 1, H, n, Ws, y1, NULL);
                for (int i = 0; i < n; i++) {
                    const size_t k = (size_t)rows[i];
                    dget(be, hy, dy[i], (size_t)M * k * 4);
                    dget(be, hz, dz[i], k * 4);
                    if (memcmp(hy + (size_t)m * k, hz, k * 4) != 0)
                        fail_msg("bf16 linears in one launch: row %d of M = %d differs from the single row (output %d)",
                                 m, M, i);
                }
            }
    /* linear_add of a bf16 linear with SwiGLU (its B fragments written by the preparation) ==
     * swiglu, linear, add; the last row alone == its row of M */
    const int I = 1280;
    qlin dd;
    make_linear(&dd, H, I, 0, 0, 0, DF_DTYPE_BF16, 0);
    float *g = malloc((size_t)R * I * 4), *u = malloc((size_t)R * I * 4), *r0 = malloc((size_t)R * H * 4);
    for (int i = 0; i < R * I; i++) {
        g[i] = 2.0f * frand();
        u[i] = frand();
    }
    for (int i = 0; i < R * H; i++) r0[i] = frand();
    float *dg = dput(be, g, (size_t)R * I * 4), *du = dput(be, u, (size_t)R * I * 4);
    float *dr = be->ops->alloc(be, (size_t)R * H * 4), *dr2 = be->ops->alloc(be, (size_t)R * H * 4);
    float *da = be->ops->alloc(be, (size_t)R * I * 4), *dl = be->ops->alloc(be, (size_t)R * H * 4);
    float *ha = malloc((size_t)R * H * 4), *hb = malloc((size_t)R * H * 4);
    linear_add_rows(be, &dd, dg, du, r0, R, 1, dr, dr2, da, dl, ha, hb, "bf16 linear_add");
    /* without SwiGLU (no preparation before it: the add in the linear's epilogue) == linear, add */
    for (int M = 1; M <= R; M++) {
        be->ops->to_device(be, dr, r0, (size_t)R * H * 4);
        be->ops->linear_add(be, &dd.L, dg, NULL, M, dr);
        be->ops->to_device(be, dr2, r0, (size_t)R * H * 4);
        be->ops->linear(be, &dd.L, dg, M, dl);
        be->ops->add(be, dr2, dl, (size_t)M * H);
        dget(be, ha, dr, (size_t)M * H * 4);
        dget(be, hb, dr2, (size_t)M * H * 4);
        if (memcmp(ha, hb, (size_t)M * H * 4) != 0) fail_msg("bf16 linear_add (M = %d) differs from linear + add", M);
    }
    float *more[] = {dg, du, dr, dr2, da, dl};
    for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) dfree_(be, more[i]);
    free_linear(&dd);
    free(g);
    free(u);
    free(r0);
    free(ha);
    free(hb);
    gpu_ok(be, "bf16 linears in one launch");
    printf("bf16 tensor-core linears in one launch (%s): == each alone, with and without a norm, 2-4 linears; "
           "linear_add with and without SwiGLU == composition; M = 1..16 == single rows\n", what);
    float *bufs[] = {dx, dh, dh2, dy[0], dy[1], dy[2], dy[3], dz[0], dz[1], dz[2], dz[3]};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) dfree_(be, bufs[i]);
    for (int i = 0; i < 4; i++) free_linear(&q[i]);
    free(x);
    free(nw);
    free(hy);
    free(hz);
}

static void test_mma_multi(void **state) {
    (void)state;
    NEED_GPU();
    mma_multi_case(g_gpu, "default tiles per warp");
    mma_multi_case(g_gpu_tr, "most tiles per warp");
}

static void test_fused(void **state) {
    (void)state;
    NEED_GPU();
    fused_case(g_gpu, "default kernels");
    fused_case(g_gpu_persist, "ring kernel on 7 CTAs");
    fused_case(g_gpu_cp, "ring fed per lane");
    fused_case(g_gpu_b8, "bulk copies up to 8 rows");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear),    cmocka_unit_test(test_scales_only),  cmocka_unit_test(test_weight_reupload),
        cmocka_unit_test(test_weight_const_range), cmocka_unit_test(test_elementwise),
        cmocka_unit_test(test_embed), cmocka_unit_test(test_ids_on_device), cmocka_unit_test(test_top_k_gpu), cmocka_unit_test(test_read_ahead_chain), cmocka_unit_test(test_staged_copies_replayed),     cmocka_unit_test(test_attention),       cmocka_unit_test(test_gdn),
        cmocka_unit_test(test_dyn_conv),  cmocka_unit_test(test_fused),           cmocka_unit_test(test_copy_overlap), cmocka_unit_test(test_copy_rows_gpu), cmocka_unit_test(test_prep_shared), cmocka_unit_test(test_mma_multi),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
