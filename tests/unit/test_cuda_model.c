/* The whole model on the CUDA backend (needs a GPU; skips with a message without one or in a
 * build without the CUDA backend), on tests/fixtures/tiny-bonsai2 + tiny-dflash:
 * - prompt logits vs the Hugging Face reference within 1e-2 relative (and the greedy ids);
 * - bitwise: the last logits of a prompt prefilled in 16-row tiles == prefilled one token at
 *   a time (every row of every op computed with its single-row bits);
 * - the device argmax path == argmax of the logits;
 * - sampled decoding: tokens drawn on the device == the host's draws;
 * - speculative greedy == plain greedy, token for token, with the real drafter and with replay
 *   drafters forcing every acceptance pattern, blocks 2, 4, 8, 16. */
#include "support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dflash/engine.h"
#include "dflash/generate.h"
#include "dflash/safetensors.h"
#include "dflash/speculative.h"
#include "model/target.h"

static df_engine *g_eng;
static char g_skip[600];

static int setup(void **state) {
    (void)state;
    df_error err = {0};
    df_engine_options opt = {.n_threads = 1, .device = "cuda"};
    df_status st = df_engine_load(&g_eng, tu_fixture("tiny-bonsai2"), &opt, &err);
    if (st == DF_ERR_UNSUPPORTED) {
        snprintf(g_skip, sizeof g_skip, "%s", err.msg);
        printf("SKIP test_cuda_model: %s (the GPU tests run on a machine with a GPU)\n", g_skip);
        g_eng = NULL;
        return 0;
    }
    if (st != DF_OK) {
        printf("engine load: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    df_engine_free(g_eng);
    return 0;
}

#define NEED_GPU()                                                                                                     \
    do {                                                                                                               \
        if (!g_eng) skip();                                                                                            \
    } while (0)

static df_tensor *ref_get(df_tensor_set *ts, const char *name) {
    df_tensor *t = df_tensors_find(ts, name);
    if (!t) fail_msg("reference tensor %s missing", name);
    return t;
}

static void test_oracle_logits(void **state) {
    (void)state;
    NEED_GPU();
    df_error err = {0};
    df_tensor_set *ts = NULL;
    assert_int_equal(df_tensors_open_file(&ts, tu_fixture("tiny-bonsai2/reference.safetensors"), &err), DF_OK);
    df_tensor *ids = ref_get(ts, "prompt_ids"), *lg = ref_get(ts, "prompt_logits"), *g = ref_get(ts, "greedy_ids");
    const int n = (int)ids->numel, V = df_engine_vocab_size(g_eng);
    df_session *s = NULL;
    assert_int_equal(df_session_init(&s, g_eng, 4096, &err), DF_OK);
    float *logits = malloc((size_t)n * (size_t)V * sizeof(float));
    if (df_session_prefill_all(s, ids->data, n, logits, &err) != DF_OK) fail_msg("prefill: %s", err.msg);
    const float *ref = lg->data;
    double d = 0, mag = 0;
    for (size_t i = 0; i < (size_t)n * (size_t)V; i++) {
        double e = fabs((double)logits[i] - (double)ref[i]);
        if (!(e <= d)) d = e;
        if (fabs((double)ref[i]) > mag) mag = fabs((double)ref[i]);
    }
    printf("GPU prompt logits vs reference: max |delta| = %.3g (max |ref| %.3g, relative %.3g)\n", d, mag, d / mag);
    assert_true(d <= 1e-2 * mag);
    /* greedy continuation */
    const int ng = (int)g->numel;
    int32_t *out = malloc((size_t)ng * sizeof(int32_t));
    int32_t id = df_argmax(logits + (size_t)(n - 1) * (size_t)V, V);
    for (int i = 0; i < ng; i++) {
        out[i] = id;
        if (i + 1 < ng) assert_int_equal(df_target_forward_argmax(s, &id, 1, &id, &err), DF_OK);
    }
    int same = 0;
    while (same < ng && out[same] == ((const int32_t *)g->data)[same]) same++;
    printf("GPU greedy: %d of %d ids match the reference\n", same, ng);
    assert_int_equal(same, ng);
    free(out);
    free(logits);
    df_session_free(s);
    df_tensors_free(ts);
}

/* Prefill in tiles of 16 == one token at a time, bit for bit; argmax op == host argmax. */
static void test_rows_bitwise(void **state) {
    (void)state;
    NEED_GPU();
    df_error err = {0};
    const int n = 150, V = df_engine_vocab_size(g_eng);
    int32_t p[150];
    for (int i = 0; i < n; i++) p[i] = (int32_t)((i * 7919 + 13) % 1980);
    df_session *s = NULL;
    assert_int_equal(df_session_init(&s, g_eng, 1024, &err), DF_OK);
    float *a = malloc((size_t)V * sizeof(float)), *b = malloc((size_t)V * sizeof(float));
    assert_int_equal(df_session_prefill(s, p, n, a, &err), DF_OK);
    const int chunks[] = {1, 3, 7};
    for (int c = 0; c < 3; c++) {
        df_session_reset(s);
        for (int i = 0; i < n; i += chunks[c]) {
            int k = n - i < chunks[c] ? n - i : chunks[c];
            assert_int_equal(df_session_prefill(s, p + i, k, b, &err), DF_OK);
        }
        if (memcmp(a, b, (size_t)V * sizeof(float)) != 0)
            fail_msg("logits after prefill in chunks of %d differ from 16-row tiles", chunks[c]);
    }
    /* argmax op on a verify-like block */
    df_session_reset(s);
    assert_int_equal(df_session_prefill(s, p, 100, NULL, &err), DF_OK);
    float *lg = malloc((size_t)16 * (size_t)V * sizeof(float));
    assert_int_equal(df_target_forward_rows(s, p + 100, 16, lg, 0, &err), DF_OK);
    df_session_reset(s); /* same states again (GDN states advanced) */
    assert_int_equal(df_session_prefill(s, p, 100, NULL, &err), DF_OK);
    int32_t am[16];
    assert_int_equal(df_target_forward_argmax(s, p + 100, 16, am, &err), DF_OK);
    for (int m = 0; m < 16; m++) assert_int_equal(am[m], df_argmax(lg + (size_t)m * (size_t)V, V));
    free(lg);
    free(a);
    free(b);
    df_session_free(s);
}

typedef struct replay {
    const int32_t *plain;
    int n_plain;
    int corrupt;
} replay;

static void replay_propose(void *user, int n_generated, int32_t bonus, int B, int32_t *drafts) {
    (void)bonus;
    const replay *r = user;
    for (int k = 0; k < B - 1; k++) {
        int idx = n_generated + k;
        int32_t v = idx < r->n_plain ? r->plain[idx] : 7;
        if (k == r->corrupt) v = (v + 1) % 1984;
        drafts[k] = v;
    }
}

static void test_speculative_equals_plain(void **state) {
    (void)state;
    NEED_GPU();
    df_error err = {0};
    df_drafter *d = NULL;
    df_session *s = NULL;
    df_draft_state *ds = NULL;
    if (df_drafter_load(&d, tu_fixture("tiny-dflash"), g_eng, &err) != DF_OK) fail_msg("drafter: %s", err.msg);
    assert_int_equal(df_session_init(&s, g_eng, 512, &err), DF_OK);
    assert_int_equal(df_draft_state_init(&ds, d, 48, &err), DF_OK);
    uint64_t r = 777;
    long rounds = 0, accepted = 0, drafted = 0;
    for (int i = 0; i < 12; i++) {
        int32_t prompt[96];
        int n = 1 + (i * 37) % 90;
        for (int k = 0; k < n; k++) {
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            prompt[k] = (int32_t)((r >> 33) % 1984);
        }
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = 32;
        df_gen_result want;
        if (df_generate(s, prompt, n, &gp, NULL, NULL, &want, &err) != DF_OK) fail_msg("plain: %s", err.msg);
        const int blocks[] = {2, 4, 8, 16};
        for (int b = 0; b < 4; b++) {
            for (int k = -2; k < 2; k++) { /* -2: real drafter; -1: all accepted; 0: none; 1: partial */
                df_spec_params sp = df_spec_params_default();
                sp.no_fallback = 1; /* every round drafts */
                sp.block = blocks[b];
                replay rp = {.plain = want.ids, .n_plain = want.n_ids, .corrupt = k == 1 ? 1 + i % (blocks[b] - 1) : k};
                if (k >= -1) {
                    sp.override = replay_propose;
                    sp.override_user = &rp;
                }
                df_gen_result got;
                if (df_generate_speculative(s, ds, prompt, n, &gp, &sp, NULL, NULL, &got, &err) != DF_OK)
                    fail_msg("speculative: %s", err.msg);
                if (got.n_ids != want.n_ids || memcmp(got.ids, want.ids, (size_t)want.n_ids * sizeof(int32_t)) != 0) {
                    int q = 0;
                    while (q < got.n_ids && q < want.n_ids && got.ids[q] == want.ids[q]) q++;
                    fail_msg("GPU: speculative (block %d, pattern %d, prompt %d) differs from plain at token %d",
                             blocks[b], k, i, q);
                }
                rounds += got.draft_rounds;
                drafted += got.draft_n;
                accepted += got.draft_n_accepted;
                df_gen_result_free(&got);
            }
        }
        df_gen_result_free(&want);
    }
    printf("GPU speculative == plain: %ld rounds, %ld drafted, %ld accepted\n", rounds, drafted, accepted);
    df_draft_state_free(ds);
    df_session_free(s);
    df_drafter_free(d);
}

/* speculative == plain on the GPU with the drafter of `fixture`, its weights quantized at load
 * to `quant` bits (0: as stored). */
static void spec_equals_plain(const char *fixture, int quant, const char *label) {
    df_error err = {0};
    df_drafter *d = NULL;
    df_session *s = NULL;
    df_draft_state *ds = NULL;
    if (df_drafter_load(&d, tu_fixture(fixture), g_eng, &err) != DF_OK) fail_msg("drafter: %s", err.msg);
    if (quant && df_drafter_quantize(d, quant, &err) != DF_OK) fail_msg("quantize: %s", err.msg);
    assert_int_equal(df_session_init(&s, g_eng, 512, &err), DF_OK);
    assert_int_equal(df_draft_state_init(&ds, d, 48, &err), DF_OK);
    long accepted = 0;
    for (int i = 0; i < 6; i++) {
        int32_t prompt[64];
        int n = 5 + i * 9;
        for (int k = 0; k < n; k++) prompt[k] = (int32_t)((k * 131 + i * 17 + 3) % 1984);
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = 32;
        df_gen_result want, got;
        if (df_generate(s, prompt, n, &gp, NULL, NULL, &want, &err) != DF_OK) fail_msg("plain: %s", err.msg);
        const int blocks[] = {4, 8};
        for (int b = 0; b < 2; b++) {
            df_spec_params sp = df_spec_params_default();
            sp.no_fallback = 1; /* every round drafts */
            sp.block = blocks[b];
            if (df_generate_speculative(s, ds, prompt, n, &gp, &sp, NULL, NULL, &got, &err) != DF_OK)
                fail_msg("speculative: %s", err.msg);
            if (got.n_ids != want.n_ids || memcmp(got.ids, want.ids, (size_t)want.n_ids * sizeof(int32_t)) != 0)
                fail_msg("GPU %s: speculative (block %d, prompt %d) differs from plain", label, blocks[b], i);
            accepted += got.draft_n_accepted;
            df_gen_result_free(&got);
        }
        df_gen_result_free(&want);
    }
    printf("GPU %s speculative == plain (%ld drafts accepted)\n", label, accepted);
    df_draft_state_free(ds);
    df_session_free(s);
    df_drafter_free(d);
}

/* The DFlash2 drafter (grouped dynamic convolutions, candidate selector) on the GPU. */
/* Sampled decoding with a small top-k on the GPU: the tokens drawn on the device with each step
 * queued ahead (sample_top_dev) == the host's draw from the device's top-k list == the host
 * sampler on the whole logits, for the same seed (df_sample_top_list's arithmetic). */
static void test_sampled_paths(void **state) {
    (void)state;
    NEED_GPU();
    df_error err = {0};
    df_backend *be = g_eng->be;
    const df_backend_ops *own = be->ops;
    assert_non_null(own->sample_top_dev);
    df_backend_ops no_draw = *own, no_top_k = *own;
    no_draw.sample_top_dev = NULL;
    no_top_k.sample_top_dev = NULL;
    no_top_k.top_k = NULL;
    df_session *s = NULL;
    assert_int_equal(df_session_init(&s, g_eng, 512, &err), DF_OK);
    const int V = df_engine_vocab_size(g_eng);
    for (int i = 0; i < 4; i++) {
        int32_t prompt[24];
        for (int k = 0; k < 24; k++) prompt[k] = (int32_t)((k * 7919 + i * 104729 + 13) % (V - 10)) + 1;
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = 48;
        tu_sampling_case(&gp.sampling, i, 500u);
        df_gen_result r[3];
        const df_backend_ops *ops[3] = {own, &no_draw, &no_top_k};
        for (int m = 0; m < 3; m++) {
            be->ops = ops[m];
            const df_status st = df_generate(s, prompt, 24, &gp, NULL, NULL, &r[m], &err);
            be->ops = own;
            if (st != DF_OK) fail_msg("generate (path %d): %s", m, err.msg);
        }
        for (int m = 1; m < 3; m++)
            if (r[m].n_ids != r[0].n_ids || memcmp(r[m].ids, r[0].ids, (size_t)r[0].n_ids * sizeof(int32_t)) != 0)
                fail_msg("setting %d: the tokens drawn on the device differ from path %d's", i, m);
        int distinct = 0;
        for (int k = 1; k < r[0].n_ids; k++) distinct += r[0].ids[k] != r[0].ids[0];
        assert_true(distinct > 0);
        for (int m = 0; m < 3; m++) df_gen_result_free(&r[m]);
    }
    printf("GPU sampled decoding: tokens drawn on the device == the host's draws (4 settings)\n");
    df_session_free(s);
}

static void test_speculative_dflash2(void **state) {
    (void)state;
    NEED_GPU();
    spec_equals_plain("tiny-dflash2", 0, "DFlash2");
}

/* Drafters quantized at load (the fixed-point linear without rotation, groups of 64). */
static void test_speculative_quantized_drafter(void **state) {
    (void)state;
    NEED_GPU();
    spec_equals_plain("tiny-dflash", 8, "8-bit drafter");
    spec_equals_plain("tiny-dflash", 4, "4-bit drafter");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_oracle_logits),
        cmocka_unit_test(test_rows_bitwise),
        cmocka_unit_test(test_speculative_equals_plain),
        cmocka_unit_test(test_sampled_paths),
        cmocka_unit_test(test_speculative_dflash2),
        cmocka_unit_test(test_speculative_quantized_drafter),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
