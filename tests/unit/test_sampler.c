/* Sampler tests: greedy ties, seeded reproducibility, top-k/top-p/min-p truncation,
 * penalties, logit bias and logprobs. */
#include "support.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "dflash/generate.h"

static void test_greedy_and_ties(void **state) {
    (void)state;
    float l[5] = {1, 3, 3, 2, -1};
    assert_int_equal(df_argmax(l, 5), 1);
    df_sampling_params p = df_sampling_default();
    df_sampler s;
    df_sampler_init(&s, &p);
    assert_int_equal(df_sampler_sample(&s, l, 5), 1);
    df_sampler_free(&s);
}

static void test_seed_reproducible_and_truncation(void **state) {
    (void)state;
    float l[100];
    for (int i = 0; i < 100; i++) l[i] = (float)(i % 17) * 0.3f;
    df_sampling_params p = df_sampling_default();
    p.temperature = 1.0f;
    p.seed = 42;
    p.has_seed = 1;
    int32_t a[50], b[50];
    df_sampler s;
    df_sampler_init(&s, &p);
    for (int i = 0; i < 50; i++) a[i] = df_sampler_sample(&s, l, 100);
    df_sampler_free(&s);
    df_sampler_init(&s, &p);
    for (int i = 0; i < 50; i++) b[i] = df_sampler_sample(&s, l, 100);
    df_sampler_free(&s);
    assert_memory_equal(a, b, sizeof a);
    int distinct = 0;
    for (int i = 1; i < 50; i++) distinct += a[i] != a[0];
    assert_true(distinct > 0);
    /* top-k 1 == greedy */
    p.top_k = 1;
    df_sampler_init(&s, &p);
    for (int i = 0; i < 20; i++) assert_int_equal(df_sampler_sample(&s, l, 100), df_argmax(l, 100));
    df_sampler_free(&s);
    /* top-k 3: only ids with the 3 highest logits (16, 33, 50 have 4.8) */
    p.top_k = 3;
    df_sampler_init(&s, &p);
    for (int i = 0; i < 50; i++) {
        int32_t id = df_sampler_sample(&s, l, 100);
        assert_true(id == 16 || id == 33 || id == 50);
    }
    df_sampler_free(&s);
    /* min-p 0.9 keeps only near-maximal tokens */
    p.top_k = 0;
    p.min_p = 0.9f;
    df_sampler_init(&s, &p);
    for (int i = 0; i < 50; i++) assert_true(l[df_sampler_sample(&s, l, 100)] >= 4.8f - 1e-6f);
    df_sampler_free(&s);
    /* top-p tiny keeps the single best candidate (lowest id among equals first) */
    p.min_p = 0.0f;
    p.top_p = 0.01f;
    df_sampler_init(&s, &p);
    for (int i = 0; i < 20; i++) assert_int_equal(df_sampler_sample(&s, l, 100), 16);
    df_sampler_free(&s);
}

/* The filters as plainly defined: every candidate sorted by rank (logit, then id), the top k,
 * unnormalised probabilities exp((l - max) / T), the shortest rank prefix reaching top_p of
 * their sum, those with at least min_p of the best's. Marks the kept ids in keep[] and their
 * probabilities in prob[] (normalised); returns how many. */
