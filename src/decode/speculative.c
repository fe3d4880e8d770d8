/* Speculative decoding loop (include/dflash/speculative.h). */
#include <stdlib.h>
#include <string.h>

#include "core/threads.h"
#include "decode/textout.h"
#include "dflash/speculative.h"
#include "model/target.h"

int df_spec_default_block(const df_drafter_config *dc) {
    int b = dc->block_size < 4 ? dc->block_size : 4;
    return b < 2 ? 2 : b;
}

df_spec_params df_spec_params_default(void) {
    df_spec_params p;
    memset(&p, 0, sizeof p);
    p.block_min = 2;
    p.block_max = DF_MAX_ROWS;
    return p;
}

/* ---- the plain-step fallback (speculative.h) ---- */
#define FALLBACK_WARM 2
#define FALLBACK_PLAIN_PROBE 2
#define FALLBACK_WINDOW 4
#define FALLBACK_HOLD_MIN 8
#define FALLBACK_HOLD_MAX 256
#define FALLBACK_ZERO_RUN 4

void df_spec_fallback_init(df_spec_fallback *f) {
    memset(f, 0, sizeof *f);
    f->plain_best = -1.0;
    f->warm = FALLBACK_WARM;
    f->hold = FALLBACK_HOLD_MIN;
}

int df_spec_fallback_draft(const df_spec_fallback *f) { return f->plain_left == 0; }

void df_spec_fallback_record(df_spec_fallback *f, int drafted, double ms, int tokens) {
    if (tokens < 1) return;
    const double per = ms / (double)tokens;
    if (!drafted) {
        if (f->plain_left > 0) f->plain_left--;
        if (f->plain_best < 0.0 || per < f->plain_best) f->plain_best = per;
        f->zero_run = 0; /* drafting is judged afresh after plain steps */
        return;
    }
    /* a drafted round that committed one token cost more than a plain step whatever the
     * clock says (a drafter pass and a verify pass of several rows for it): a run of them
     * is a loss without timing */
    f->zero_run = tokens == 1 ? f->zero_run + 1 : 0;
    if (f->zero_run >= FALLBACK_ZERO_RUN) {
        f->zero_run = 0;
        f->plain_left = f->hold;
        f->hold = f->hold * 2 <= FALLBACK_HOLD_MAX ? f->hold * 2 : FALLBACK_HOLD_MAX;
        f->n_recent = 0;
        return;
    }
    if (f->warm > 0) {
        f->warm--;
        return;
    }
    f->recent[f->n_recent % FALLBACK_WINDOW] = per;
    f->n_recent++;
    if (f->n_recent < FALLBACK_WINDOW) return;
    if (f->plain_best < 0.0) {
        f->plain_left = FALLBACK_PLAIN_PROBE; /* time plain steps once */
        return;
    }
    double mean = 0.0;
    for (int i = 0; i < FALLBACK_WINDOW; i++) mean += f->recent[i];
    mean /= FALLBACK_WINDOW;
    if (mean > f->plain_best) {
        f->plain_left = f->hold;
        f->hold = f->hold * 2 <= FALLBACK_HOLD_MAX ? f->hold * 2 : FALLBACK_HOLD_MAX;
        f->n_recent = 0; /* drafting is judged afresh after the plain steps */
    } else {
        f->hold = FALLBACK_HOLD_MIN;
    }
}

