/* Non-finite logits: df_argmax, the sampler and the backend argmax report them (-1), and
 * generation fails with DF_ERR_NUMERIC instead of emitting tokens, plainly and speculatively:
 * on a pack whose every F16 tensor is NaN (the first token fails), and on one where a single
 * token's embedding is NaN (generation fails on the token after it, where plain decoding first
 * reads non-finite logits). */
#include "support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "dflash/speculative.h"
#include "model/target.h"
#include "st_write.h"

static void test_argmax_and_sampler(void **state) {
    (void)state;
    float l[6] = {0.5f, 2.0f, -1.0f, 2.0f, 0.0f, 1.0f};
    assert_int_equal(df_argmax(l, 6), 1);
    const float bad[] = {NAN, INFINITY, -INFINITY};
    const int where[] = {0, 3, 5};
    df_sampling_params sp = df_sampling_default();
    for (int b = 0; b < 3; b++) {
        for (int w = 0; w < 3; w++) {
            float x[6];
            memcpy(x, l, sizeof x);
            if (bad[b] < 0) /* -inf is a fine logit unless every logit is -inf */
                for (int i = 0; i < 6; i++) x[i] = bad[b];
            else
                x[where[w]] = bad[b];
            assert_int_equal(df_argmax(x, 6), -1);
            for (int t = 0; t < 2; t++) {
                sp.temperature = t ? 0.8f : 0.0f;
                sp.top_k = t ? 3 : 0;
                df_sampler s;
                df_sampler_init(&s, &sp);
                assert_int_equal(df_sampler_sample(&s, x, 6), -1);
                df_sampler_free(&s);
            }
        }
    }
    l[2] = -INFINITY; /* one masked-out logit is fine */
    assert_int_equal(df_argmax(l, 6), 1);
    /* the backend argmax op, row by row */
    df_backend *be = NULL;
    df_error err = {0};
    assert_int_equal(df_backend_cpu_create(&be, 1, &err), DF_OK);
    float rows[3][6];
    for (int r = 0; r < 3; r++) memcpy(rows[r], l, sizeof l);
    rows[1][4] = NAN;
    float *dx = be->ops->alloc(be, sizeof rows);
    be->ops->to_device(be, dx, rows, sizeof rows);
    int32_t out[3];
    be->ops->argmax(be, dx, 3, 6, out);
    assert_int_equal(out[0], 1);
    assert_int_equal(out[1], -1);
    assert_int_equal(out[2], 1);
    /* argmax_dev: the same ids in backend memory, `bad` in place of -1 */
    int32_t *di = be->ops->alloc(be, sizeof out);
    for (int bad = -1; bad <= 0; bad++) {
        be->ops->argmax_dev(be, dx, 3, 6, di, bad);
        be->ops->to_host(be, out, di, sizeof out);
        assert_int_equal(out[0], 1);
        assert_int_equal(out[1], bad);
        assert_int_equal(out[2], 1);
    }
    be->ops->dealloc(be, di);
    be->ops->dealloc(be, dx);
    be->ops->destroy(be);
}

/* A copy of tiny-bonsai2 in a fresh folder, with F16 tensors poisoned: every one (id < 0), or
 * the embedding scales of token id only. */
static const char *poisoned_pack(int32_t id) {
    static char d[1024];
    snprintf(d, sizeof d, "%s", tw_subdir(tw_dir));
    tw_pack_copy(tu_fixture("tiny-bonsai2"), d);
    tw_copy(tu_fixture("tiny-bonsai2/tokenizer.json"), tw_path(d, "tokenizer.json"));
    tw_file f;
    tw_read(&f, tw_path(d, "model.safetensors"));
    for (size_t i = 0; i < f.n; i++) {
        tw_tensor *t = &f.t[i];
        if (strcmp(t->dtype, "F16") != 0) continue;
        size_t from = 0, to = t->nbytes;
        if (id >= 0) {
            if (strcmp(t->name, "language_model.model.embed_tokens.scales") != 0) continue;
            const size_t row = t->nbytes / (size_t)t->shape[0];
            from = (size_t)id * row;
            to = from + row;
        }
        for (size_t k = from; k + 1 < to; k += 2) {
            t->data[k] = 0xff;
            t->data[k + 1] = 0x7f; /* F16 NaN */
        }
    }
    tw_save(&f, tw_path(d, "model.safetensors"));
    tw_free(&f);
    return d;
}

