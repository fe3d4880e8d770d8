/* Drafter oracle: tests/fixtures/tiny-dflash with tiny-bonsai2 as target against the z-lab
 * reference (fixtures README): block hidden states, draft logits and draft ids given the
 * reference context_feature; and the loader's errors. */
#include "support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dflash/drafter.h"
#include "dflash/engine.h"
#include "dflash/safetensors.h"

static float max_abs_diff(const float *a, const float *b, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        if (!(d <= m)) m = d;
    }
    return m;
}

static df_tensor *get(df_tensor_set *ts, const char *name) {
    df_tensor *t = df_tensors_find(ts, name);
    if (!t) fail_msg("reference tensor %s missing", name);
    return t;
}

static void test_drafter_oracle(void **state) {
    (void)state;
    df_error err = {0};
    df_engine *e = NULL;
    df_engine_options opt = {.n_threads = 2};
    if (df_engine_load(&e, tu_fixture("tiny-bonsai2"), &opt, &err) != DF_OK) fail_msg("%s", err.msg);
    df_drafter *d = NULL;
    if (df_drafter_load(&d, tu_fixture("tiny-dflash"), e, &err) != DF_OK) fail_msg("%s", err.msg);
    const df_drafter_config *c = df_drafter_get_config(d);
    assert_int_equal(c->block_size, 8);
    assert_int_equal(c->mask_token_id, 2010);
    df_tensor_set *ts = NULL;
    assert_int_equal(df_tensors_open_file(&ts, tu_fixture("tiny-dflash/reference.safetensors"), &err), DF_OK);
    df_tensor *feat = get(ts, "context_feature"), *block = get(ts, "block_ids"), *hid = get(ts, "draft_hidden"),
              *lg = get(ts, "draft_logits"), *ids = get(ts, "draft_ids");
    const int n = (int)feat->shape[0], B = (int)block->numel, V = df_engine_vocab_size(e);
    const int32_t *bids = block->data;
    for (int m = 1; m < B; m++) assert_int_equal(bids[m], c->mask_token_id);
    const int windows[] = {4096, n}; /* a window that holds the whole context changes nothing */
    for (int w = 0; w < 2; w++) {
        df_draft_state *st = NULL;
        assert_int_equal(df_draft_state_init(&st, d, windows[w], &err), DF_OK);
        /* context in two pieces, as rounds would add it */
        assert_int_equal(df_draft_add_context(st, feat->data, 20, 0, &err), DF_OK);
        assert_int_equal(df_draft_add_context(st, (const float *)feat->data + 20 * feat->shape[1], n - 20, 20, &err),
                         DF_OK);
        float *hidden = malloc((size_t)B * 256 * sizeof(float)), *logits = malloc((size_t)(B - 1) * V * sizeof(float));
        int32_t drafts[16];
        assert_int_equal(df_draft_block(st, bids[0], n, B, drafts, hidden, logits, &err), DF_OK);
        float dh = max_abs_diff(hidden, hid->data, (size_t)B * 256);
        float dl = max_abs_diff(logits, lg->data, (size_t)(B - 1) * V);
        printf("window %d: draft_hidden max |delta| = %.3g, draft_logits max |delta| = %.3g\n", windows[w], (double)dh,
               (double)dl);
        assert_true(dh <= 1e-3f);
        assert_true(dl <= 1e-3f);
        assert_memory_equal(drafts, ids->data, (size_t)(B - 1) * sizeof(int32_t));
        free(hidden);
        free(logits);
        df_draft_state_free(st);
    }
    df_tensors_free(ts);
    df_drafter_free(d);
    df_engine_free(e);
}

/* DFlash2: the tiny-dflash2 reference (dynamic convolutions, sliding-window layers of 16,
 * output multiplier 0.5, softcap 20, selector rank 32 / top-8), round 1 from the reference
 * context features and round 2 after 3 more tokens, whose context features come from our
 * own target forward pass (taps after layers 1, 3, 5). */
