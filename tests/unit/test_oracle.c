/* Oracle tests: the CPU forward pass of tests/fixtures/tiny-bonsai2 against the reference
 * outputs of the Hugging Face implementation (fixtures README): prompt logits, per-layer
 * residual streams, greedy continuations (short and 660-token prompts); prefill/chunk/
 * one-at-a-time agreement; bitwise independence of the thread count. */
#include "support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dflash/engine.h"
#include "dflash/generate.h"
#include "dflash/safetensors.h"

typedef struct ref {
    df_tensor_set *ts;
} ref;

static df_tensor *ref_get(df_tensor_set *ts, const char *name) {
    df_tensor *t = df_tensors_find(ts, name);
    if (!t) fail_msg("reference tensor %s missing", name);
    return t;
}

static df_engine *load_engine(int threads) {
    df_engine *e = NULL;
    df_error err = {0};
    df_engine_options opt = {.n_threads = threads};
    df_status st = df_engine_load(&e, tu_fixture("tiny-bonsai2"), &opt, &err);
    if (st != DF_OK) fail_msg("engine load: %s", err.msg);
    return e;
}

static float max_abs_diff(const float *a, const float *b, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        if (!(d <= m)) m = d; /* NaN propagates as a failure */
    }
    return m;
}

static void test_prompt_logits_and_hidden(void **state) {
    (void)state;
    df_error err = {0};
    df_tensor_set *ts = NULL;
    assert_int_equal(df_tensors_open_file(&ts, tu_fixture("tiny-bonsai2/reference.safetensors"), &err), DF_OK);
    df_tensor *ids = ref_get(ts, "prompt_ids"), *lg = ref_get(ts, "prompt_logits");
    const int n = (int)ids->numel;
    df_engine *e = load_engine(2);
    const int V = df_engine_vocab_size(e), L = df_engine_pack(e)->cfg.n_layers;
    const int H = df_engine_pack(e)->cfg.hidden_size;
    df_session *s = NULL;
    assert_int_equal(df_session_init(&s, e, 4096, &err), DF_OK);
    float *logits = malloc((size_t)n * (size_t)V * sizeof(float));
    float *hidden = malloc((size_t)(L + 2) * (size_t)n * (size_t)H * sizeof(float));
    df_session_capture_hidden(s, hidden);
    assert_int_equal(df_session_prefill_all(s, ids->data, n, logits, &err), DF_OK);
    for (int i = 0; i <= L; i++) {
        char name[32];
        snprintf(name, sizeof name, "hidden.%d", i);
        df_tensor *h = ref_get(ts, name);
        int plane = i < L ? i : L + 1; /* hidden.L is after the final norm */
        float dh = max_abs_diff(hidden + (size_t)plane * (size_t)n * (size_t)H, h->data, (size_t)n * (size_t)H);
        float mag = 0.0f;
        for (size_t k = 0; k < (size_t)n * (size_t)H; k++)
            if (fabsf(((const float *)h->data)[k]) > mag) mag = fabsf(((const float *)h->data)[k]);
        printf("%s: max |delta| = %.3g (max |value| %.3g)\n", name, (double)dh, (double)mag);
        assert_true(dh <= 1e-3f * (mag > 1.0f ? mag : 1.0f));
    }
    float d = max_abs_diff(logits, lg->data, (size_t)n * (size_t)V);
    printf("prompt logits: max |delta| = %.3g over %d x %d\n", (double)d, n, V);
    assert_true(d <= 1e-3f);
    free(hidden);
    free(logits);
    df_session_free(s);
    df_engine_free(e);
    df_tensors_free(ts);
}

/* Prefill then greedy decode n_gen tokens; returns malloc'd ids. */
static int32_t *greedy(df_engine *e, const int32_t *prompt, int n, int n_gen, float *last_logits_out) {
    df_error err = {0};
    df_session *s = NULL;
    assert_int_equal(df_session_init(&s, e, 4096, &err), DF_OK);
    const int V = df_engine_vocab_size(e);
    float *logits = malloc((size_t)V * sizeof(float));
    int32_t *out = malloc((size_t)n_gen * sizeof(int32_t));
    if (df_session_prefill(s, prompt, n, logits, &err) != DF_OK) fail_msg("prefill: %s", err.msg);
    for (int i = 0; i < n_gen; i++) {
        out[i] = df_argmax(logits, V);
        if (i + 1 < n_gen && df_session_decode(s, out[i], logits, &err) != DF_OK) fail_msg("decode: %s", err.msg);
    }
    if (last_logits_out) memcpy(last_logits_out, logits, (size_t)V * sizeof(float));
    free(logits);
    df_session_free(s);
    return out;
}

static void test_greedy_short(void **state) {
    (void)state;
    df_error err = {0};
    df_tensor_set *ts = NULL;
    assert_int_equal(df_tensors_open_file(&ts, tu_fixture("tiny-bonsai2/reference.safetensors"), &err), DF_OK);
    df_tensor *ids = ref_get(ts, "prompt_ids"), *g = ref_get(ts, "greedy_ids");
    df_engine *e = load_engine(2);
    int32_t *out = greedy(e, ids->data, (int)ids->numel, (int)g->numel, NULL);
    int same = 0;
    while (same < g->numel && out[same] == ((const int32_t *)g->data)[same]) same++;
    printf("greedy (35-token prompt): %d of %lld ids match\n", same, (long long)g->numel);
    assert_int_equal(same, g->numel);
    free(out);
    df_engine_free(e);
    df_tensors_free(ts);
}