static const float *g_ref_logits;
static int ref_cmp(const void *a, const void *b) {
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    const float x = g_ref_logits[i], y = g_ref_logits[j];
    if (x > y) return -1;
    if (x < y) return 1;
    return (i > j) - (i < j);
}
static int ref_filters(const float *l, int V, const df_sampling_params *p, unsigned char *keep, double *prob) {
    int32_t *ids = malloc((size_t)V * sizeof *ids);
    double *pr = malloc((size_t)V * sizeof *pr);
    for (int i = 0; i < V; i++) ids[i] = i;
    g_ref_logits = l;
    qsort(ids, (size_t)V, sizeof *ids, ref_cmp);
    int n = p->top_k > 0 && p->top_k < V ? p->top_k : V;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        pr[i] = expf((l[ids[i]] - l[ids[0]]) / p->temperature);
        sum += pr[i];
    }
    if (p->top_p > 0 && p->top_p < 1) {
        double c = 0;
        for (int i = 0; i < n; i++) {
            c += pr[i];
            if (c >= p->top_p * sum) {
                n = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0) {
        int k = 1;
        while (k < n && pr[k] >= p->min_p) k++;
        n = k;
    }
    double total = 0;
    for (int i = 0; i < n; i++) total += pr[i];
    memset(keep, 0, (size_t)V);
    for (int i = 0; i < V; i++) prob[i] = 0;
    for (int i = 0; i < n; i++) {
        keep[ids[i]] = 1;
        prob[ids[i]] = pr[i] / total;
    }
    free(ids);
    free(pr);
    return n;
}

/* Draws `draws` tokens and checks them against ref_filters: every draw kept, and every kept
 * token expected at least 25 times drawn within 6 standard deviations of its expectation. */
static void check_draws(const float *l, int V, df_sampling_params p, int draws) {
    unsigned char *keep = malloc((size_t)V);
    double *prob = malloc((size_t)V * sizeof *prob);
    int *count = calloc((size_t)V, sizeof *count);
    ref_filters(l, V, &p, keep, prob);
    p.seed = 7;
    p.has_seed = 1;
    df_sampler s;
    df_sampler_init(&s, &p);
    for (int d = 0; d < draws; d++) {
        const int32_t id = df_sampler_sample(&s, (float *)l, V);
        assert_true(id >= 0 && id < V);
        if (!keep[id]) fail_msg("drew id %d, outside the kept set (top_k %d, top_p %g, min_p %g)", id, p.top_k,
                                (double)p.top_p, (double)p.min_p);
        count[id]++;
    }
    df_sampler_free(&s);
    for (int i = 0; i < V; i++) {
        const double e = prob[i] * draws;
        if (e >= 25 && fabs(count[i] - e) > 6 * sqrt(e))
            fail_msg("id %d drawn %d times, expected %.1f (top_k %d, top_p %g, min_p %g)", i, count[i], e, p.top_k,
                     (double)p.top_p, (double)p.min_p);
    }
    free(keep);
    free(prob);
    free(count);
}

/* The filters at the real vocabulary's size against their plain definition: exact boundaries
 * (ties at the top-k cut go to the lower id; the top-p cut is the shortest prefix; min-p), many
 * candidates sharing one logit, a flat distribution whose nucleus is half the vocabulary, and
 * random peaked logits (a smaller vocabulary) with every combination of filters. */
static void test_filters_large_vocab(void **state) {
    (void)state;
    enum { V = 248320 };
    float *l = malloc(V * sizeof *l);
    df_sampling_params p = df_sampling_default();
    p.temperature = 1.0f;
    /* a head of four with a tie, the rest negligible (e^-35 of the best each) */
    for (int i = 0; i < V; i++) l[i] = -30.0f;
    l[7] = 5.0f;
    l[100000] = 4.0f;
    l[200000] = 4.0f;
    l[3] = 3.0f;
    unsigned char *keep = malloc(V);
    double *prob = malloc(V * sizeof *prob);
    p.top_p = 0.6f; /* cumulative 0.534, 0.731, ...: keeps 7 and 100000 */
    assert_int_equal(ref_filters(l, V, &p, keep, prob), 2);
    assert_true(keep[7] && keep[100000]);
    check_draws(l, V, p, 400);
    p.top_p = 1.0f;
    p.top_k = 2; /* the tie at 4.0 goes to the lower id */
    assert_int_equal(ref_filters(l, V, &p, keep, prob), 2);
    assert_true(keep[7] && keep[100000]);
    check_draws(l, V, p, 400);
    p.top_k = 0;
    p.min_p = 0.3f; /* e^-1 = 0.37 kept, e^-2 = 0.14 not */
    assert_int_equal(ref_filters(l, V, &p, keep, prob), 3);
    check_draws(l, V, p, 400);
    p.min_p = 0.0f;
    /* 200 candidates with one logit: top-k 100 keeps the 100 lowest ids of them */
    for (int i = 0; i < V; i++) l[i] = -30.0f;
    for (int i = 0; i < 200; i++) l[(i * 241) % V] = 2.0f;
    p.top_k = 100;
    assert_int_equal(ref_filters(l, V, &p, keep, prob), 100);
    check_draws(l, V, p, 600);
    /* the same with signed zeros (-0 and +0 tie: the lower ids) */
    for (int i = 0; i < 200; i++) l[(i * 241) % V] = i % 2 ? -0.0f : 0.0f;
    assert_int_equal(ref_filters(l, V, &p, keep, prob), 100);
    check_draws(l, V, p, 600);
    for (int i = 0; i < 200; i++) l[(i * 241) % V] = 2.0f;
    p.top_k = 0;
    p.top_p = 0.5025f; /* 101 of them (a target on an exact prefix sum would hang on the sums' rounding) */
    assert_int_equal(ref_filters(l, V, &p, keep, prob), 101);
    check_draws(l, V, p, 600);
    /* flat: the nucleus of top-p 0.5 is about half the vocabulary; top_k 100000 on it */
    unsigned x = 12345;
    for (int i = 0; i < V; i++) {
        x = x * 1664525u + 1013904223u;
        l[i] = (float)(x >> 8) / 16777216.0f * 0.05f;
    }
    p.top_p = 0.5f;
    check_draws(l, V, p, 300);
    p.top_k = 100000;
    check_draws(l, V, p, 300);
    /* peaked (over the first 32768 ids): a few dozen tokens carry the mass */
    const int V2 = 32768;
    for (int i = 0; i < V2; i++) {
        x = x * 1664525u + 1013904223u;
        const float u = (float)(x >> 8) / 16777216.0f;
        l[i] = -8.0f + 4.0f * u + ((x >> 3) % 1000 == 0 ? 10.0f * u : 0.0f);
    }
    const int ks[3] = {0, 40, 5000};
    const float tps[3] = {1.0f, 0.9f, 0.3f}, mps[2] = {0.0f, 0.05f};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 2; c++) {
                p.top_k = ks[a];
                p.top_p = tps[b];
                p.min_p = mps[c];
                p.temperature = c ? 0.7f : 1.3f;
                check_draws(l, V2, p, 600);
            }
    free(keep);
    free(prob);
    free(l);
}

