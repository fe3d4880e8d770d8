/* Exactness suite: speculative greedy decoding == plain greedy decoding, token for token,
 * over 50 prompts × block sizes {2, 4, 8, 16} × drafters that force every acceptance pattern
 * (the real tiny-dflash drafter, and a replay of the plain output with chosen positions
 * corrupted: all accepted, none accepted, each partial length), prompts crossing the
 * drafter window, stop tokens and max_tokens inside a block, adaptive block sizes. */
#include "support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "dflash/speculative.h"
#include "model/target.h"

#define N_PROMPTS 50
#define GEN 20

static df_engine *g_eng;
static df_drafter *g_drafter;
static df_session *g_sess;
static df_draft_state *g_ds;
static int32_t g_prompts[N_PROMPTS][96];
static int g_plen[N_PROMPTS];

static int setup(void **state) {
    (void)state;
    df_error err = {0};
    df_engine_options opt = {.n_threads = 2};
    if (df_engine_load(&g_eng, tu_fixture("tiny-bonsai2"), &opt, &err) != DF_OK) return -1;
    if (df_drafter_load(&g_drafter, tu_fixture("tiny-dflash"), g_eng, &err) != DF_OK) return -1;
    if (df_session_init(&g_sess, g_eng, 512, &err) != DF_OK) return -1;
    if (df_draft_state_init(&g_ds, g_drafter, 48, &err) != DF_OK) return -1;
    uint64_t r = 12345;
    for (int i = 0; i < N_PROMPTS; i++) {
        g_plen[i] = 1 + (i * 37) % 60;
        for (int k = 0; k < g_plen[i]; k++) {
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            g_prompts[i][k] = (int32_t)((r >> 33) % 1984);
        }
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    df_draft_state_free(g_ds);
    df_session_free(g_sess);
    df_drafter_free(g_drafter);
    df_engine_free(g_eng);
    return 0;
}

/* Replay drafter: proposes the plain output, with draft index `corrupt` (0-based within the
 * block; -1 = none) replaced by a wrong token. */
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

static void plain(const int32_t *p, int n, const df_gen_params *gp, df_gen_result *res) {
    df_error err = {0};
    if (df_generate(g_sess, p, n, gp, NULL, NULL, res, &err) != DF_OK) fail_msg("plain: %s", err.msg);
}

static void spec_check(const int32_t *p, int n, const df_gen_params *gp, const df_spec_params *sp,
                       const df_gen_result *want, const char *what, int prompt) {
    df_error err = {0};
    df_gen_result got;
    if (df_generate_speculative(g_sess, g_ds, p, n, gp, sp, NULL, NULL, &got, &err) != DF_OK)
        fail_msg("speculative (%s, prompt %d): %s", what, prompt, err.msg);
    if (got.n_ids != want->n_ids || memcmp(got.ids, want->ids, (size_t)got.n_ids * sizeof(int32_t)) != 0 ||
        got.finish != want->finish || strcmp(got.text, want->text) != 0) {
        int k = 0;
        while (k < got.n_ids && k < want->n_ids && got.ids[k] == want->ids[k]) k++;
        fail_msg("%s, prompt %d, block %d: speculative output differs from plain at token %d (n %d vs %d)", what,
                 prompt, sp->block, k, got.n_ids, want->n_ids);
    }
    assert_true(got.draft_n_accepted <= got.draft_n);
    df_gen_result_free(&got);
}

/* The sanitizer build (DFLASH_TEST_QUICK=1) runs every pattern on fewer prompts; the
 * release build runs all 50. */
static int n_prompts(void) {
    const char *q = getenv("DFLASH_TEST_QUICK");
    return q && *q == '1' ? 2 : N_PROMPTS;
}

static void test_exact_all_patterns(void **state) {
    (void)state;
    const int blocks[] = {2, 4, 8, 16};
    long rounds = 0, drafted = 0, accepted = 0;
    const int np = n_prompts();
    for (int i = 0; i < np; i++) {
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = GEN;
        df_gen_result want;
        plain(g_prompts[i], g_plen[i], &gp, &want);
        for (int b = 0; b < 4; b++) {
            const int B = blocks[b];
            df_spec_params sp = df_spec_params_default();
            sp.no_fallback = 1; /* every round drafts */
            sp.block = B;
            /* the real drafter */
            spec_check(g_prompts[i], g_plen[i], &gp, &sp, &want, "real drafter", i);
            /* replay: all accepted, none accepted, one partial length (rotating over prompts) */
            replay r = {.plain = want.ids, .n_plain = want.n_ids};
            sp.override = replay_propose;
            sp.override_user = &r;
            const int corrupt[] = {-1, 0, B > 2 ? 1 + i % (B - 2) : 0};
            const char *names[] = {"replay all accepted", "replay none accepted", "replay partial"};
            for (int k = 0; k < 3; k++) {
                r.corrupt = corrupt[k];
                df_gen_result got;
                df_error err = {0};
                assert_int_equal(df_generate_speculative(g_sess, g_ds, g_prompts[i], g_plen[i], &gp, &sp, NULL, NULL,
                                                         &got, &err),
                                 DF_OK);
                assert_int_equal(got.n_ids, want.n_ids);
                assert_memory_equal(got.ids, want.ids, (size_t)want.n_ids * sizeof(int32_t));
                /* every draft accepted, but for the ones past the end of the plain output */
                if (k == 0) assert_true(got.draft_n - got.draft_n_accepted < B);
                if (k == 1) assert_int_equal(got.draft_n_accepted, 0);
                if (k == 2 && B > 2 && got.draft_rounds > 1) assert_true(got.draft_n_accepted > 0);
                /* the rounds' phase times: non-negative, within the decode time, zero without a round */
                const double ph = got.draft_ms + got.verify_ms + got.settle_ms + got.context_ms;
                assert_true(got.draft_ms >= 0 && got.verify_ms >= 0 && got.settle_ms >= 0 && got.context_ms >= 0);
                assert_true(ph <= got.decode_ms + 1e-6);
                if (got.draft_rounds == 0) assert_true(ph == 0.0);
                else assert_true(got.verify_ms > 0);
                rounds += got.draft_rounds;
                drafted += got.draft_n;
                accepted += got.draft_n_accepted;
                (void)names;
                df_gen_result_free(&got);
            }
        }
        df_gen_result_free(&want);
    }
    printf("replay drafters: %ld rounds, %ld drafted, %ld accepted\n", rounds, drafted, accepted);
}

/* A backend without the device-id ops (embed_dev, argmax_dev, submit: optional) gets its
 * rounds through the host, with the same tokens; and a replay drafter proposing an id outside
 * the vocabulary is refused on either path. */
/* The plain loop's shortcuts give the tokens of the whole-logits path: greedy steps read the
 * backend's argmax, each step queued before the previous token is read (against the host's
 * argmax of the logits, which logprobs ask for, and against one step at a time, read_ahead
 * removed; a stop id then ends the output where it should, the step run past it changing
 * nothing for the next generation), and a sampler with a small top-k draws from the backend's
 * top_k (against the same sampler on the logits, with the op removed). */
static void test_plain_loop_paths(void **state) {
    (void)state;
    df_backend *be = g_eng->be;
    const df_backend_ops *own = be->ops;
    df_backend_ops no_top_k = *own, no_ahead = *own, no_draw = *own;
    no_top_k.top_k = NULL;
    no_top_k.sample_top_dev = NULL;
    no_ahead.read_ahead = NULL;
    no_draw.sample_top_dev = NULL; /* the k best read back, the draw on the host */
    assert_non_null(own->sample_top_dev);
    for (int i = 0; i < 4; i++) {
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = GEN;
        df_gen_result a, b, c;
        plain(g_prompts[i + 30], g_plen[i + 30], &gp, &a);
        be->ops = &no_ahead; /* each step recorded after the token before it is read */
        plain(g_prompts[i + 30], g_plen[i + 30], &gp, &c);
        be->ops = own;
        gp.logprobs = 1;
        plain(g_prompts[i + 30], g_plen[i + 30], &gp, &b);
        assert_int_equal(a.n_ids, b.n_ids);
        assert_memory_equal(a.ids, b.ids, (size_t)a.n_ids * sizeof(int32_t));
        assert_int_equal(a.n_ids, c.n_ids);
        assert_memory_equal(a.ids, c.ids, (size_t)a.n_ids * sizeof(int32_t));
        /* a stop id read while the step after it runs: the output ends there, and the next
         * generation (a fresh session) is unchanged */
        const int at = 3 + i;
        gp.logprobs = 0;
        gp.n_stop_ids = 1;
        gp.stop_ids[0] = a.ids[at];
        int first = 0;
        while (a.ids[first] != a.ids[at]) first++;
        df_gen_result d;
        plain(g_prompts[i + 30], g_plen[i + 30], &gp, &d);
        assert_int_equal(d.n_ids, first + 1);
        assert_memory_equal(d.ids, a.ids, (size_t)d.n_ids * sizeof(int32_t));
        assert_int_equal(d.finish, DF_FINISH_STOP);
        df_gen_result_free(&d);
        gp.n_stop_ids = 0;
        plain(g_prompts[i + 30], g_plen[i + 30], &gp, &d);
        assert_int_equal(d.n_ids, a.n_ids);
        assert_memory_equal(d.ids, a.ids, (size_t)a.n_ids * sizeof(int32_t));
        df_gen_result_free(&d);
        df_gen_result_free(&a);
        df_gen_result_free(&b);
        df_gen_result_free(&c);
        gp = df_gen_params_default();
        gp.max_tokens = GEN;
        tu_sampling_case(&gp.sampling, i, 77u);
        plain(g_prompts[i + 30], g_plen[i + 30], &gp, &a); /* drawn by the backend, steps queued ahead */
        be->ops = &no_top_k;
        plain(g_prompts[i + 30], g_plen[i + 30], &gp, &b);
        be->ops = &no_draw;
        plain(g_prompts[i + 30], g_plen[i + 30], &gp, &c);
        be->ops = own;
        if (a.n_ids != b.n_ids || memcmp(a.ids, b.ids, (size_t)a.n_ids * sizeof(int32_t)) != 0)
            fail_msg("prompt %d: tokens drawn by the backend differ from sampling the logits", i + 30);
        if (a.n_ids != c.n_ids || memcmp(a.ids, c.ids, (size_t)a.n_ids * sizeof(int32_t)) != 0)
            fail_msg("prompt %d: tokens drawn by the backend differ from the host's draw from its top-k", i + 30);
        int distinct = 0; /* the draws do vary */
        for (int k = 1; k < a.n_ids; k++) distinct += a.ids[k] != a.ids[0];
        assert_true(distinct > 0);
        /* a sampled stop id read while the step after it runs: the output ends there */
        assert_true(a.n_ids > at);
        gp.n_stop_ids = 1;
        gp.stop_ids[0] = a.ids[at];
        first = 0;
        while (a.ids[first] != a.ids[at]) first++;
        plain(g_prompts[i + 30], g_plen[i + 30], &gp, &d);
        assert_int_equal(d.n_ids, first + 1);
        assert_memory_equal(d.ids, a.ids, (size_t)d.n_ids * sizeof(int32_t));
        df_gen_result_free(&d);
        df_gen_result_free(&a);
        df_gen_result_free(&b);
        df_gen_result_free(&c);
    }
}

static void test_ids_through_host(void **state) {
    (void)state;
    df_backend *be = g_eng->be;
    const df_backend_ops *own = be->ops;
    df_backend_ops host_ids = *own;
    host_ids.embed_dev = NULL;
    host_ids.argmax_dev = NULL;
    host_ids.submit = NULL;
    for (int path = 0; path < 2; path++) {
        be->ops = path ? &host_ids : own;
        for (int i = 0; i < 3; i++) {
            df_gen_params gp = df_gen_params_default();
            gp.max_tokens = GEN;
            df_gen_result want;
            plain(g_prompts[i + 20], g_plen[i + 20], &gp, &want);
            const int blocks[] = {4, 8};
            for (int b = 0; b < 2; b++)
                for (int k = -2; k < 2; k++) { /* -2: real drafter; -1: all accepted; 0: none; 1: partial */
                    df_spec_params sp = df_spec_params_default();
                    sp.no_fallback = 1;
                    sp.block = blocks[b];
                    replay r = {.plain = want.ids, .n_plain = want.n_ids, .corrupt = k};
                    if (k >= -1) {
                        sp.override = replay_propose;
                        sp.override_user = &r;
                    }
                    spec_check(g_prompts[i + 20], g_plen[i + 20], &gp, &sp, &want, path ? "host ids" : "device ids",
                               i + 20);
                }
            df_gen_result_free(&want);
        }
        /* proposals past the vocabulary (1984 ids) */
        replay bad = {.plain = NULL, .n_plain = 0, .corrupt = -1};
        int32_t fake[GEN];
        for (int k = 0; k < GEN; k++) fake[k] = 5000;
        bad.plain = fake;
        bad.n_plain = GEN;
        df_spec_params sp = df_spec_params_default();
        sp.no_fallback = 1;
        sp.block = 4;
        sp.override = replay_propose;
        sp.override_user = &bad;
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = 8;
        df_gen_result got;
        df_error err = {0};
        assert_int_equal(df_generate_speculative(g_sess, g_ds, g_prompts[0], g_plen[0], &gp, &sp, NULL, NULL, &got, &err),
                         DF_ERR_INVALID_ARG);
        assert_non_null(strstr(err.msg, "outside"));
        df_gen_result_free(&got);
    }
    be->ops = own;
}

/* Every partial acceptance length 0..B-2 for B = 16 and 8 on a few prompts. */
static void test_each_partial_length(void **state) {
    (void)state;
    const int blocks[] = {8, 16};
    for (int i = 0; i < (n_prompts() < 12 ? 1 : 3); i++) {
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = n_prompts() < 12 ? 24 : 40;
        df_gen_result want;
        plain(g_prompts[i + 10], g_plen[i + 10], &gp, &want);
        for (int b = 0; b < 2; b++) {
            for (int j = 0; j < blocks[b] - 1; j++) {
                df_spec_params sp = df_spec_params_default();
                sp.no_fallback = 1; /* every round drafts */
                sp.block = blocks[b];
                replay r = {.plain = want.ids, .n_plain = want.n_ids, .corrupt = j};
                sp.override = replay_propose;
                sp.override_user = &r;
                spec_check(g_prompts[i + 10], g_plen[i + 10], &gp, &sp, &want, "partial length", i + 10);
            }
        }
        df_gen_result_free(&want);
    }
}

/* When speculative decoding ends, the session's GDN states are those of its position, whether
 * the last round was accepted whole (the pass's states taken over) or not (its accepted rows
 * replayed): the bits of a session that ran the same tokens in tiles. Rounds accept 0..3 drafts of 3, and a stop id ends
 * the output at one of four places, so that the last round ends in each way. */
static void test_states_at_end(void **state) {
    (void)state;
    const df_text_config *tc = &g_eng->pack->cfg;
    df_error err = {0};
    df_session *ref;
    assert_int_equal(df_session_init(&ref, g_eng, 512, &err), DF_OK);
    const int p = 3;
    df_gen_params gp = df_gen_params_default();
    gp.max_tokens = GEN;
    df_gen_result full;
    plain(g_prompts[p], g_plen[p], &gp, &full);
    for (int corrupt = 0; corrupt <= 3; corrupt++) /* 3: every draft of a block-4 round right */
        for (int at = 4; at < 8; at++) {
            gp.stop_ids[0] = full.ids[at];
            gp.n_stop_ids = 1;
            df_spec_params sp = df_spec_params_default();
            sp.no_fallback = 1;
            sp.block = 4;
            replay r = {.plain = full.ids, .n_plain = full.n_ids, .corrupt = corrupt};
            sp.override = replay_propose;
            sp.override_user = &r;
            df_gen_result got;
            assert_int_equal(
                df_generate_speculative(g_sess, g_ds, g_prompts[p], g_plen[p], &gp, &sp, NULL, NULL, &got, &err), DF_OK);
            int32_t ids[96 + GEN];
            memcpy(ids, g_prompts[p], (size_t)g_plen[p] * sizeof(int32_t));
            /* (accepted rows past the stop id ran too: they are the plain output's) */
            memcpy(ids + g_plen[p], full.ids, (size_t)full.n_ids * sizeof(int32_t));
            const int n = g_sess->pos;
            assert_true(n >= g_plen[p] + got.n_ids - 1 && n <= g_plen[p] + full.n_ids);
            df_session_reset(ref);
            for (int i = 0; i < n; i += DF_MAX_ROWS)
                assert_int_equal(
                    df_target_forward_rows(ref, ids + i, n - i < DF_MAX_ROWS ? n - i : DF_MAX_ROWS, NULL, 0, &err), DF_OK);
            for (int l = 0; l < tc->n_layers; l++) {
                if (tc->layer_kinds[l] != DF_LAYER_LINEAR_ATTENTION) continue;
                if (memcmp(g_sess->layer[l].ssm_state, ref->layer[l].ssm_state, df_gdn_ssm_bytes(ref)) != 0 ||
                    memcmp(g_sess->layer[l].conv_state, ref->layer[l].conv_state, df_gdn_conv_bytes(ref)) != 0)
                    fail_msg("corrupt %d, stop at %d: layer %d's GDN states after speculative decoding differ from "
                             "those of its tokens",
                             corrupt, at, l);
            }
            df_gen_result_free(&got);
        }
    df_gen_result_free(&full);
    df_session_free(ref);
}

/* Stop tokens and max_tokens that fall inside a block. */
static void test_stops_inside_block(void **state) {
    (void)state;
    for (int i = 0; i < (n_prompts() < 12 ? 3 : 12); i++) {
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = GEN;
        df_gen_result full;
        plain(g_prompts[i], g_plen[i], &gp, &full);
        /* a stop id taken from the middle of the plain output */
        gp.stop_ids[0] = full.ids[5 + i % 9];
        gp.n_stop_ids = 1;
        df_gen_result want;
        plain(g_prompts[i], g_plen[i], &gp, &want);
        assert_int_equal(want.finish, DF_FINISH_STOP);
        const int blocks[] = {4, 8, 16};
        for (int b = 0; b < 3; b++) {
            df_spec_params sp = df_spec_params_default();
            sp.no_fallback = 1; /* every round drafts */
            sp.block = blocks[b];
            replay r = {.plain = full.ids, .n_plain = full.n_ids, .corrupt = -1};
            sp.override = replay_propose;
            sp.override_user = &r;
            spec_check(g_prompts[i], g_plen[i], &gp, &sp, &want, "stop id in block", i);
        }
        df_gen_result_free(&want);
        /* max_tokens inside a block */
        gp.n_stop_ids = 0;
        gp.max_tokens = 3 + i;
        plain(g_prompts[i], g_plen[i], &gp, &want);
        assert_int_equal(want.n_ids, 3 + i);
        for (int b = 0; b < 3; b++) {
            df_spec_params sp = df_spec_params_default();
            sp.no_fallback = 1; /* every round drafts */
            sp.block = blocks[b];
            replay r = {.plain = full.ids, .n_plain = full.n_ids, .corrupt = -1};
            sp.override = replay_propose;
            sp.override_user = &r;
            spec_check(g_prompts[i], g_plen[i], &gp, &sp, &want, "max_tokens in block", i);
        }
        df_gen_result_free(&want);
        df_gen_result_free(&full);
    }
}

/* Prompts longer than the drafter window (48) and generation crossing it; adaptive blocks. */
static void test_window_and_adaptive(void **state) {
    (void)state;
    df_error err = {0};
    int32_t longp[300];
    for (int k = 0; k < 300; k++) longp[k] = g_prompts[k % N_PROMPTS][k % g_plen[k % N_PROMPTS]];
    df_gen_params gp = df_gen_params_default();
    gp.max_tokens = 60;
    df_gen_result want;
    plain(longp, 300, &gp, &want);
    df_spec_params sp = df_spec_params_default();
    sp.no_fallback = 1; /* every round drafts */
    sp.block = 8;
    spec_check(longp, 300, &gp, &sp, &want, "long prompt, window 48", 0);
    sp.adaptive = 1;
    sp.block_min = 2;
    sp.block_max = 16;
    spec_check(longp, 300, &gp, &sp, &want, "adaptive", 0);
    assert_true(df_draft_state_len(g_ds) <= 48);
    /* a sampled request is refused */
    gp.sampling.temperature = 0.7f;
    df_gen_result got;
    assert_int_equal(df_generate_speculative(g_sess, g_ds, longp, 10, &gp, &sp, NULL, NULL, &got, &err),
                     DF_ERR_INVALID_ARG);
    df_gen_result_free(&want);
}

/* The DFlash2 drafter (sliding-window layers, dynamic convolutions, candidate selector)
 * drives the same rounds: output identical to plain decoding. */
static void test_dflash2_exact(void **state) {
    (void)state;
    df_error err = {0};
    df_drafter *d2 = NULL;
    if (df_drafter_load(&d2, tu_fixture("tiny-dflash2"), g_eng, &err) != DF_OK) fail_msg("%s", err.msg);
    df_draft_state *ds2 = NULL;
    assert_int_equal(df_draft_state_init(&ds2, d2, 32, &err), DF_OK);
    df_draft_state *saved = g_ds;
    g_ds = ds2;
    const int blocks[] = {4, 8, 16};
    for (int i = 0; i < (n_prompts() < 12 ? 3 : 12); i++) {
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = GEN;
        df_gen_result want;
        plain(g_prompts[i], g_plen[i], &gp, &want);
        for (int b = 0; b < 3; b++) {
            df_spec_params sp = df_spec_params_default();
            sp.no_fallback = 1; /* every round drafts */
            sp.block = blocks[b];
            spec_check(g_prompts[i], g_plen[i], &gp, &sp, &want, "dflash2 drafter", i);
        }
        df_gen_result_free(&want);
    }
    g_ds = saved;
    df_draft_state_free(ds2);
    df_drafter_free(d2);
}

/* A drafter quantized at load (8 and 4 bits): its logits stay close to the bf16 drafter's
 * (quantization error: half a step of (max − min)/(2^bits − 1) per weight), it refuses bad
 * bit counts and a second quantization, and speculative output still equals plain output. */
static void test_quantized_drafter(void **state) {
    (void)state;
    df_error err = {0};
    const int bits[] = {8, 4};
    const double bound[] = {0.05, 0.5}; /* max |Δ logit| / max |logit| */
    const int V = df_engine_vocab_size(g_eng), B = 8;
    float *ref = malloc((size_t)(B - 1) * V * sizeof(float)), *got = malloc((size_t)(B - 1) * V * sizeof(float));
    int32_t drafts[16];
    /* context: the target's taps over a prompt, through the speculative path's own helper */
    df_gen_params gp = df_gen_params_default();
    gp.max_tokens = 4;
    df_spec_params sp0 = df_spec_params_default();
    sp0.no_fallback = 1;
    sp0.block = 4;
    df_gen_result r0;
    if (df_generate_speculative(g_sess, g_ds, g_prompts[3], g_plen[3], &gp, &sp0, NULL, NULL, &r0, &err) != DF_OK)
        fail_msg("%s", err.msg);
    df_gen_result_free(&r0);
    const int ctx = df_draft_state_len(g_ds);
    assert_true(ctx > 0);
    if (df_draft_block(g_ds, 5, ctx, B, drafts, NULL, ref, &err) != DF_OK) fail_msg("%s", err.msg);
    for (int q = 0; q < 2; q++) {
        df_drafter *dq = NULL;
        df_draft_state *dsq = NULL;
        if (df_drafter_load(&dq, tu_fixture("tiny-dflash"), g_eng, &err) != DF_OK) fail_msg("%s", err.msg);
        assert_int_equal(df_drafter_quantize(dq, 3, &err), DF_ERR_INVALID_ARG);
        assert_int_equal(df_drafter_quantize(dq, bits[q], &err), DF_OK);
        assert_int_equal(df_drafter_quant_bits(dq), bits[q]);
        assert_int_equal(df_drafter_quantize(dq, bits[q], &err), DF_ERR_INVALID_ARG);
        assert_int_equal(df_draft_state_init(&dsq, dq, 48, &err), DF_OK);
        /* same context rows as g_ds: rebuild them by running the same speculative request */
        df_draft_state *saved = g_ds;
        g_ds = dsq;
        if (df_generate_speculative(g_sess, g_ds, g_prompts[3], g_plen[3], &gp, &sp0, NULL, NULL, &r0, &err) != DF_OK)
            fail_msg("%s", err.msg);
        df_gen_result_free(&r0);
        assert_int_equal(df_draft_state_len(dsq), ctx);
        if (df_draft_block(dsq, 5, ctx, B, drafts, NULL, got, &err) != DF_OK) fail_msg("%s", err.msg);
        double d = 0, m = 0;
        for (size_t i = 0; i < (size_t)(B - 1) * V; i++) {
            double e = fabs((double)got[i] - (double)ref[i]);
            if (e > d) d = e;
            if (fabs((double)ref[i]) > m) m = fabs((double)ref[i]);
        }
        printf("drafter quantized to %d bits: logits max |delta| %.3g of max |logit| %.3g\n", bits[q], d, m);
        assert_true(d <= bound[q] * m);
        assert_true(d > 0); /* the weights did change */
        for (int i = 0; i < (n_prompts() < 12 ? 3 : 12); i++) {
            df_gen_params g2 = df_gen_params_default();
            g2.max_tokens = GEN;
            df_gen_result want;
            plain(g_prompts[i], g_plen[i], &g2, &want);
            const int blocks[] = {4, 8, 16};
            for (int b = 0; b < 3; b++) {
                df_spec_params sp = df_spec_params_default();
                sp.no_fallback = 1; /* every round drafts */
                sp.block = blocks[b];
                spec_check(g_prompts[i], g_plen[i], &g2, &sp, &want, "quantized drafter", i);
            }
            df_gen_result_free(&want);
        }
        g_ds = saved;
        df_draft_state_free(dsq);
        df_drafter_free(dq);
    }
    free(ref);
    free(got);
}

/* The plain steps the fallback asks for now (each timed at 6 ms): how many. */
static int plain_run(df_spec_fallback *f) {
    int n = 0;
    while (!df_spec_fallback_draft(f)) {
        df_spec_fallback_record(f, 0, 6.0, 1);
        n++;
    }
    return n;
}

/* The plain-step fallback's decisions from given round times (ms per round, tokens): warm-up
 * rounds are not judged, plain steps are timed once, a drafting that loses to them yields to
 * plain steps for a hold that doubles while it keeps losing and is reset when it wins. */
static void test_fallback_policy(void **state) {
    (void)state;
    df_spec_fallback f;
    df_spec_fallback_init(&f);
    /* warm-up rounds (slow: graph captures) and the first window: drafting throughout */
    for (int i = 0; i < 2 + 4; i++) {
        assert_true(df_spec_fallback_draft(&f));
        df_spec_fallback_record(&f, 1, i < 2 ? 100.0 : 12.0, 3); /* 4 ms per token */
    }
    /* no plain step timed yet: two plain steps */
    for (int i = 0; i < 2; i++) {
        assert_false(df_spec_fallback_draft(&f));
        df_spec_fallback_record(&f, 0, i == 0 ? 9.0 : 6.0, 1); /* the faster one counts: 6 ms */
    }
    /* drafting wins (4 < 6 ms per token): it goes on */
    for (int i = 0; i < 10; i++) {
        assert_true(df_spec_fallback_draft(&f));
        df_spec_fallback_record(&f, 1, 12.0, 3);
    }
    /* drafting loses (10 ms per token): after the window's mean passes 6 ms, 8 plain steps */
    int drafted = 0;
    while (df_spec_fallback_draft(&f)) {
        df_spec_fallback_record(&f, 1, 10.0, 1);
        drafted++;
    }
    assert_true(drafted >= 1 && drafted <= 4);
    int plain = plain_run(&f);
    assert_int_equal(plain, 8);
    /* it loses again after a fresh window: 16 plain steps */
    for (int i = 0; i < 4; i++) {
        assert_true(df_spec_fallback_draft(&f));
        df_spec_fallback_record(&f, 1, 10.0, 1);
    }
    plain = plain_run(&f);
    assert_int_equal(plain, 16);
    /* a fresh window where it wins: drafting goes on, and the hold is back to 8 */
    for (int i = 0; i < 8; i++) {
        assert_true(df_spec_fallback_draft(&f));
        df_spec_fallback_record(&f, 1, 8.0, 4);
    }
    while (df_spec_fallback_draft(&f)) df_spec_fallback_record(&f, 1, 40.0, 1);
    plain = plain_run(&f);
    assert_int_equal(plain, 8);
    /* rounds that commit nothing are ignored */
    df_spec_fallback_record(&f, 1, 1e9, 0);
    assert_true(df_spec_fallback_draft(&f));
    /* four drafted rounds in a row without an accepted draft lose whatever their times, with
     * no plain step timed yet (a fresh state: warm-up rounds count) */
    df_spec_fallback_init(&f);
    for (int i = 0; i < 3; i++) {
        df_spec_fallback_record(&f, 1, 0.001, 1);
        assert_true(df_spec_fallback_draft(&f));
    }
    df_spec_fallback_record(&f, 1, 0.001, 2); /* an accepted draft breaks the run */
    df_spec_fallback_record(&f, 1, 0.001, 1);
    assert_true(df_spec_fallback_draft(&f));
    df_spec_fallback_init(&f);
    for (int i = 0; i < 3; i++) {
        df_spec_fallback_record(&f, 1, 0.001, 1);
        assert_true(df_spec_fallback_draft(&f));
    }
    df_spec_fallback_record(&f, 1, 0.001, 1);
    plain = plain_run(&f);
    assert_int_equal(plain, 8);
}

/* With the fallback on (the default) and drafts that are never accepted, drafting is measured
 * slower than plain steps (a drafter pass and a verify pass of B rows for each token), so
 * plain steps take over; the output is plain decoding's. */
static void test_fallback_exact(void **state) {
    (void)state;
    const int np = n_prompts() < 4 ? n_prompts() : 4;
    for (int i = 0; i < np; i++) {
        df_gen_params gp = df_gen_params_default();
        gp.max_tokens = 64;
        df_gen_result want;
        plain(g_prompts[i], g_plen[i], &gp, &want);
        replay r = {.plain = want.ids, .n_plain = want.n_ids, .corrupt = 0};
        df_spec_params sp = df_spec_params_default();
        sp.block = 8;
        sp.override = replay_propose;
        sp.override_user = &r;
        df_gen_result got;
        df_error err = {0};
        assert_int_equal(df_generate_speculative(g_sess, g_ds, g_prompts[i], g_plen[i], &gp, &sp, NULL, NULL, &got, &err),
                         DF_OK);
        assert_int_equal(got.n_ids, want.n_ids);
        assert_memory_equal(got.ids, want.ids, (size_t)want.n_ids * sizeof(int32_t));
        assert_int_equal(got.draft_n_accepted, 0);
        /* one token per round: 4 drafted rounds, 8 plain steps, 4 drafted, 16 plain, 4
         * drafted, 32 plain: at most 12 drafted rounds in 64 tokens */
        assert_true(got.draft_rounds >= 1);
        if (want.n_ids >= 32) assert_true(got.draft_rounds <= 12);
        printf("fallback, prompt %d: %d of %d tokens from drafted rounds\n", i, got.draft_rounds, want.n_ids);
        df_gen_result_free(&got);
        df_gen_result_free(&want);
    }
}

/* should_stop: counts the polls and asks to stop at poll number `at`. */
typedef struct stop_probe {
    int polls, at;
} stop_probe;

static int stop_at(void *user) {
    stop_probe *p = user;
    return ++p->polls >= p->at;
}

static int never_cancel_text(void *user, int32_t id, const char *text, size_t len) {
    (void)user, (void)id, (void)text, (void)len;
    return 0;
}

/* df_generate (spec 0) or df_generate_speculative (spec 1) of prompt[n], which must succeed. */
static void gen_either(int spec, const int32_t *prompt, int n, const df_gen_params *gp, void *user, df_gen_result *res) {
    df_error err = {0};
    df_status st = spec ? df_generate_speculative(g_sess, g_ds, prompt, n, gp, NULL, never_cancel_text, user, res, &err)
                        : df_generate(g_sess, prompt, n, gp, never_cancel_text, user, res, &err);
    if (st != DF_OK) fail_msg("%s: %s", spec ? "speculative" : "plain", err.msg);
}

/* A stop asked for during prefill takes effect before the next chunk of 16 prompt tokens, in
 * plain and speculative generation: no token is generated and the rest of the prompt is not
 * run; a should_stop that never fires is polled once per chunk and changes nothing. */
static void test_stop_during_prefill(void **state) {
    (void)state;
    int32_t prompt[90];
    for (int k = 0; k < 90; k++) prompt[k] = g_prompts[k % N_PROMPTS][k % 8];
    df_gen_params gp = df_gen_params_default();
    gp.max_tokens = 4;
    df_gen_result want;
    plain(prompt, 90, &gp, &want);
    gp.should_stop = stop_at;
    for (int spec = 0; spec < 2; spec++) {
        for (int at = 1; at <= 3; at++) {
            stop_probe probe = {0, at};
            df_gen_result res;
            gen_either(spec, prompt, 90, &gp, &probe, &res);
            assert_int_equal(res.finish, DF_FINISH_CANCELLED);
            assert_int_equal(res.n_ids, 0);
            assert_string_equal(res.text, "");
            assert_int_equal(probe.polls, at);
            assert_int_equal(df_session_pos(g_sess), 16 * (at - 1)); /* the chunks before the stop ran */
            df_gen_result_free(&res);
        }
        stop_probe never = {0, 1 << 30};
        df_gen_result res;
        gen_either(spec, prompt, 90, &gp, &never, &res);
        assert_int_equal(never.polls, 6); /* ceil(90 / 16) chunks */
        assert_int_equal(res.n_ids, want.n_ids);
        assert_memory_equal(res.ids, want.ids, (size_t)want.n_ids * sizeof(int32_t));
        df_gen_result_free(&res);
    }
    df_gen_result_free(&want);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exact_all_patterns),
        cmocka_unit_test(test_each_partial_length),
        cmocka_unit_test(test_plain_loop_paths),
        cmocka_unit_test(test_ids_through_host),
        cmocka_unit_test(test_stops_inside_block),
        cmocka_unit_test(test_states_at_end),
        cmocka_unit_test(test_window_and_adaptive),
        cmocka_unit_test(test_dflash2_exact),
        cmocka_unit_test(test_quantized_drafter),
        cmocka_unit_test(test_fallback_policy),
        cmocka_unit_test(test_fallback_exact),
        cmocka_unit_test(test_stop_during_prefill),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