static void test_dflash2_oracle(void **state) {
    (void)state;
    df_error err = {0};
    df_engine *e = NULL;
    df_engine_options opt = {.n_threads = 2};
    if (df_engine_load(&e, tu_fixture("tiny-bonsai2"), &opt, &err) != DF_OK) fail_msg("%s", err.msg);
    df_drafter *d = NULL;
    if (df_drafter_load(&d, tu_fixture("tiny-dflash2"), e, &err) != DF_OK) fail_msg("%s", err.msg);
    const df_drafter_config *c = df_drafter_get_config(d);
    assert_int_equal(c->version, 2);
    assert_int_equal(c->sliding_window, 16);
    df_tensor_set *ts = NULL;
    assert_int_equal(df_tensors_open_file(&ts, tu_fixture("tiny-dflash2/reference.safetensors"), &err), DF_OK);
    df_tensor *feat = get(ts, "context_feature"), *block = get(ts, "block_ids"), *hid = get(ts, "draft_hidden"),
              *lg = get(ts, "draft_logits"), *sel = get(ts, "selector_ids");
    const int n = (int)feat->shape[0], B = (int)block->numel, V = df_engine_vocab_size(e);
    df_draft_state *st = NULL;
    assert_int_equal(df_draft_state_init(&st, d, 64, &err), DF_OK);
    assert_int_equal(df_draft_add_context(st, feat->data, n, 0, &err), DF_OK);
    float *hidden = malloc((size_t)B * 256 * sizeof(float)), *logits = malloc((size_t)(B - 1) * V * sizeof(float));
    int32_t drafts[16];
    assert_int_equal(df_draft_block(st, ((const int32_t *)block->data)[0], n, B, drafts, hidden, logits, &err), DF_OK);
    float dh = max_abs_diff(hidden, hid->data, (size_t)B * 256), dl = max_abs_diff(logits, lg->data, (size_t)(B - 1) * V);
    printf("dflash2 round 1: draft_hidden max |delta| = %.3g, draft_logits max |delta| = %.3g\n", (double)dh, (double)dl);
    assert_true(dh <= 1e-3f);
    assert_true(dl <= 1e-3f);
    assert_memory_equal(drafts, sel->data, (size_t)(B - 1) * sizeof(int32_t));
    /* round 2: context rows for the 3 new tokens from our target's taps */
    df_tensor *ctx_ids = get(ts, "round2_context_ids"), *b2 = get(ts, "round2_block_ids"),
              *lg2 = get(ts, "round2_draft_logits"), *sel2 = get(ts, "round2_selector_ids");
    const int n2 = (int)ctx_ids->numel, L = df_engine_pack(e)->cfg.n_layers;
    df_session *s = NULL;
    assert_int_equal(df_session_init(&s, e, 256, &err), DF_OK);
    float *planes = malloc((size_t)(L + 2) * (size_t)n2 * 256 * sizeof(float));
    df_session_capture_hidden(s, planes);
    assert_int_equal(df_session_prefill(s, ctx_ids->data, n2, NULL, &err), DF_OK);
    float *feats = malloc((size_t)(n2 - n) * 768 * sizeof(float));
    for (int r = n; r < n2; r++)
        for (int t = 0; t < 3; t++) /* tap after layer l = plane l + 1 */
            memcpy(feats + (size_t)(r - n) * 768 + (size_t)t * 256,
                   planes + ((size_t)(c->taps[t] + 1) * (size_t)n2 + (size_t)r) * 256, 256 * sizeof(float));
    assert_int_equal(df_draft_add_context(st, feats, n2 - n, n, &err), DF_OK);
    assert_int_equal(df_draft_block(st, ((const int32_t *)b2->data)[0], n2, B, drafts, NULL, logits, &err), DF_OK);
    float dl2 = max_abs_diff(logits, lg2->data, (size_t)(B - 1) * V);
    printf("dflash2 round 2: draft_logits max |delta| = %.3g\n", (double)dl2);
    assert_true(dl2 <= 1e-3f);
    assert_memory_equal(drafts, sel2->data, (size_t)(B - 1) * sizeof(int32_t));
    free(feats);
    free(planes);
    df_session_free(s);
    free(hidden);
    free(logits);
    df_draft_state_free(st);
    df_tensors_free(ts);
    df_drafter_free(d);
    df_engine_free(e);
}