static void test_long_prompt(void **state) {
    (void)state;
    df_error err = {0};
    df_tensor_set *ts = NULL;
    assert_int_equal(df_tensors_open_file(&ts, tu_fixture("tiny-bonsai2/reference-long.safetensors"), &err),
                     DF_OK);
    df_tensor *ids = ref_get(ts, "prompt_ids"), *last = ref_get(ts, "last_logits"), *g = ref_get(ts, "greedy_ids");
    const int n = (int)ids->numel;
    df_engine *e = load_engine(2);
    const int V = df_engine_vocab_size(e);
    df_session *s = NULL;
    assert_int_equal(df_session_init(&s, e, 4096, &err), DF_OK);
    float *logits = malloc((size_t)n * (size_t)V * sizeof(float));
    assert_int_equal(df_session_prefill_all(s, ids->data, n, logits, &err), DF_OK);
    float d = max_abs_diff(logits + (size_t)(n - 8) * (size_t)V, last->data, 8 * (size_t)V);
    printf("long prompt (%d tokens): last-8 logits max |delta| = %.3g\n", n, (double)d);
    assert_true(d <= 1e-3f);
    free(logits);
    df_session_free(s);
    int32_t *out = greedy(e, ids->data, n, (int)g->numel, NULL);
    int same = 0;
    while (same < g->numel && out[same] == ((const int32_t *)g->data)[same]) same++;
    printf("greedy (660-token prompt): %d of %lld ids match\n", same, (long long)g->numel);
    assert_int_equal(same, g->numel);
    free(out);
    df_engine_free(e);
    df_tensors_free(ts);
}

/* Same logits whether the prompt is prefilled at once, in chunks, or one token at a time. */
static void test_chunking(void **state) {
    (void)state;
    df_error err = {0};
    df_tensor_set *ts = NULL;
    assert_int_equal(df_tensors_open_file(&ts, tu_fixture("tiny-bonsai2/reference-long.safetensors"), &err),
                     DF_OK);
    df_tensor *ids = ref_get(ts, "prompt_ids");
    const int32_t *p = ids->data;
    const int n = 100;
    df_engine *e = load_engine(2);
    const int V = df_engine_vocab_size(e);
    float *a = malloc((size_t)V * sizeof(float)), *b = malloc((size_t)V * sizeof(float));
    df_session *s = NULL;
    assert_int_equal(df_session_init(&s, e, 4096, &err), DF_OK);
    assert_int_equal(df_session_prefill(s, p, n, a, &err), DF_OK);
    const int chunks[] = {1, 3, 7, 16, 33};
    for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
        df_session_reset(s);
        for (int i = 0; i < n; i += chunks[c]) {
            int k = n - i < chunks[c] ? n - i : chunks[c];
            assert_int_equal(df_session_prefill(s, p + i, k, b, &err), DF_OK);
        }
        float d = max_abs_diff(a, b, (size_t)V);
        printf("chunk %d: max |delta| vs whole prefill = %.3g\n", chunks[c], (double)d);
        assert_true(d <= 1e-4f);
    }
    free(a);
    free(b);
    df_session_free(s);
    df_engine_free(e);
    df_tensors_free(ts);
}

/* Decode results are bitwise identical for 1, 2 and 4 threads. */
static void test_thread_invariance(void **state) {
    (void)state;
    df_error err = {0};
    df_tensor_set *ts = NULL;
    assert_int_equal(df_tensors_open_file(&ts, tu_fixture("tiny-bonsai2/reference.safetensors"), &err), DF_OK);
    df_tensor *ids = ref_get(ts, "prompt_ids");
    float *ref_logits = NULL;
    int32_t *ref_ids = NULL;
    const int threads[] = {1, 2, 4};
    for (int t = 0; t < 3; t++) {
        df_engine *e = load_engine(threads[t]);
        const int V = df_engine_vocab_size(e);
        float *lg = malloc((size_t)V * sizeof(float));
        int32_t *out = greedy(e, ids->data, (int)ids->numel, 24, lg);
        if (!ref_logits) {
            ref_logits = lg;
            ref_ids = out;
        } else {
            assert_memory_equal(ref_ids, out, 24 * sizeof(int32_t));
            assert_memory_equal(ref_logits, lg, (size_t)V * sizeof(float));
            free(lg);
            free(out);
        }
        df_engine_free(e);
    }
    free(ref_logits);
    free(ref_ids);
    df_tensors_free(ts);
}

/* Ids beyond the tokenizer's vocabulary (padded embedding rows) decode to nothing. */
static void test_padding_ids_decode_empty(void **state) {
    (void)state;
    df_engine *e = load_engine(1);
    const df_tokenizer *tok = df_engine_tokenizer(e);
    df_error err = {0};
    int32_t pad[] = {2040, 2047, 2046};
    char *text = NULL;
    size_t len = 99;
    assert_int_equal(df_tokenizer_decode(tok, pad, 3, 0, &text, &len, &err), DF_OK);
    assert_int_equal(len, 0);
    free(text);
    df_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prompt_logits_and_hidden),
        cmocka_unit_test(test_greedy_short),
        cmocka_unit_test(test_long_prompt),
        cmocka_unit_test(test_chunking),
        cmocka_unit_test(test_thread_invariance),
        cmocka_unit_test(test_padding_ids_decode_empty),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
