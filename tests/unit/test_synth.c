/* Synthetic packs (include/dflash/synth.h): the tiny preset loads as a pack and a drafter,
 * its codes are ternary with biases == -scales, the forward pass is finite, and speculative
 * decoding on it equals plain decoding (CPU). */
#include "support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dflash/engine.h"
#include "dflash/generate.h"
#include "dflash/speculative.h"
#include "dflash/synth.h"

static void test_tiny_synth(void **state) {
    (void)state;
    char tok[4096], dir[512], ddir[600];
    const char *src = getenv("DFLASH_SOURCE_DIR");
    snprintf(tok, sizeof tok, "%s/models/demo", src ? src : ".");
    snprintf(dir, sizeof dir, "%s/synth", tu_tmpdir());
    df_synth_options o = {.preset = "tiny", .out_dir = dir, .tokenizer_dir = tok, .drafter = 1, .seed = 7,
                          .n_threads = 2};
    df_error err = {0};
    if (df_synth_pack(&o, &err) != DF_OK) fail_msg("synth: %s", err.msg);
    df_engine *e = NULL;
    df_engine_options eo = {.n_threads = 2};
    if (df_engine_load(&e, dir, &eo, &err) != DF_OK) fail_msg("load: %s", err.msg);
    const df_pack *pk = df_engine_pack(e);
    assert_int_equal(pk->cfg.hidden_size, 256);
    assert_int_equal(pk->lm_head.hadamard_block, 256);
    assert_int_equal(pk->embed.hadamard_block, 256);
    /* ternary codes, biases = -scales */
    const df_linear *L = &pk->layers[0].gate_proj;
    const uint32_t *w = L->w;
    for (int i = 0; i < L->rows * L->cols / 16; i++)
        for (int k = 0; k < 16; k++) assert_true(((w[i] >> (2 * k)) & 3u) != 3u);
    const uint16_t *sc = L->scales, *bi = L->biases;
    for (int i = 0; i < L->rows * (L->cols / 128); i++) assert_int_equal(sc[i] ^ 0x8000u, bi[i]);
    /* finite logits */
    df_session *s = NULL;
    assert_int_equal(df_session_init(&s, e, 512, &err), DF_OK);
    int32_t p[40];
    for (int i = 0; i < 40; i++) p[i] = (int32_t)((i * 97 + 5) % 4000);
    const int V = df_engine_vocab_size(e);
    float *lg = malloc((size_t)V * sizeof(float));
    assert_int_equal(df_session_prefill(s, p, 40, lg, &err), DF_OK);
    for (int i = 0; i < V; i++) assert_true(isfinite(lg[i]));
    free(lg);
    /* drafter + speculative == plain */
    snprintf(ddir, sizeof ddir, "%s/drafter", dir);
    df_drafter *d = NULL;
    df_draft_state *ds = NULL;
    if (df_drafter_load(&d, ddir, e, &err) != DF_OK) fail_msg("drafter: %s", err.msg);
    assert_int_equal(df_drafter_get_config(d)->block_size, 16);
    assert_int_equal(df_draft_state_init(&ds, d, 64, &err), DF_OK);
    df_gen_params gp = df_gen_params_default();
    gp.max_tokens = 20;
    df_gen_result want, got;
    assert_int_equal(df_generate(s, p, 40, &gp, NULL, NULL, &want, &err), DF_OK);
    df_spec_params sp = df_spec_params_default();
    sp.no_fallback = 1; /* every round drafts */
    assert_int_equal(df_generate_speculative(s, ds, p, 40, &gp, &sp, NULL, NULL, &got, &err), DF_OK);
    assert_int_equal(got.n_ids, want.n_ids);
    assert_memory_equal(got.ids, want.ids, (size_t)want.n_ids * sizeof(int32_t));
    df_gen_result_free(&want);
    df_gen_result_free(&got);
    df_draft_state_free(ds);
    df_drafter_free(d);
    df_session_free(s);
    df_engine_free(e);
    /* an unknown preset is refused */
    o.preset = "70b";
    assert_int_equal(df_synth_pack(&o, &err), DF_ERR_INVALID_ARG);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_tiny_synth)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
