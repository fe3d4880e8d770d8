/* Sampler tests: greedy ties, seeded reproducibility, top-k/top-p/min-p truncation,
 * penalties, logit bias and logprobs. */
#include "support.h"

#include <float.h>
#include <math.h>
#include <string.h>

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
        cmocka_unit_test(test_processors),
        cmocka_unit_test(test_token_info),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
