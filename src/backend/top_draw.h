/* The draw from a rank-ordered list of candidates (backend.h df_sample_top_list), as inline
 * functions that the C sources and the CUDA kernels compile from this one text: the same float32
 * and double operations in the same order on the host and on a GPU (both built without fused
 * multiply-add contraction and with IEEE division), so the same token for the same bits. */
#ifndef DFLASH_BACKEND_TOP_DRAW_H
#define DFLASH_BACKEND_TOP_DRAW_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define DF_HD __host__ __device__
#else
#define DF_HD
#endif

/* backend.h df_exp_nonpos: e^x for x <= 0 (0 below -87) as 2^n · 2^f, n = x·log2(e) rounded to
 * nearest, 2^f by its degree-6 Taylor polynomial. */
static inline DF_HD float df_exp_nonpos_inl(float x) {
    const float t0 = x * 1.44269504f, tc = t0 > -126.0f ? t0 : -126.0f;
    const float n = (tc + 12582912.0f) - 12582912.0f; /* round to nearest (|tc| < 2^22) */
    const float f = tc - n;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) * (1 << 23);
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x >= -87.0f ? p * scale : 0.0f;
}

/* The term of a candidate with logit v when the best has v0, at temperature t: e^((v − v0) / t)
 * (a division, not a product by 1/t: a subnormal t has no finite reciprocal). */
static inline DF_HD float df_top_term(float v, float v0, float t) { return df_exp_nonpos_inl((v - v0) / t); }

/* df_sample_top_list's filters and draw from the terms p[0..n) (rank order, p[0] = 1) of the
 * candidates ids[0..n): top-p (off unless 0 < top_p < 1), min-p (off unless min_p > 0), and u
 * (53 random bits). */
static inline DF_HD int32_t df_top_draw_terms(const int32_t *ids, const float *p, int n, float top_p, float min_p,
                                              uint64_t u) {
    double sum = 0.0;
    for (int j = 0; j < n; j++) sum += p[j];
    if (top_p > 0.0f && top_p < 1.0f) { /* the shortest prefix reaching top_p of the sum */
        const double want = (double)top_p * sum;
        double got = 0.0;
        for (int j = 0; j < n; j++) {
            got += p[j];
            if (got >= want) {
                n = j + 1;
                break;
            }
        }
    }
    const int mp = min_p > 0.0f;
    double total = 0.0;
    int last = -1;
    for (int j = 0; j < n; j++)
        if (!mp || p[j] >= min_p) {
            total += p[j];
            last = j;
        }
    if (last < 0) return ids[0]; /* min_p above 1: the best one (p[0] = 1) */
    const double r = (double)u * (1.0 / 9007199254740992.0) * total;
    double c = 0.0;
    for (int j = 0; j < n; j++)
        if (!mp || p[j] >= min_p) {
            c += p[j];
            if (r < c) return ids[j];
        }
    return ids[last];
}

#endif