/* Per-round scratch: tap features, and the verify pass's GDN projections and states. */
typedef struct spec_ctx {
    df_session *s;
    const df_drafter_config *dc;
    int H, F;               /* hidden, n_taps*hidden */
    float *feats;           /* [DF_MAX_ROWS, F] host: tap outputs of the current tile (host_ctx only) */
    float *dtaps;           /* [DF_MAX_ROWS, F] backend memory: the current forward pass's taps, as the drafter
                               takes them (tap t of row m at m·F + t·H) */
    int host_ctx;           /* the drafter runs on another backend: its context goes through the host */
    int tap_index[256];     /* target layer -> tap slot (or -1); layers beyond 256 never tap */
    /* the verify pass's GDN projections and advanced states, per layer (NULL for attention
     * layers; backend memory): df_gdn_redirect */
    float **alt_conv, **alt_ssm;
    float **rec_qkv, **rec_z, **rec_a, **rec_b;
    df_gdn_redirect redirect;
    df_gdn_layer *replay; /* [n_layers]: settle_gdn's replay of the accepted rows */
    /* ids kept in backend memory (the drafter on the target's backend, df_draft_device_ok):
     * the verify pass reads the block's ids where the drafter wrote them, so the host queues
     * it behind the drafter pass without waiting (df_backend_ops.submit) */
    int32_t *dids; /* [2 * DF_MAX_ROWS]: the block's ids, then the target's greedy tokens */
} spec_ctx;

/* Copies a tap layer's rows into their columns of dtaps on the device (one strided copy; no
 * host round trip). */
static void on_tap(void *user, int layer, const float *x, int M) {
    spec_ctx *c = user;
    if (layer >= 256 || c->tap_index[layer] < 0) return;
    df_backend *be = c->s->be;
    const size_t H = (size_t)c->H, F = (size_t)c->F, slot = (size_t)c->tap_index[layer];
    if (be->ops->copy_rows)
        be->ops->copy_rows(be, c->dtaps + slot * H, F * sizeof(float), x, H * sizeof(float), H * sizeof(float), M);
    else
        for (int m = 0; m < M; m++)
            be->ops->copy(be, c->dtaps + (size_t)m * F + slot * H, x + (size_t)m * H, H * sizeof(float));
}

/* The taps of the last forward pass, rows skip.. of them, into the drafter's context at positions
 * first_pos.. (on the device where the drafter shares the target's backend). */
static df_status add_taps(spec_ctx *c, df_draft_state *ds, int skip, int n, int32_t first_pos, df_error *err) {
    const size_t F = (size_t)c->F;
    if (!c->host_ctx) return df_draft_add_context_device(ds, c->dtaps + (size_t)skip * F, n, first_pos, err);
    c->s->be->ops->to_host(c->s->be, c->feats, c->dtaps + (size_t)skip * F, (size_t)n * F * sizeof(float));
    return df_draft_add_context(ds, c->feats, n, first_pos, err);
}

static void ctx_free(spec_ctx *c) {
    const df_text_config *tc = &c->s->eng->pack->cfg;
    df_backend *be = c->s->be;
    float **arrs[] = {c->alt_conv, c->alt_ssm, c->rec_qkv, c->rec_z, c->rec_a, c->rec_b};
    for (size_t i = 0; i < 6; i++) {
        if (!arrs[i]) continue;
        for (int l = 0; l < tc->n_layers; l++) be->ops->dealloc(be, arrs[i][l]);
        free(arrs[i]);
    }
    if (c->dtaps) be->ops->dealloc(be, c->dtaps);
    if (c->dids) be->ops->dealloc(be, c->dids);
    free(c->replay);
    free(c->feats);
}