/* Sampling from the k best candidates (as a backend's top_k gives them) draws the same tokens
 * as sampling from the whole vocabulary, for every filter combination with a top-k up to
 * DF_SAMPLE_TOP_MAX; df_top_k_host ranks by value then index; a bad list gives -1. */
static void test_sample_from_top_k(void **state) {
    (void)state;
    enum { V = 5000 };
    float *l = malloc(V * sizeof *l);
    unsigned x = 99;
    int32_t ids[DF_SAMPLE_TOP_MAX];
    float vals[DF_SAMPLE_TOP_MAX];
    const int ks[4] = {1, 7, 40, DF_SAMPLE_TOP_MAX};
    for (int rep = 0; rep < 6; rep++) {
        for (int i = 0; i < V; i++) {
            x = x * 1664525u + 1013904223u;
            /* coarse values: many ties; a few -inf */
            l[i] = rep % 3 == 2 && i % 97 == 0 ? -INFINITY : (float)((x >> 20) % 200) * 0.05f - 5.0f;
        }
        for (int a = 0; a < 4; a++) {
            df_sampling_params p = df_sampling_default();
            p.temperature = rep % 2 ? 0.6f : 1.4f;
            p.top_k = ks[a];
            p.top_p = rep % 3 == 0 ? 1.0f : 0.7f;
            p.min_p = rep % 3 == 1 ? 0.2f : 0.0f;
            p.seed = 1000u + (unsigned)rep;
            p.has_seed = 1;
            df_top_k_host(l, V, p.top_k, ids, vals);
            for (int j = 1; j < p.top_k; j++) /* rank order: value descending, lower id first on ties */
                assert_true(vals[j] < vals[j - 1] || (vals[j] == vals[j - 1] && ids[j] > ids[j - 1]));
            for (int i = 0; i < V; i++) /* nothing left out ranks above the last */
                if (l[i] > vals[p.top_k - 1] || (l[i] == vals[p.top_k - 1] && i < ids[p.top_k - 1])) {
                    int in = 0;
                    for (int j = 0; j < p.top_k; j++) in |= ids[j] == i;
                    assert_true(in);
                }
            df_sampler full, top;
            df_sampler_init(&full, &p);
            df_sampler_init(&top, &p);
            assert_true(df_sampler_top_k_only(&top, V));
            for (int d = 0; d < 200; d++) {
                const int32_t want = df_sampler_sample(&full, l, V);
                const int32_t got = df_sampler_sample_top(&top, ids, vals, p.top_k, V);
                if (got != want) fail_msg("rep %d, top_k %d, draw %d: %d from the top-k list, %d from all", rep, p.top_k, d, got, want);
            }
            df_sampler_free(&full);
            df_sampler_free(&top);
        }
    }
    df_sampling_params p = df_sampling_default();
    p.temperature = 1.0f;
    p.top_k = 3;
    df_sampler s;
    df_sampler_init(&s, &p);
    int32_t bid[3] = {4, 2, 9};
    float bv[3] = {3.0f, 2.0f, 1.0f};
    assert_true(df_sampler_sample_top(&s, bid, bv, 3, V) >= 0);
    assert_int_equal(df_sampler_sample_top(&s, bid, bv, 2, V), -1); /* k is not top_k */
    bv[2] = 2.5f;
    assert_int_equal(df_sampler_sample_top(&s, bid, bv, 3, V), -1); /* out of order */
    bv[2] = 1.0f;
    bid[1] = V;
    assert_int_equal(df_sampler_sample_top(&s, bid, bv, 3, V), -1); /* outside the vocabulary */
    bid[1] = 2;
    bid[0] = -1;
    assert_int_equal(df_sampler_sample_top(&s, bid, bv, 3, V), -1); /* a NaN among the logits */
    bid[0] = 4;
    bv[0] = INFINITY;
    assert_int_equal(df_sampler_sample_top(&s, bid, bv, 3, V), -1); /* an infinite maximum */
    df_sampler_free(&s);
    p.repetition_penalty = 1.2f; /* a processor: the whole vocabulary is needed */
    df_sampler_init(&s, &p);
    assert_false(df_sampler_top_k_only(&s, V));
    df_sampler_free(&s);
    /* NaN rows */
    l[123] = NAN;
    df_top_k_host(l, V, 5, ids, vals);
    assert_int_equal(ids[0], -1);
    free(l);
}

