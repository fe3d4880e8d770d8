/* Internal definitions of the engine and session (include/dflash/engine.h), shared by the
 * target forward pass and the speculative decoder. */
#ifndef DFLASH_MODEL_TARGET_H
#define DFLASH_MODEL_TARGET_H

#include "backend/backend.h"
#include "dflash/engine.h"

struct df_engine {
    df_pack *pack;
    df_tokenizer *tok;
    df_backend *be;
};

typedef struct df_session_layer {
    float *k_cache, *v_cache;    /* attention: [kv_cap, n_kv, head_dim] (backend memory) */
    float *conv_state;           /* GDN: [K-1, conv_ch] */
    float *ssm_state;            /* GDN: [nv, dk, dv] */
} df_session_layer;

/* Called with each GDN layer's projections (qkv [M, C], z [M, Vd], a, b [M, nv]) before the
 * recurrence runs: lets the speculative decoder replay accepted rows on rollback. */
typedef void (*df_gdn_record_fn)(void *user, int layer, const float *qkv, const float *z, const float *a,
                                 const float *b, int M);
/* Called with the residual stream [M, hidden] after each layer (drafter context taps). */
typedef void (*df_tap_fn)(void *user, int layer, const float *x, int M);

struct df_session {
    df_engine *eng;
    df_backend *be;
    int pos, max_ctx, kv_cap, conv_ch;
    df_session_layer *layer;     /* [n_layers] */
    /* one tile of activations (backend memory) */
    float *x, *h, *y, *t1, *t2, *t3, *t4, *ta, *tb, *logits;
    /* test hook (df_session_capture_hidden) */
    float *capture;
    int capture_n, capture_row;
    /* speculative decoding hooks */
    df_gdn_record_fn gdn_record;
    void *gdn_record_user;
    df_tap_fn tap;
    void *tap_user;
};

/* Runs one tile of M <= DF_MAX_ROWS tokens at positions s->pos.. and advances s->pos.
 * logits (host, [M - logits_from, vocab]) receives rows logits_from.. when non-NULL.
 * Errors: DF_ERR_RANGE (context full), DF_ERR_INVALID_ARG (token id), DF_ERR_NOMEM. */
df_status df_target_forward_rows(df_session *s, const int32_t *ids, int M, float *logits, int logits_from,
                                 df_error *err);

/* As df_target_forward_rows, but instead of logits returns argmax[M] (host): the greedy token
 * after each row, computed where the logits are (backend argmax op), so a device backend
 * copies M ids instead of M x vocab floats. Same errors. */
df_status df_target_forward_argmax(df_session *s, const int32_t *ids, int M, int32_t *argmax, df_error *err);

#endif