static df_status ctx_init(spec_ctx *c, df_session *s, df_draft_state *ds, df_error *err) {
    const df_drafter_config *dc = df_drafter_get_config(df_draft_state_drafter(ds));
    memset(c, 0, sizeof *c);
    c->s = s;
    c->dc = dc;
    const df_text_config *tc = &s->eng->pack->cfg;
    df_backend *be = s->be;
    c->H = tc->hidden_size;
    c->F = dc->n_taps * c->H;
    for (int i = 0; i < 256; i++) c->tap_index[i] = -1;
    for (int i = 0; i < dc->n_taps; i++)
        if (dc->taps[i] < 256) c->tap_index[dc->taps[i]] = i;
    /* a drafter on another backend takes its context from the host */
    c->host_ctx = df_drafter_engine(df_draft_state_drafter(ds))->be != s->be;
    if (c->host_ctx) c->feats = malloc((size_t)DF_MAX_ROWS * (size_t)c->F * sizeof(float));
    c->dtaps = be->ops->alloc(be, (size_t)DF_MAX_ROWS * (size_t)c->F * sizeof(float));
    if (!c->host_ctx && df_draft_device_ok(ds) && be->ops->embed_dev) {
        c->dids = be->ops->alloc(be, 2 * DF_MAX_ROWS * sizeof(int32_t));
        if (!c->dids) goto oom;
    }
    const int L = tc->n_layers;
    float ***arrs[] = {&c->alt_conv, &c->alt_ssm, &c->rec_qkv, &c->rec_z, &c->rec_a, &c->rec_b};
    for (size_t i = 0; i < 6; i++) *arrs[i] = calloc((size_t)L, sizeof(float *));
    c->replay = calloc((size_t)L, sizeof *c->replay);
    if ((c->host_ctx && !c->feats) || !c->dtaps || !c->alt_conv || !c->alt_ssm || !c->rec_qkv || !c->rec_z ||
        !c->rec_a || !c->rec_b || !c->replay)
        goto oom;
    c->redirect = (df_gdn_redirect){.qkv = c->rec_qkv, .z = c->rec_z, .a = c->rec_a, .b = c->rec_b,
                                    .conv = c->alt_conv, .ssm = c->alt_ssm};
    const size_t nv = (size_t)tc->lin_n_v_heads, Vd = nv * (size_t)tc->lin_v_head_dim, R = DF_MAX_ROWS;
    for (int l = 0; l < L; l++) {
        if (tc->layer_kinds[l] != DF_LAYER_LINEAR_ATTENTION) continue;
        c->alt_conv[l] = be->ops->alloc(be, df_gdn_conv_bytes(s) + sizeof(float));
        c->alt_ssm[l] = be->ops->alloc(be, df_gdn_ssm_bytes(s));
        c->rec_qkv[l] = be->ops->alloc(be, R * (size_t)s->conv_ch * sizeof(float));
        c->rec_z[l] = be->ops->alloc(be, R * Vd * sizeof(float));
        c->rec_a[l] = be->ops->alloc(be, R * nv * sizeof(float));
        c->rec_b[l] = be->ops->alloc(be, R * nv * sizeof(float));
        if (!c->alt_conv[l] || !c->alt_ssm[l] || !c->rec_qkv[l] || !c->rec_z[l] || !c->rec_a[l] || !c->rec_b[l])
            goto oom;
    }
    return DF_OK;
oom:
    ctx_free(c);
    return df_error_set(err, DF_ERR_NOMEM, "speculative decoding: out of memory for rollback buffers");
}

/* After a verify pass of Bv rows that wrote its GDN states to alt_*: all rows accepted (rows ==
 * Bv): the states become the session's (the buffers trade places: each array keeps one buffer
 * of every pair, so each is still freed once); otherwise the session's states (still those of
 * the start of the round) advance by replaying rows 0..rows-1 of the pass. */
static void settle_gdn(spec_ctx *c, int rows, int Bv) {
    df_session *s = c->s;
    const df_pack *pk = s->eng->pack;
    const df_text_config *tc = &pk->cfg;
    const df_gdn_shape gsh = {.n_k_heads = tc->lin_n_k_heads, .n_v_heads = tc->lin_n_v_heads,
                              .k_head_dim = tc->lin_k_head_dim, .v_head_dim = tc->lin_v_head_dim,
                              .conv_kernel = tc->conv_kernel, .eps = tc->rms_norm_eps};
    int n = 0;
    for (int l = 0; l < tc->n_layers; l++) {
        if (!c->alt_conv[l]) continue;
        df_session_layer *sl = &s->layer[l];
        const df_layer_weights *w = &pk->layers[l];
        if (rows == Bv) {
            float *t = sl->conv_state;
            sl->conv_state = c->alt_conv[l];
            c->alt_conv[l] = t;
            t = sl->ssm_state;
            sl->ssm_state = c->alt_ssm[l];
            c->alt_ssm[l] = t;
        } else {
            c->replay[n++] = (df_gdn_layer){.qkv = c->rec_qkv[l], .z = c->rec_z[l], .a = c->rec_a[l], .b = c->rec_b[l],
                                            .conv_w = w->conv1d.data, .A_log = w->A_log.data,
                                            .dt_bias = w->dt_bias.data, .norm_w = w->gdn_norm.data,
                                            .conv_state = sl->conv_state, .S = sl->ssm_state};
        }
    }
    if (n == 0) return;
    /* every layer's replay at once where the backend can (the same bits as one `gdn` each) */
    if (s->be->ops->gdn_states) {
        s->be->ops->gdn_states(s->be, &gsh, rows, n, c->replay);
        return;
    }
    for (int i = 0; i < n; i++) {
        const df_gdn_layer *r = &c->replay[i];
        s->be->ops->gdn(s->be, &gsh, r->qkv, r->z, r->a, r->b, r->conv_w, r->A_log, r->dt_bias, r->norm_w, rows,
                        r->conv_state, r->S, NULL);
    }
}