typedef struct gen_run {
    df_status st;
    df_gen_result res;
    char msg[DF_ERROR_MSG_MAX];
} gen_run;

/* Greedy generation of max_tokens on the pack in dir: plain (spec 0), speculative with the
 * tiny-dflash drafter (1), or sampled (2). */
static gen_run generate_on(const char *dir, int spec, const int32_t *prompt, int n, int max_tokens) {
    df_engine *eng = NULL;
    df_session *s = NULL;
    df_drafter *d = NULL;
    df_draft_state *ds = NULL;
    df_error err = {0};
    df_engine_options eo = {.n_threads = 2};
    assert_int_equal(df_engine_load(&eng, dir, &eo, &err), DF_OK);
    assert_int_equal(df_session_init(&s, eng, 256, &err), DF_OK);
    df_gen_params gp = df_gen_params_default();
    gp.max_tokens = max_tokens;
    gen_run r;
    memset(&r, 0, sizeof r);
    if (spec == 1) {
        assert_int_equal(df_drafter_load(&d, tu_fixture("tiny-dflash"), eng, &err), DF_OK);
        assert_int_equal(df_draft_state_init(&ds, d, 64, &err), DF_OK);
        df_spec_params sp = df_spec_params_default();
        sp.no_fallback = 1;
        r.st = df_generate_speculative(s, ds, prompt, n, &gp, &sp, NULL, NULL, &r.res, &err);
    } else {
        if (spec == 2) {
            gp.sampling.temperature = 0.9f;
            gp.sampling.seed = 7;
            gp.sampling.has_seed = 1;
        }
        r.st = df_generate(s, prompt, n, &gp, NULL, NULL, &r.res, &err);
    }
    snprintf(r.msg, sizeof r.msg, "%s", err.msg);
    df_draft_state_free(ds);
    df_drafter_free(d);
    df_session_free(s);
    df_engine_free(eng);
    return r;
}

static void test_nan_pack_fails(void **state) {
    (void)state;
    const char *dir = poisoned_pack(-1);
    const int32_t prompt[] = {11, 12, 13, 14};
    for (int spec = 0; spec < 3; spec++) {
        gen_run r = generate_on(dir, spec, prompt, 4, 8);
        assert_int_equal(r.st, DF_ERR_NUMERIC);
        assert_int_equal(r.res.n_ids, 0);
        assert_non_null(strstr(r.msg, "non-finite logits"));
        assert_non_null(strstr(r.msg, "at the first generated token"));
        df_gen_result_free(&r.res);
    }
}

static int contains(const int32_t *a, int n, int32_t v) {
    for (int i = 0; i < n; i++)
        if (a[i] == v) return 1;
    return 0;
}

static void test_one_nan_token_fails_after_it(void **state) {
    (void)state;
    const int32_t prompt[] = {101, 7, 333, 42, 1500, 9};
    gen_run ok = generate_on(tu_fixture("tiny-bonsai2"), 0, prompt, 6, 24);
    assert_int_equal(ok.st, DF_OK);
    /* the first generated token, from the third on, that the prompt and the earlier output lack */
    int k = 2;
    while (k < ok.res.n_ids &&
           (contains(prompt, 6, ok.res.ids[k]) || contains(ok.res.ids, k, ok.res.ids[k])))
        k++;
    assert_true(k < ok.res.n_ids - 1);
    const char *dir = poisoned_pack(ok.res.ids[k]);
    char want[64];
    snprintf(want, sizeof want, "at generated token %d (0-based position)", k + 1);
    for (int spec = 0; spec < 2; spec++) {
        gen_run r = generate_on(dir, spec, prompt, 6, 24);
        assert_int_equal(r.st, DF_ERR_NUMERIC);
        assert_non_null(strstr(r.msg, want));
        assert_int_equal(r.res.n_ids, k + 1); /* the tokens up to the poisoned one were generated */
        assert_memory_equal(r.res.ids, ok.res.ids, (size_t)(k + 1) * sizeof(int32_t));
        df_gen_result_free(&r.res);
    }
    df_gen_result_free(&ok.res);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_argmax_and_sampler),
        cmocka_unit_test(test_nan_pack_fails),
        cmocka_unit_test(test_one_nan_token_fails_after_it),
    };
    return cmocka_run_group_tests(tests, tw_setup, tw_teardown);
}
