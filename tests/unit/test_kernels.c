/* Kernel exactness: for every op the decode/verify path uses, M-row results equal M
 * single-row results bit for bit, for M = 1..16 and 1, 2, 4 threads (ENGINEERING.md). */
#include "support.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "dflash/safetensors.h"

static uint64_t rng_state = 0x1234567;
static float frand(void) { /* uniform in [-1, 1) */
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) & 0xFFFFFF) / (float)(1 << 23) - 1.0f;
}
static uint32_t urand(void) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 32);
}

static uint16_t to_f16(float f) { return df_f32_to_f16(f); }

typedef struct qlin {
    df_linear L;
    uint32_t *w;
    uint16_t *s, *b;
    float *signs;
} qlin;

static void make_linear(qlin *q, int rows, int cols, int bits, int gs, int had, df_dtype dense) {
    memset(q, 0, sizeof *q);
    q->L.name = "test";
    q->L.rows = rows;
    q->L.cols = cols;
    q->L.bits = bits;
    if (bits > 0) {
        size_t words = (size_t)rows * (size_t)cols * (size_t)bits / 32;
        q->w = malloc(words * 4);
        for (size_t i = 0; i < words; i++) q->w[i] = urand();
        size_t ng = (size_t)rows * (size_t)(cols / gs);
        q->s = malloc(ng * 2);
        q->b = malloc(ng * 2);
        for (size_t i = 0; i < ng; i++) {
            q->s[i] = to_f16(0.05f * frand());
            q->b[i] = to_f16(0.05f * frand());
        }
        q->L.group_size = gs;
        q->L.wdtype = DF_DTYPE_U32;
        q->L.w = q->w;
        q->L.sdtype = DF_DTYPE_F16;
        q->L.scales = q->s;
        q->L.biases = q->b;
    } else {
        size_t n = (size_t)rows * (size_t)cols;
        if (dense == DF_DTYPE_F32) {
            float *w = malloc(n * 4);
            for (size_t i = 0; i < n; i++) w[i] = 0.1f * frand();
            q->w = (uint32_t *)w;
        } else {
            uint16_t *w = malloc(n * 2);
            for (size_t i = 0; i < n; i++) {
                float f = 0.1f * frand();
                uint32_t u;
                memcpy(&u, &f, 4);
                w[i] = dense == DF_DTYPE_BF16 ? (uint16_t)(u >> 16) : to_f16(f);
            }
            q->w = (uint32_t *)w;
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

static void check_linear(df_backend *be, const df_linear *L) {
    const int cols = L->cols, rows = L->rows;
    float *x = malloc((size_t)DF_MAX_ROWS * (size_t)cols * 4);
    float *y = malloc((size_t)DF_MAX_ROWS * (size_t)rows * 4);
    float *y1 = malloc((size_t)rows * 4);
    for (int i = 0; i < DF_MAX_ROWS * cols; i++) x[i] = frand();
    for (int M = 1; M <= DF_MAX_ROWS; M++) {
        be->ops->linear(be, L, x, M, y);
        for (int m = 0; m < M; m++) {
            be->ops->linear(be, L, x + (size_t)m * (size_t)cols, 1, y1);
            assert_memory_equal(y1, y + (size_t)m * (size_t)rows, (size_t)rows * 4);
        }
    }
    free(x);
    free(y);
    free(y1);
}

static df_backend *backend(int threads) {
    df_backend *be = NULL;
    df_error err = {0};
    assert_int_equal(df_backend_cpu_create(&be, threads, &err), DF_OK);
    return be;
}

static void test_linear_rows(void **state) {
    (void)state;
    struct {
        int rows, cols, bits, gs, had;
        df_dtype dense;
    } cases[] = {
        {40, 256, 2, 128, 256, 0},  {33, 512, 2, 128, 128, 0}, {24, 128, 4, 64, 0, 0}, {17, 256, 8, 64, 0, 0},
        {20, 192, 3, 32, 0, 0},     {9, 320, 5, 32, 0, 0},     {12, 384, 6, 64, 0, 0}, {8, 256, 0, 0, 0, DF_DTYPE_F16},
        {8, 200, 0, 0, 0, DF_DTYPE_BF16}, {5, 130, 0, 0, 0, DF_DTYPE_F32},
    };
    const int threads[] = {1, 2, 4};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        qlin q;
        make_linear(&q, cases[c].rows, cases[c].cols, cases[c].bits, cases[c].gs, cases[c].had, cases[c].dense);
        float *ref = NULL;
        float *x = malloc((size_t)DF_MAX_ROWS * (size_t)cases[c].cols * 4);
        for (int i = 0; i < DF_MAX_ROWS * cases[c].cols; i++) x[i] = frand();
        for (int t = 0; t < 3; t++) {
            df_backend *be = backend(threads[t]);
            check_linear(be, &q.L);
            float *y = malloc((size_t)DF_MAX_ROWS * (size_t)cases[c].rows * 4);
            be->ops->linear(be, &q.L, x, DF_MAX_ROWS, y);
            if (!ref) ref = y;
            else {
                assert_memory_equal(ref, y, (size_t)DF_MAX_ROWS * (size_t)cases[c].rows * 4);
                free(y);
            }
            be->ops->destroy(be);
        }
        free(ref);
        free(x);
        free_linear(&q);
    }
}

static void test_rmsnorm_rows(void **state) {
    (void)state;
    df_backend *be = backend(2);
    const int W = 200;
    float x[DF_MAX_ROWS * W], w[W], y[DF_MAX_ROWS * W], y1[W];
    for (int i = 0; i < DF_MAX_ROWS * W; i++) x[i] = frand();
    for (int i = 0; i < W; i++) w[i] = 1.0f + frand();
    for (int M = 1; M <= DF_MAX_ROWS; M++) {
        be->ops->rmsnorm(be, x, w, M, W, 1e-6f, y);
        for (int m = 0; m < M; m++) {
            be->ops->rmsnorm(be, x + m * W, w, 1, W, 1e-6f, y1);
            assert_memory_equal(y1, y + m * W, W * 4);
        }
    }
    be->ops->destroy(be);
}

/* Attention: a block of M rows at positions p0.. equals M decode steps. */
static void test_attention_rows(void **state) {
    (void)state;
    const df_attn_shape sh = {.n_heads = 4, .n_kv_heads = 2, .head_dim = 64, .rot_dims = 16,
                              .mrope_section = {3, 3, 2}, .rope_theta = 1e7f, .eps = 1e-6f, .gated = 1,
                              .causal = 1};
    const int p0 = 37, qd = 4 * 128, kd = 2 * 64, cap = p0 + DF_MAX_ROWS;
    float qn[64], kn[64];
    for (int i = 0; i < 64; i++) {
        qn[i] = 1.0f + 0.2f * frand();
        kn[i] = 1.0f + 0.2f * frand();
    }
    float *kc0 = malloc((size_t)cap * kd * 4), *vc0 = malloc((size_t)cap * kd * 4);
    for (int i = 0; i < cap * kd; i++) {
        kc0[i] = frand();
        vc0[i] = frand();
    }
    float *q = malloc(DF_MAX_ROWS * qd * 4), *k = malloc(DF_MAX_ROWS * kd * 4), *v = malloc(DF_MAX_ROWS * kd * 4);
    for (int i = 0; i < DF_MAX_ROWS * qd; i++) q[i] = frand();
    for (int i = 0; i < DF_MAX_ROWS * kd; i++) {
        k[i] = frand();
        v[i] = frand();
    }
    const int threads[] = {1, 2, 4};
    for (int t = 0; t < 3; t++) {
        df_backend *be = backend(threads[t]);
        for (int M = 1; M <= DF_MAX_ROWS; M++) {
            float *kcA = malloc((size_t)cap * kd * 4), *vcA = malloc((size_t)cap * kd * 4);
            float *kcB = malloc((size_t)cap * kd * 4), *vcB = malloc((size_t)cap * kd * 4);
            memcpy(kcA, kc0, (size_t)cap * kd * 4);
            memcpy(vcA, vc0, (size_t)cap * kd * 4);
            memcpy(kcB, kc0, (size_t)cap * kd * 4);
            memcpy(vcB, vc0, (size_t)cap * kd * 4);
            float *qa = malloc(M * qd * 4), *ka = malloc(M * kd * 4), *oa = malloc(M * 4 * 64 * 4);
            memcpy(qa, q, M * qd * 4);
            memcpy(ka, k, M * kd * 4);
            int32_t pos[DF_MAX_ROWS];
            for (int m = 0; m < M; m++) pos[m] = p0 + m;
            be->ops->attention(be, &sh, qa, ka, v, qn, kn, pos, M, kcA, vcA, p0, oa);
            for (int m = 0; m < M; m++) {
                float qb[512], kb[128], ob[256];
                memcpy(qb, q + m * qd, qd * 4);
                memcpy(kb, k + m * kd, kd * 4);
                be->ops->attention(be, &sh, qb, kb, v + m * kd, qn, kn, pos + m, 1, kcB, vcB, p0 + m, ob);
                assert_memory_equal(ob, oa + m * 256, 256 * 4);
            }
            assert_memory_equal(kcA, kcB, (size_t)(p0 + M) * kd * 4);
            free(qa);
            free(ka);
            free(oa);
            free(kcA);
            free(vcA);
            free(kcB);
            free(vcB);
        }
        be->ops->destroy(be);
    }
    free(kc0);
    free(vc0);
    free(q);
    free(k);
    free(v);
}

/* Gated DeltaNet: M rows at once equal M single steps (states and outputs). */
static void test_gdn_rows(void **state) {
    (void)state;
    const df_gdn_shape sh = {.n_k_heads = 2, .n_v_heads = 4, .k_head_dim = 32, .v_head_dim = 32, .conv_kernel = 4,
                             .eps = 1e-6f};
    const int C = 2 * 64 + 128, Vd = 128, nv = 4, K = 4;
    float conv_w[C * K], A_log[4], dt_bias[4], norm_w[32];
    for (int i = 0; i < C * K; i++) conv_w[i] = 0.5f * frand();
    for (int i = 0; i < 4; i++) {
        A_log[i] = frand();
        dt_bias[i] = frand();
    }
    for (int i = 0; i < 32; i++) norm_w[i] = 1.0f + 0.1f * frand();
    float *qkv = malloc(DF_MAX_ROWS * C * 4), *z = malloc(DF_MAX_ROWS * Vd * 4);
    float a[DF_MAX_ROWS * 4], b[DF_MAX_ROWS * 4];
    for (int i = 0; i < DF_MAX_ROWS * C; i++) qkv[i] = frand();
    for (int i = 0; i < DF_MAX_ROWS * Vd; i++) z[i] = frand();
    for (int i = 0; i < DF_MAX_ROWS * 4; i++) {
        a[i] = frand();
        b[i] = frand();
    }
    const size_t ssz = (size_t)nv * 32 * 32;
    float cs0[3 * C], *S0 = malloc(ssz * 4);
    for (int i = 0; i < 3 * C; i++) cs0[i] = frand();
    for (size_t i = 0; i < ssz; i++) S0[i] = 0.1f * frand();
    const int threads[] = {1, 2, 4};
    for (int t = 0; t < 3; t++) {
        df_backend *be = backend(threads[t]);
        for (int M = 1; M <= DF_MAX_ROWS; M++) {
            float csA[3 * C], csB[3 * C], *SA = malloc(ssz * 4), *SB = malloc(ssz * 4);
            float *oa = malloc(M * Vd * 4), ob[128];
            memcpy(csA, cs0, sizeof csA);
            memcpy(csB, cs0, sizeof csB);
            memcpy(SA, S0, ssz * 4);
            memcpy(SB, S0, ssz * 4);
            be->ops->gdn(be, &sh, qkv, z, a, b, conv_w, A_log, dt_bias, norm_w, M, csA, SA, oa);
            for (int m = 0; m < M; m++) {
                be->ops->gdn(be, &sh, qkv + m * C, z + m * Vd, a + m * nv, b + m * nv, conv_w, A_log, dt_bias, norm_w,
                             1, csB, SB, ob);
                assert_memory_equal(ob, oa + m * Vd, Vd * 4);
            }
            assert_memory_equal(csA, csB, sizeof csA);
            assert_memory_equal(SA, SB, ssz * 4);
            free(SA);
            free(SB);
            free(oa);
        }
        be->ops->destroy(be);
    }
    free(qkv);
    free(z);
    free(S0);
}

/* The elementwise ops of the verify path (embedding lookup with dequantization and inverse
 * rotation, residual add, SwiGLU): M rows at once == M single rows, bit for bit. */
static void test_elementwise_rows(void **state) {
    (void)state;
    df_backend *be = backend(2);
    qlin E;
    make_linear(&E, 64, 256, 2, 128, 256, 0);
    int32_t ids[DF_MAX_ROWS];
    for (int m = 0; m < DF_MAX_ROWS; m++) ids[m] = (int32_t)((m * 37) % 64);
    float *e = malloc(DF_MAX_ROWS * 256 * 4), e1[256];
    const int W = 96;
    float a[DF_MAX_ROWS * W], b[DF_MAX_ROWS * W], y[DF_MAX_ROWS * W], y1[W], acc[DF_MAX_ROWS * W], acc1[W];
    for (int i = 0; i < DF_MAX_ROWS * W; i++) {
        a[i] = 4.0f * frand();
        b[i] = frand();
    }
    for (int M = 1; M <= DF_MAX_ROWS; M++) {
        be->ops->embed(be, &E.L, ids, M, e);
        be->ops->swiglu(be, a, b, (size_t)M * W, y);
        memcpy(acc, b, sizeof acc);
        be->ops->add(be, acc, a, (size_t)M * W);
        for (int m = 0; m < M; m++) {
            be->ops->embed(be, &E.L, ids + m, 1, e1);
            assert_memory_equal(e1, e + m * 256, 256 * 4);
            be->ops->swiglu(be, a + m * W, b + m * W, W, y1);
            assert_memory_equal(y1, y + m * W, W * 4);
            memcpy(acc1, b + m * W, sizeof acc1);
            be->ops->add(be, acc1, a + m * W, W);
            assert_memory_equal(acc1, acc + m * W, W * 4);
        }
    }
    free(e);
    free_linear(&E);
    be->ops->destroy(be);
}

/* copy_rows: rows of a strided source into their places in a strided destination (the taps of a
 * verify pass gathered into the drafter's [rows, n_taps·hidden] layout), nothing else touched. */
static void test_copy_rows(void **state) {
    (void)state;
    df_backend *be = backend(1);
    enum { ROWS = 5, W = 24, SP = 40, DP = 120 };
    float src[ROWS * SP], dst[ROWS * DP], want[ROWS * DP];
    for (int i = 0; i < ROWS * SP; i++) src[i] = (float)i;
    for (int i = 0; i < ROWS * DP; i++) dst[i] = want[i] = -1.0f;
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < W; j++) want[r * DP + 48 + j] = src[r * SP + j];
    assert_non_null(be->ops->copy_rows);
    be->ops->copy_rows(be, dst + 48, DP * sizeof(float), src, SP * sizeof(float), W * sizeof(float), ROWS);
    assert_memory_equal(dst, want, sizeof dst);
    be->ops->destroy(be);
}

/* The Hadamard transform is orthogonal: applying it twice gives the input back. */
static void test_hadamard_involution(void **state) {
    (void)state;
    float x[512], y[512];
    for (int i = 0; i < 512; i++) x[i] = frand();
    memcpy(y, x, sizeof x);
    df_hadamard_inplace(y, 512, 128);
    df_hadamard_inplace(y, 512, 128);
    for (int i = 0; i < 512; i++) assert_true(fabsf(x[i] - y[i]) < 1e-5f);
    /* H2 on (1, 0) = (1, 1)/sqrt(2) */
    float e[2] = {1.0f, 0.0f};
    df_hadamard_inplace(e, 2, 2);
    assert_true(fabsf(e[0] - 0.70710678f) < 1e-6f && fabsf(e[1] - 0.70710678f) < 1e-6f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear_rows),
        cmocka_unit_test(test_rmsnorm_rows),
        cmocka_unit_test(test_attention_rows),
        cmocka_unit_test(test_gdn_rows),
        cmocka_unit_test(test_elementwise_rows),
        cmocka_unit_test(test_hadamard_involution),
        cmocka_unit_test(test_copy_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