/* A drafter whose config is not a drafter, or whose taps do not fit the target, is refused
 * with a message naming the problem. */
static void test_drafter_errors(void **state) {
    (void)state;
    df_error err = {0};
    df_engine *e = NULL;
    df_engine_options opt = {.n_threads = 1};
    if (df_engine_load(&e, tu_fixture("tiny-bonsai2"), &opt, &err) != DF_OK) fail_msg("%s", err.msg);
    df_drafter *d = NULL;
    /* the target pack itself is not a DFlash drafter */
    assert_int_not_equal(df_drafter_load(&d, tu_fixture("tiny-bonsai2"), e, &err), DF_OK);
    assert_non_null(strstr(err.msg, "DFlashDraftModel"));
    assert_non_null(strstr(err.msg, "DFlash2DraftModel"));
    /* a config with a tap beyond the target's layers */
    const char *dir = tu_tmpdir();
    char path[512], cfg_path[512];
    snprintf(cfg_path, sizeof cfg_path, "%s", tu_fixture("tiny-dflash/config.json"));
    size_t len = 0;
    char *cfg = tu_read_file(cfg_path, &len);
    assert_non_null(cfg);
    char *p = strstr(cfg, "\"target_layer_ids\"");
    assert_non_null(p);
    char *q = strchr(p, '5');
    assert_non_null(q);
    *q = '9';
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_int_equal(tu_write_file(path, cfg, len), 0);
    size_t mlen = 0;
    char *model = tu_read_file(tu_fixture("tiny-dflash/model.safetensors"), &mlen);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(tu_write_file(path, model, mlen), 0);
    assert_int_equal(df_drafter_load(&d, dir, e, &err), DF_ERR_MODEL);
    assert_non_null(strstr(err.msg, "target_layer_ids"));
    free(cfg);
    /* a drafter trained for another vocabulary or another layer count */
    const char *edits[][3] = {{"\"vocab_size\": 2048", "\"vocab_size\": 4096", "vocab_size"},
                              {"\"num_target_layers\": 8", "\"num_target_layers\": 9", "num_target_layers"},
                              /* and values no drafter has: format errors that say what is wanted */
                              {"\"num_target_layers\": 8", "\"num_target_layers\": 0", "must be at least 1"},
                              {"\"block_size\": 8", "\"block_size\": 1", "must be at least 2"}};
    for (int k = 0; k < 4; k++) {
        cfg = tu_read_file(cfg_path, &len);
        assert_non_null(cfg);
        char *at = strstr(cfg, edits[k][0]);
        assert_non_null(at);
        const size_t a = strlen(edits[k][0]), b = strlen(edits[k][1]);
        char *out = malloc(len - a + b + 1);
        const size_t off = (size_t)(at - cfg);
        memcpy(out, cfg, off);
        memcpy(out + off, edits[k][1], b);
        memcpy(out + off + b, at + a, len - off - a);
        snprintf(path, sizeof path, "%s/config.json", dir);
        assert_int_equal(tu_write_file(path, out, len - a + b), 0);
        assert_int_equal(df_drafter_load(&d, dir, e, &err), k < 2 ? DF_ERR_MODEL : DF_ERR_FORMAT);
        assert_non_null(strstr(err.msg, edits[k][2]));
        free(out);
        free(cfg);
    }
    free(model);
    df_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_drafter_oracle),
        cmocka_unit_test(test_dflash2_oracle),
        cmocka_unit_test(test_drafter_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