/* df_sample_top_list (the draw from a rank-ordered list: the sampler's top-k path and the CUDA
 * backend's sample_top_dev) against cases worked by hand and the distribution it must draw. */
static void test_top_list_draw(void **state) {
    (void)state;
    const uint64_t one = 1ull << 53; /* u is 53 bits: r = u / 2^53 */
    const int32_t ids[4] = {11, 7, 30, 2};
    const float flat[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    df_top_draw d = {.k = 4, .temperature = 1.0f, .top_p = 1.0f, .min_p = 0.0f};
    /* equal logits: four terms of 1, r·4 against the running sums 1, 2, 3, 4 (strictly below) */
    assert_int_equal(df_sample_top_list(ids, flat, 4, &d, 0), 11);
    assert_int_equal(df_sample_top_list(ids, flat, 4, &d, one / 4 - 1), 11);
    assert_int_equal(df_sample_top_list(ids, flat, 4, &d, one / 4), 7); /* r·4 = 1: not below 1 */
    assert_int_equal(df_sample_top_list(ids, flat, 4, &d, one / 2), 30);
    assert_int_equal(df_sample_top_list(ids, flat, 4, &d, one - 1), 2);
    /* top-p 0.5: the shortest prefix reaching 2 of 4 is two candidates */
    d.top_p = 0.5f;
    assert_int_equal(df_sample_top_list(ids, flat, 4, &d, one / 2 - 1), 11);
    assert_int_equal(df_sample_top_list(ids, flat, 4, &d, one / 2), 7);
    assert_int_equal(df_sample_top_list(ids, flat, 4, &d, one - 1), 7);
    d.top_p = 0.51f; /* just past two: three */
    assert_int_equal(df_sample_top_list(ids, flat, 4, &d, one - 1), 30);
    /* min-p: terms e^0, e^-1, e^-2, e^-3 = 1, 0.37, 0.14, 0.05; 0.2 keeps two, 0.1 three */
    const float lg[4] = {0.0f, -1.0f, -2.0f, -3.0f};
    d.top_p = 1.0f;
    d.min_p = 0.2f;
    assert_int_equal(df_sample_top_list(ids, lg, 4, &d, one - 1), 7);
    d.min_p = 0.1f;
    assert_int_equal(df_sample_top_list(ids, lg, 4, &d, one - 1), 30);
    /* the temperature divides the logit gaps: at T = 0.5 the second term is e^-2 */
    d.min_p = 0.2f;
    d.temperature = 0.5f;
    assert_int_equal(df_sample_top_list(ids, lg, 4, &d, one - 1), 11);
    d.temperature = 2.0f; /* e^-0.5, e^-1, e^-1.5 = 0.61, 0.37, 0.22: all four kept */
    assert_int_equal(df_sample_top_list(ids, lg, 4, &d, one - 1), 2);
    /* the terms: e^x to 3e-7 relative (the polynomial), plus the float rounding of x·log2(e)
     * (half an ulp of |x|·1.44: |x|·2^-24 relative in the result), 0 below -87 */
    for (float x = -86.9f; x <= 0.0f; x += 0.0137f) {
        const double e = exp((double)x), got = (double)df_exp_nonpos(x), tol = 3e-7 + 1.2e-7 * fabs((double)x);
        if (fabs(got - e) > tol * e) fail_msg("df_exp_nonpos(%g) = %.9g, e^x = %.9g", (double)x, got, e);
    }
    assert_true(df_exp_nonpos(-87.5f) == 0.0f && df_exp_nonpos(-INFINITY) == 0.0f && df_exp_nonpos(0.0f) == 1.0f);
    /* the draws follow the terms: 200000 draws of a sampler's bits over e^0, e^-0.5, e^-1, e^-2 */
    df_sampling_params p = df_sampling_default();
    p.temperature = 1.0f;
    p.seed = 5;
    p.has_seed = 1;
    df_sampler s;
    df_sampler_init(&s, &p);
    const float lv[4] = {0.0f, -0.5f, -1.0f, -2.0f};
    d = (df_top_draw){.k = 4, .temperature = 1.0f, .top_p = 1.0f, .min_p = 0.0f};
    int count[4] = {0, 0, 0, 0};
    enum { N = 200000 };
    for (int i = 0; i < N; i++) {
        const uint64_t u = df_sampler_draw_bits(&s);
        assert_true(u < one);
        const int32_t id = df_sample_top_list(ids, lv, 4, &d, u);
        for (int j = 0; j < 4; j++) count[j] += id == ids[j];
    }
    df_sampler_free(&s);
    double z = 0.0;
    for (int j = 0; j < 4; j++) z += exp((double)lv[j]);
    for (int j = 0; j < 4; j++) {
        const double want = exp((double)lv[j]) / z, got = (double)count[j] / N;
        if (fabs(got - want) > 0.005) fail_msg("candidate %d drawn %.4f of the time, expected %.4f", j, got, want);
    }
}

/* A temperature so small that its reciprocal is not a float (a subnormal, down to the smallest)
 * still samples the best token, with every filter (the terms are (l - max) / T, never
 * (l - max) * (1 / T), whose 0 * inf would be NaN). */
static void test_tiny_temperature(void **state) {
    (void)state;
    enum { V = 3000 };
    float *l = malloc(V * sizeof *l);
    for (int i = 0; i < V; i++) l[i] = (float)((i * 37) % 101) * 0.01f - 0.5f;
    l[1234] = 2.0f;
    const float ts[4] = {1e-40f, 1e-44f, 1.4e-45f, 1e-30f};
    for (int a = 0; a < 4; a++)
        for (int f = 0; f < 4; f++) {
            df_sampling_params p = df_sampling_default();
            p.temperature = ts[a];
            p.top_k = f == 1 ? 2 : (f == 2 ? 1000 : 0);
            p.min_p = f == 3 ? 0.5f : 0.0f;
            p.seed = 3;
            p.has_seed = 1;
            df_sampler s;
            df_sampler_init(&s, &p);
            for (int d = 0; d < 5; d++) assert_int_equal(df_sampler_sample(&s, l, V), 1234);
            df_sampler_free(&s);
        }
    free(l);
}

static void test_processors(void **state) {
    (void)state;
    float l[6] = {2, -2, 1, 0, 0.5f, 3};
    df_sampling_params p = df_sampling_default();
    assert_false(df_sampling_has_processors(&p));
    p.repetition_penalty = 2.0f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    df_logit_bias bias[1] = {{3, 10.0f}};
    p.logit_bias = bias;
    p.n_logit_bias = 1;
    assert_true(df_sampling_has_processors(&p));
    int32_t prompt[2] = {0, 1}, gen[3] = {2, 2, 5};
    df_sampling_apply_processors(&p, l, 6, prompt, 2, gen, 3);
    assert_true(fabsf(l[0] - 1.0f) < 1e-6f);              /* 2 / 2 */
    assert_true(fabsf(l[1] - -4.0f) < 1e-6f);             /* -2 * 2 */
    assert_true(fabsf(l[2] - (0.5f - 0.5f - 0.5f)) < 1e-6f); /* 1/2 - 0.5 - 0.25*2 */
    assert_true(fabsf(l[3] - 10.0f) < 1e-6f);             /* bias */
    assert_true(fabsf(l[4] - 0.5f) < 1e-6f);              /* untouched */
    assert_true(fabsf(l[5] - (1.5f - 0.5f - 0.25f)) < 1e-6f);
    /* a penalty near 0 keeps the logits finite: a seen positive logit becomes the largest float */
    float t[3] = {5.0f, -1.0f, 0.5f}; /* 5 / FLT_MIN is past FLT_MAX */
    df_sampling_params q = df_sampling_default();
    q.repetition_penalty = FLT_MIN;
    int32_t seen[2] = {0, 1};
    df_sampling_apply_processors(&q, t, 3, seen, 2, NULL, 0);
    assert_true(t[0] == FLT_MAX);
    assert_true(isfinite(t[1]) && t[1] < 0.0f);
    assert_true(t[2] == 0.5f);
}

static void test_token_info(void **state) {
    (void)state;
    float l[4] = {0, 1, 2, 2};
    df_token_info info;
    df_token_info_compute(&info, l, 4, 1, 3);
    double lse = log(exp(0) + exp(1) + 2 * exp(2));
    assert_true(fabs(info.logprob - (1 - lse)) < 1e-5);
    assert_int_equal(info.n_top, 3);
    assert_int_equal(info.top[0].id, 2); /* ties: lower id first */
    assert_int_equal(info.top[1].id, 3);
    assert_int_equal(info.top[2].id, 1);
    assert_true(fabs(info.top[0].logprob - (2 - lse)) < 1e-5);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_and_ties),
        cmocka_unit_test(test_seed_reproducible_and_truncation),
        cmocka_unit_test(test_filters_large_vocab),
        cmocka_unit_test(test_sample_from_top_k),
        cmocka_unit_test(test_top_list_draw),
        cmocka_unit_test(test_tiny_temperature),
        cmocka_unit_test(test_processors),
        cmocka_unit_test(test_token_info),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
