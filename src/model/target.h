/* Internal definitions of the engine and session (include/dflash/engine.h), shared by the
 * target forward pass and the speculative decoder. */
#ifndef DFLASH_MODEL_TARGET_H
#define DFLASH_MODEL_TARGET_H

#include "backend/backend.h"
#include "dflash/engine.h"
#include "dflash/generate.h"

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

/* Where a speculative verify pass puts what GDN layer l computes (backend memory; entries NULL
 * for attention layers): its projections qkv[l] [M, C], z[l] [M, Vd], a[l], b[l] [M, nv] (kept
 * so that accepted rows can be replayed on rollback), and its advanced states conv[l], ssm[l]
 * (the session's own states stay those of the start of the round). */
typedef struct df_gdn_redirect {
    float **qkv, **z, **a, **b;
    float **conv, **ssm;
} df_gdn_redirect;
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
    const df_gdn_redirect *gdn_redirect; /* NULL: projections in the tile buffers, states in place */
    df_tap_fn tap;
    void *tap_user;
};

/* Bytes of one GDN layer's conv state [K-1, conv_ch] and recurrent state [nv, dk, dv]. */
size_t df_gdn_conv_bytes(const df_session *s);
size_t df_gdn_ssm_bytes(const df_session *s);

/* Runs one tile of M <= DF_MAX_ROWS tokens at positions s->pos.. and advances s->pos.
 * logits (host, [M - logits_from, vocab]) receives rows logits_from.. when non-NULL.
 * Errors: DF_ERR_RANGE (context full), DF_ERR_INVALID_ARG (token id), DF_ERR_NOMEM. */
df_status df_target_forward_rows(df_session *s, const int32_t *ids, int M, float *logits, int logits_from,
                                 df_error *err);

/* df_session_prefill that first calls stop(user) (when non-NULL) before each tile of
 * DF_MAX_ROWS tokens: a non-zero return ends the prefill there with DF_OK and *stopped = 1
 * (s->pos after the last tile that ran, logits not written); else *stopped = 0. Same errors. */
df_status df_target_prefill(df_session *s, const int32_t *ids, int n, float *logits, int (*stop)(void *), void *user,
                            int *stopped, df_error *err);

/* As df_target_forward_rows, but instead of logits returns argmax[M] (host): the greedy token
 * after each row, computed where the logits are (backend argmax op), so a device backend
 * copies M ids instead of M x vocab floats; -1 for a row whose logits are not finite (the
 * caller decides whether that row matters). Same errors. */
df_status df_target_forward_argmax(df_session *s, const int32_t *ids, int M, int32_t *argmax, df_error *err);

/* Decoding one token at a time with each step recorded before the host reads the token of the
 * step before it, when the backend keeps token ids in its memory (embed_dev, argmax_dev,
 * read_ahead; sampling also sample_top_dev): the host's time between steps is hidden behind the
 * device's. Greedy: the tokens of df_target_forward_argmax step by step. Sampled (a sampler with
 * df_sampler_top_k_only): each step's token drawn on the device from the k best logits with the
 * sampler's next random bits (df_sampler_draw_bits, taken when the step is recorded: one per
 * token, in order), so the tokens of df_sampler_sample_top step by step. */
typedef struct df_ahead {
    int32_t *d_ids;   /* backend memory [2]: token t in d_ids[t & 1]; NULL: one step at a time */
    int32_t prev;     /* one step at a time: the last token */
    int t;            /* the token the next df_ahead_next returns */
    df_sampler *sm;   /* NULL: greedy */
} df_ahead;

/* Starts decoding after token `first` (at position s->pos): its step is recorded and started.
 * sm: NULL (greedy), or a sampler with df_sampler_top_k_only, which the caller keeps until
 * df_ahead_end; then the backend must have sample_top_dev (else DF_ERR_INTERNAL). Errors as
 * df_target_forward_argmax; DF_ERR_NOMEM (then there is nothing to end). */
df_status df_ahead_begin(df_session *s, df_ahead *g, int32_t first, df_sampler *sm, df_error *err);
/* The next token into *tok (-1 when its logits were not finite, as df_argmax). With `more` the
 * step after it (fed with it) is recorded and started before it is read, so that the host
 * works while the device computes: a caller that stops at this token (an EOS, a stop string)
 * leaves that one step run, the session one position further (df_generate resets sessions).
 * Errors as df_target_forward_argmax. */
df_status df_ahead_next(df_session *s, df_ahead *g, int more, int32_t *tok, df_error *err);
/* Ends the loop (waits for a step still running; frees the id buffer). */
void df_ahead_end(df_session *s, df_ahead *g);

/* One token through the target; instead of its logits, the k (1..64) best of them in rank order
 * (backend.h `top_k`: ids[k], vals[k]; ids[0] = -1 when the logits held a NaN), for a sampler
 * with a small top-k (df_sampler_sample_top). Errors as df_target_forward_argmax, and
 * DF_ERR_INTERNAL when the backend has no top_k. */
df_status df_target_forward_top_k(df_session *s, int32_t id, int k, int32_t *ids, float *vals, df_error *err);

/* As df_target_forward_argmax with the token ids and the result in backend memory (the
 * backend's embed_dev and argmax_dev ops, which must exist): ids[M] each in [0, vocab) (the
 * caller's promise: they are not checked, an id outside gives a row of zeros), argmax[M] the
 * greedy token after each row (-1 for a row whose logits are not finite). Records the pass
 * without waiting for it. Same errors. */
df_status df_target_forward_argmax_dev(df_session *s, const int32_t *ids, int M, int32_t *argmax, df_error *err);

/* Tells backend be (df_backend_ops.host_const, when it has one) that the file mappings of ts
 * do not change (on = 1) or are about to be unmapped (on = 0). */
void df_backend_tensors_const(df_backend *be, const df_tensor_set *ts, int on);

#endif