/* Adds the wall time since *tp to phase k of ph (when `round`: not for a plain step outside
 * any round) and restarts the clock; with sp->phase_sync, first waits for the device (a 4-byte
 * read back). */
static void phase_end(spec_ctx *c, const df_spec_params *sp, double *ph, int k, double *tp, int round) {
    if (sp->phase_sync) {
        float v;
        c->s->be->ops->to_host(c->s->be, &v, c->dtaps, sizeof v);
    }
    const double t = df_now_ms();
    if (round) ph[k] += t - *tp;
    *tp = t;
}

df_status df_generate_speculative(df_session *s, df_draft_state *ds, const int32_t *prompt, int n_prompt,
                                  const df_gen_params *params, const df_spec_params *sp_in, df_gen_callback cb,
                                  void *user, df_gen_result *res, df_error *err) {
    memset(res, 0, sizeof *res);
    res->n_prompt = n_prompt;
    df_engine *eng = s->eng;
    const int V = eng->pack->cfg.vocab_size;
    const df_drafter_config *dc = df_drafter_get_config(df_draft_state_drafter(ds));
    df_spec_params sp = sp_in ? *sp_in : df_spec_params_default();
    if (params->sampling.temperature > 0.0f || params->n_forced_ids > 0)
        return df_error_set(err, DF_ERR_INVALID_ARG, "speculative decoding serves greedy requests only");
    if (sp.block == 0) sp.block = df_spec_default_block(dc);
    if (sp.block_min == 0) sp.block_min = 2;
    if (sp.block_max == 0) sp.block_max = DF_MAX_ROWS;
    if (sp.block < 2 || sp.block > DF_MAX_ROWS || sp.block_min < 2 || sp.block_max > DF_MAX_ROWS ||
        sp.block_min > sp.block_max)
        return df_error_set(err, DF_ERR_INVALID_ARG, "draft block sizes must lie within 2..%d (block %d, range %d..%d)",
                            DF_MAX_ROWS, sp.block, sp.block_min, sp.block_max);
    if (n_prompt <= 0) return df_error_set(err, DF_ERR_INVALID_ARG, "empty prompt");
    if (n_prompt >= s->max_ctx)
        return df_error_set(err, DF_ERR_RANGE, "prompt of %d tokens does not fit the context of %d", n_prompt,
                            s->max_ctx);
    for (int i = 0; i < params->n_stop; i++)
        if (!params->stop[i] || !params->stop[i][0])
            return df_error_set(err, DF_ERR_INVALID_ARG, "stop string %d is empty", i);

    spec_ctx c;
    df_status st = ctx_init(&c, s, ds, err);
    if (st != DF_OK) return st;
    float *logits = malloc((size_t)DF_MAX_ROWS * (size_t)V * sizeof(float));
    if (!logits) {
        ctx_free(&c);
        return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    }
    df_textout out;
    df_textout_init(&out, eng->tok, params, cb, user);
    df_session_reset(s);
    df_draft_state_reset(ds);
    s->tap_user = &c;
    const int window = df_draft_state_window(ds);

    /* prefill, feeding the drafter the taps of the last `window` prompt rows (taps only on
     * the tiles that hold them) */
    double t0 = df_now_ms();
    for (int i = 0; i < n_prompt && st == DF_OK; i += DF_MAX_ROWS) {
        if (params->should_stop && params->should_stop(user)) {
            out.finish = DF_FINISH_CANCELLED;
            break;
        }
        int M = n_prompt - i < DF_MAX_ROWS ? n_prompt - i : DF_MAX_ROWS;
        int last = i + M == n_prompt;
        const int in_window = i + M > n_prompt - window;
        s->tap = in_window ? on_tap : NULL;
        st = df_target_forward_rows(s, prompt + i, M, last ? logits : NULL, M - 1, err);
        if (st == DF_OK && in_window) {
            int skip = n_prompt - window > i ? n_prompt - window - i : 0;
            st = add_taps(&c, ds, skip, M - skip, i + skip, err);
        }
    }
    s->tap = on_tap;
    double t1 = df_now_ms();
    res->prompt_ms = t1 - t0;
    int cap_tokens = s->max_ctx - n_prompt;
    int max_tokens = params->max_tokens > 0 && params->max_tokens < cap_tokens ? params->max_tokens : cap_tokens;

    int32_t bonus = 0;
    if (st == DF_OK && out.finish == DF_FINISH_NONE) {
        bonus = df_argmax(logits, V);
        if (bonus < 0) st = df_gen_non_finite(err, 0);
        if (st == DF_OK) st = df_textout_push(&out, bonus, df_gen_is_stop_id(eng, params, bonus), err);
        if (st == DF_OK && out.finish == DF_FINISH_NONE && out.n_ids >= max_tokens) out.finish = DF_FINISH_LENGTH;
    }
    int B = sp.block;
    double ph_ms[4] = {0, 0, 0, 0}; /* draft, verify, settle, context */
    df_spec_fallback fb;
    df_spec_fallback_init(&fb);
    int plain_steps = 0;
    while (st == DF_OK && out.finish == DF_FINISH_NONE) {
        const int p0 = s->pos; /* position of the bonus token */
        double tp = df_now_ms();
        const double t_round = tp;
        int Bv = sp.no_fallback || df_spec_fallback_draft(&fb) ? B : 1;
        if (Bv > max_tokens - out.n_ids) Bv = max_tokens - out.n_ids; /* a round commits at most Bv tokens */
        if (Bv > s->max_ctx - p0) Bv = s->max_ctx - p0;
        int32_t rows[DF_MAX_ROWS];
        rows[0] = bonus;
        const int dev = Bv >= 2 && c.dids; /* the block's ids stay on the device */
        if (dev) {
            s->be->ops->to_device(s->be, c.dids, &bonus, sizeof bonus);
            st = df_draft_block_dev(ds, bonus, p0, Bv, c.dids + 1, err);
            if (st != DF_OK) break;
            if (sp.override) {
                sp.override(sp.override_user, out.n_ids, bonus, Bv, rows + 1);
                for (int m = 1; m < Bv && st == DF_OK; m++)
                    if (rows[m] < 0 || rows[m] >= V)
                        st = df_error_set(err, DF_ERR_INVALID_ARG, "token id %d outside [0, %d)", rows[m], V);
                if (st != DF_OK) break;
                s->be->ops->to_device(s->be, c.dids + 1, rows + 1, (size_t)(Bv - 1) * sizeof(int32_t));
            }
            if (s->be->ops->submit) s->be->ops->submit(s->be); /* the drafter pass runs while the verify is recorded */
        } else if (Bv >= 2) {
            st = df_draft_block(ds, bonus, p0, Bv, rows + 1, NULL, NULL, err);
            if (st != DF_OK) break;
            if (sp.override) sp.override(sp.override_user, out.n_ids, bonus, Bv, rows + 1);
        } else {
            Bv = 1; /* one token left, or the fallback's turn: a plain decode step */
        }
        phase_end(&c, &sp, ph_ms, 0, &tp, Bv >= 2);
        /* the verify pass leaves the session's GDN states as they were (settle_gdn) */
        s->gdn_redirect = Bv >= 2 ? &c.redirect : NULL;
        int32_t t[DF_MAX_ROWS]; /* the target's greedy token after each row (argmax where the logits are) */
        if (dev) {
            st = df_target_forward_argmax_dev(s, c.dids, Bv, c.dids + DF_MAX_ROWS, err);
            if (st == DF_OK) { /* the block's ids and the target's tokens in one read */
                int32_t both[2 * DF_MAX_ROWS];
                s->be->ops->to_host(s->be, both, c.dids, sizeof both);
                if (s->be->failed) {
                    s->be->failed = 0;
                    st = df_error_set(err, DF_ERR_INTERNAL, "verify: the backend failed to return its tokens");
                    break;
                }
                memcpy(rows, both, (size_t)Bv * sizeof(int32_t));
                memcpy(t, both + DF_MAX_ROWS, (size_t)Bv * sizeof(int32_t));
            }
        } else {
            st = df_target_forward_argmax(s, rows, Bv, t, err);
        }
        s->gdn_redirect = NULL;
        if (st != DF_OK) break;
        phase_end(&c, &sp, ph_ms, 1, &tp, Bv >= 2);
        int a = 0;
        while (a < Bv - 1 && rows[a + 1] == t[a]) a++;
        if (t[a] < 0) { /* the logits after the last accepted row (the ones plain decoding reads) */
            st = df_gen_non_finite(err, out.n_ids + a);
            break;
        }
        /* keep the accepted rows 0..a: positions, and the GDN states */
        s->pos = p0 + a + 1;
        if (Bv >= 2) settle_gdn(&c, a + 1, Bv);
        phase_end(&c, &sp, ph_ms, 2, &tp, Bv >= 2);
        if (Bv >= 2) {
            res->draft_rounds++;
            res->draft_n += Bv - 1;
            res->draft_n_accepted += a;
        } else {
            plain_steps++;
        }
        /* commit d_1..d_a then t_a; stop tokens, stop strings and max_tokens cut the block */
        for (int k = 1; k <= a + 1 && out.finish == DF_FINISH_NONE && st == DF_OK; k++) {
            int32_t id = k <= a ? rows[k] : t[a];
            st = df_textout_push(&out, id, df_gen_is_stop_id(eng, params, id), err);
            if (st == DF_OK && out.finish == DF_FINISH_NONE && out.n_ids >= max_tokens) out.finish = DF_FINISH_LENGTH;
        }
        if (st != DF_OK || out.finish != DF_FINISH_NONE) break;
        st = add_taps(&c, ds, 0, a + 1, p0, err);
        phase_end(&c, &sp, ph_ms, 3, &tp, Bv >= 2);
        bonus = t[a];
        if (sp.adaptive && Bv >= 2) {
            if (a == Bv - 1) B = B + 2 <= sp.block_max ? B + 2 : sp.block_max;
            else if (2 * (a + 1) < Bv) B = B - 2 >= sp.block_min ? B - 2 : sp.block_min;
        }
        df_spec_fallback_record(&fb, Bv >= 2, df_now_ms() - t_round, a + 1);
    }
    s->tap = NULL;
    s->gdn_redirect = NULL;
    res->decode_ms = df_now_ms() - t1;
    int rounds = res->draft_rounds, dn = res->draft_n, da = res->draft_n_accepted;
    df_textout_finish(&out, res);
    res->draft_rounds = rounds;
    res->draft_n = dn;
    res->draft_n_accepted = da;
    res->plain_steps = plain_steps;
    res->draft_ms = ph_ms[0];
    res->verify_ms = ph_ms[1];
    res->settle_ms = ph_ms[2];
    res->context_ms = ph_ms[3];
    free(logits);
    ctx_free(&c);
    return st;
}
