/* The target model: the Qwen3.5 hybrid forward pass (MODEL.md §1) over backend ops, and the
 * engine/session API of include/dflash/engine.h.
 *
 * Every token — prefill, decode or verify — goes through forward_rows() in tiles of at most
 * DF_MAX_ROWS rows, so a row's arithmetic is the same whether it was prefilled at once, in
 * chunks, one at a time, or verified in a block (backend.h exactness contract).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/threads.h"
#include "dflash/engine.h"
#include "model/target.h"

/* ---- engine -------------------------------------------------------------------------------- */

void df_backend_tensors_const(df_backend *be, const df_tensor_set *ts, int on) {
    if (!be || !be->ops->host_const) return;
    for (int i = 0; i < df_tensors_file_count(ts); i++) {
        size_t n = 0;
        const void *p = df_tensors_file_map(ts, i, &n);
        if (p) be->ops->host_const(be, p, n, on);
    }
}

/* The backend named by opt->device: "cpu" (default) or "cuda". */
static df_status backend_create(df_backend **out, const df_engine_options *opt, df_error *err) {
    const char *dev = opt && opt->device ? opt->device : "cpu";
    if (strcmp(dev, "cpu") == 0) return df_backend_cpu_create(out, opt ? opt->n_threads : 0, err);
    if (strcmp(dev, "cuda") == 0) {
#ifdef DFLASH_WITH_CUDA
        return df_backend_cuda_create(out, 0, err);
#else
        return df_error_set(err, DF_ERR_UNSUPPORTED,
                            "device \"cuda\": this build has no CUDA backend (configure with nvcc available and "
                            "-DDFLASH_CUDA=ON)");
#endif
    }
    return df_error_set(err, DF_ERR_INVALID_ARG, "unknown device \"%s\" (expected \"cpu\" or \"cuda\")", dev);
}

df_status df_engine_load(df_engine **out, const char *dir, const df_engine_options *opt, df_error *err) {
    *out = NULL;
    df_engine *e = calloc(1, sizeof *e);
    if (!e) return df_error_set(err, DF_ERR_NOMEM, "engine: out of memory");
    df_status st = df_pack_load(&e->pack, dir, err);
    if (st != DF_OK) goto fail;
    const df_text_config *c = &e->pack->cfg;
    if (c->head_dim > 1024 || c->lin_k_head_dim > 512 || c->lin_v_head_dim > 512 || c->conv_kernel > 16 ||
        c->conv_kernel < 1) {
        st = df_error_set(err, DF_ERR_UNSUPPORTED,
                          "config: head sizes above 512 (GDN) / 1024 (attention) or conv kernel above 16 "
                          "are not supported");
        goto fail;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    st = df_tokenizer_load(&e->tok, path, err); /* its errors name the file */
    if (st != DF_OK) goto fail;
    if (df_tokenizer_vocab_size(e->tok) > c->vocab_size) { /* its ids would index past the embedding */
        st = df_error_set(err, DF_ERR_MODEL,
                          "%s has ids up to %d, but config.json's vocab_size is %d: the tokenizer does not belong to "
                          "this model",
                          path, df_tokenizer_vocab_size(e->tok) - 1, c->vocab_size);
        goto fail;
    }
    st = backend_create(&e->be, opt, err);
    if (st != DF_OK) goto fail;
    df_backend_tensors_const(e->be, e->pack->tensors, 1); /* read-only mappings: no checks for changes */
    *out = e;
    return DF_OK;
fail:
    df_engine_free(e);
    return st;
}

void df_engine_free(df_engine *e) {
    if (!e) return;
    if (e->be) e->be->ops->destroy(e->be);
    df_tokenizer_free(e->tok);
    df_pack_free(e->pack);
    free(e);
}

const df_pack *df_engine_pack(const df_engine *e) { return e->pack; }
const df_tokenizer *df_engine_tokenizer(const df_engine *e) { return e->tok; }
int df_engine_vocab_size(const df_engine *e) { return e->pack->cfg.vocab_size; }
int df_engine_n_threads(const df_engine *e) { return e->be->n_threads; }

int df_engine_is_eos(const df_engine *e, int32_t id) {
    for (int i = 0; i < e->pack->cfg.n_eos; i++)
        if (e->pack->cfg.eos_ids[i] == id) return 1;
    return 0;
}

/* ---- session ------------------------------------------------------------------------------- */

static void *be_alloc(df_backend *be, size_t n_floats) { return be->ops->alloc(be, n_floats * sizeof(float)); }

df_status df_session_init(df_session **out, df_engine *eng, int max_ctx, df_error *err) {
    *out = NULL;
    const df_text_config *c = &eng->pack->cfg;
    if (max_ctx <= 0) max_ctx = c->max_position_embeddings < 32768 ? c->max_position_embeddings : 32768;
    if (max_ctx > c->max_position_embeddings)
        return df_error_set(err, DF_ERR_INVALID_ARG, "context size %d exceeds the model's maximum %d", max_ctx,
                            c->max_position_embeddings);
    df_session *s = calloc(1, sizeof *s);
    if (!s) return df_error_set(err, DF_ERR_NOMEM, "session: out of memory");
    s->eng = eng;
    s->be = eng->be;
    s->max_ctx = max_ctx;
    const int L = c->n_layers, H = c->hidden_size;
    const int Kd = c->lin_n_k_heads * c->lin_k_head_dim, Vd = c->lin_n_v_heads * c->lin_v_head_dim;
    s->conv_ch = 2 * Kd + Vd;
    s->layer = calloc((size_t)L, sizeof *s->layer);
    if (!s->layer) goto oom;
    for (int l = 0; l < L; l++) {
        df_session_layer *sl = &s->layer[l];
        if (c->layer_kinds[l] == DF_LAYER_LINEAR_ATTENTION) {
            sl->conv_state = be_alloc(s->be, (size_t)(c->conv_kernel - 1) * (size_t)s->conv_ch + 1);
            sl->ssm_state = be_alloc(s->be, (size_t)c->lin_n_v_heads * (size_t)c->lin_k_head_dim *
                                                (size_t)c->lin_v_head_dim);
            if (!sl->conv_state || !sl->ssm_state) goto oom;
        }
    }
    /* activations for one tile of DF_MAX_ROWS rows */
    const int R = DF_MAX_ROWS;
    const int qdim = c->n_heads * 2 * c->head_dim, kvdim = c->n_kv_heads * c->head_dim;
    size_t wide = (size_t)c->intermediate_size;
    if ((size_t)qdim > wide) wide = (size_t)qdim;
    if ((size_t)s->conv_ch > wide) wide = (size_t)s->conv_ch;
    s->x = be_alloc(s->be, (size_t)R * H);
    s->h = be_alloc(s->be, (size_t)R * H);
    s->y = be_alloc(s->be, (size_t)R * H);
    s->t1 = be_alloc(s->be, (size_t)R * wide);
    s->t2 = be_alloc(s->be, (size_t)R * wide);
    s->t3 = be_alloc(s->be, (size_t)R * wide);
    s->t4 = be_alloc(s->be, (size_t)R * (kvdim > Vd ? kvdim : Vd));
    s->ta = be_alloc(s->be, (size_t)R * c->lin_n_v_heads);
    s->tb = be_alloc(s->be, (size_t)R * c->lin_n_v_heads);
    s->logits = be_alloc(s->be, (size_t)R * c->vocab_size);
    if (!s->x || !s->h || !s->y || !s->t1 || !s->t2 || !s->t3 || !s->t4 || !s->ta || !s->tb || !s->logits)
        goto oom;
    *out = s;
    return DF_OK;
oom:
    df_session_free(s);
    return df_error_set(err, DF_ERR_NOMEM, "session: out of memory for %d positions", max_ctx);
}

void df_session_free(df_session *s) {
    if (!s) return;
    df_backend *be = s->be;
    const df_text_config *c = &s->eng->pack->cfg;
    if (s->layer) {
        for (int l = 0; l < c->n_layers; l++) {
            be->ops->dealloc(be, s->layer[l].conv_state);
            be->ops->dealloc(be, s->layer[l].ssm_state);
            be->ops->dealloc(be, s->layer[l].k_cache);
            be->ops->dealloc(be, s->layer[l].v_cache);
        }
    }
    free(s->layer);
    float *bufs[] = {s->x, s->h, s->y, s->t1, s->t2, s->t3, s->t4, s->ta, s->tb, s->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->ops->dealloc(be, bufs[i]);
    free(s);
}

void df_session_reset(df_session *s) {
    const df_text_config *c = &s->eng->pack->cfg;
    df_backend *be = s->be;
    for (int l = 0; l < c->n_layers; l++) {
        df_session_layer *sl = &s->layer[l];
        if (sl->conv_state) {
            be->ops->zero(be, sl->conv_state, (size_t)(c->conv_kernel - 1) * (size_t)s->conv_ch * sizeof(float));
            be->ops->zero(be, sl->ssm_state, (size_t)c->lin_n_v_heads * (size_t)c->lin_k_head_dim *
                                                 (size_t)c->lin_v_head_dim * sizeof(float));
        }
    }
    s->pos = 0;
}

size_t df_gdn_conv_bytes(const df_session *s) {
    return (size_t)(s->eng->pack->cfg.conv_kernel - 1) * (size_t)s->conv_ch * sizeof(float);
}

size_t df_gdn_ssm_bytes(const df_session *s) {
    const df_text_config *c = &s->eng->pack->cfg;
    return (size_t)c->lin_n_v_heads * (size_t)c->lin_k_head_dim * (size_t)c->lin_v_head_dim * sizeof(float);
}

int df_session_pos(const df_session *s) { return s->pos; }
int df_session_max_ctx(const df_session *s) { return s->max_ctx; }
void df_session_capture_hidden(df_session *s, float *hidden) {
    s->capture = hidden;
    s->capture_row = 0;
}

/* Makes sure every attention layer's KV cache holds `need` positions (grows by doubling). */
static df_status ensure_kv(df_session *s, int need, df_error *err) {
    if (need <= s->kv_cap) return DF_OK;
    const df_text_config *c = &s->eng->pack->cfg;
    int cap = s->kv_cap ? s->kv_cap : 256;
    while (cap < need) cap *= 2;
    if (cap > s->max_ctx) cap = s->max_ctx;
    const size_t row = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    df_backend *be = s->be;
    for (int l = 0; l < c->n_layers; l++) {
        if (c->layer_kinds[l] != DF_LAYER_FULL_ATTENTION) continue;
        df_session_layer *sl = &s->layer[l];
        float *k = be_alloc(be, (size_t)cap * row), *v = be_alloc(be, (size_t)cap * row);
        if (!k || !v) {
            be->ops->dealloc(be, k);
            be->ops->dealloc(be, v);
            return df_error_set(err, DF_ERR_NOMEM, "KV cache: out of memory for %d positions", cap);
        }
        if (sl->k_cache) {
            be->ops->copy(be, k, sl->k_cache, (size_t)s->pos * row * sizeof(float));
            be->ops->copy(be, v, sl->v_cache, (size_t)s->pos * row * sizeof(float));
            be->ops->dealloc(be, sl->k_cache);
            be->ops->dealloc(be, sl->v_cache);
        }
        sl->k_cache = k;
        sl->v_cache = v;
    }
    s->kv_cap = cap;
    return DF_OK;
}

static void capture_plane(df_session *s, int plane, const float *src, int M) {
    const df_text_config *c = &s->eng->pack->cfg;
    const size_t H = (size_t)c->hidden_size;
    float *dst = s->capture + ((size_t)plane * (size_t)s->capture_n + (size_t)s->capture_row) * H;
    s->be->ops->to_host(s->be, dst, src, (size_t)M * H * sizeof(float));
}

/* Where a one-row forward leaves the k best logits (backend.h `top_k`). */
typedef struct top_k_out {
    int k;
    int32_t *ids;
    float *vals;
} top_k_out;

/* A token drawn on the device (backend.h sample_top_dev) instead of the argmax. */
typedef struct dev_draw {
    const df_top_draw *d;
    uint64_t u;
} dev_draw;

/* One tile: M <= DF_MAX_ROWS tokens at positions s->pos.. (ids on the host, or d_ids in
 * backend memory). Writes logits [M, vocab] (host) for rows >= logits_from when logits != NULL,
 * the greedy tokens into argmax (host) or d_argmax (backend memory; with dd, M = 1: the token
 * drawn by sample_top_dev), or the k best logits of the one row into tk. */
static df_status forward_rows(df_session *s, const int32_t *ids, const int32_t *d_ids, int M, float *logits,
                              int32_t *argmax, int32_t *d_argmax, const dev_draw *dd, const top_k_out *tk,
                              int logits_from, df_error *err);

df_status df_target_forward_rows(df_session *s, const int32_t *ids, int M, float *logits, int logits_from,
                                 df_error *err) {
    return forward_rows(s, ids, NULL, M, logits, NULL, NULL, NULL, NULL, logits_from, err);
}

df_status df_target_forward_argmax(df_session *s, const int32_t *ids, int M, int32_t *argmax, df_error *err) {
    return forward_rows(s, ids, NULL, M, NULL, argmax, NULL, NULL, NULL, 0, err);
}

df_status df_target_forward_argmax_dev(df_session *s, const int32_t *ids, int M, int32_t *argmax, df_error *err) {
    if (!s->be->ops->embed_dev || !s->be->ops->argmax_dev)
        return df_error_set(err, DF_ERR_INTERNAL, "forward: the backend keeps no token ids in its memory");
    return forward_rows(s, NULL, ids, M, NULL, NULL, argmax, NULL, NULL, 0, err);
}

df_status df_target_forward_top_k(df_session *s, int32_t id, int k, int32_t *ids, float *vals, df_error *err) {
    if (!s->be->ops->top_k) return df_error_set(err, DF_ERR_INTERNAL, "forward: the backend has no top_k");
    if (k < 1 || k > 64 || k > s->eng->pack->cfg.vocab_size)
        return df_error_set(err, DF_ERR_INVALID_ARG, "forward: top-k of %d", k);
    const top_k_out tk = {k, ids, vals};
    return forward_rows(s, &id, NULL, 1, NULL, NULL, NULL, NULL, &tk, 0, err);
}

/* Records the step fed with the token in `in` (backend memory) whose token goes to `out`. */
static df_status ahead_step(df_session *s, df_ahead *g, const int32_t *in, int32_t *out, df_error *err) {
    if (!g->sm) return forward_rows(s, NULL, in, 1, NULL, NULL, out, NULL, NULL, 0, err);
    const df_sampling_params *p = &g->sm->p;
    const df_top_draw d = {.k = p->top_k, .temperature = p->temperature, .top_p = p->top_p, .min_p = p->min_p};
    const dev_draw dd = {&d, df_sampler_draw_bits(g->sm)};
    return forward_rows(s, NULL, in, 1, NULL, NULL, out, &dd, NULL, 0, err);
}

df_status df_ahead_begin(df_session *s, df_ahead *g, int32_t first, df_sampler *sm, df_error *err) {
    df_backend *be = s->be;
    const int V = s->eng->pack->cfg.vocab_size;
    memset(g, 0, sizeof *g);
    g->prev = first;
    g->t = 1;
    if (sm) {
        if (!be->ops->sample_top_dev || !df_sampler_top_k_only(sm, V))
            return df_error_set(err, DF_ERR_INTERNAL, "decode: the backend cannot draw this sampler's tokens");
        g->sm = sm;
    }
    if (!be->ops->embed_dev || !be->ops->argmax_dev || !be->ops->read_ahead) {
        if (sm) return df_error_set(err, DF_ERR_INTERNAL, "decode: the backend keeps no token ids in its memory");
        return DF_OK; /* one step at a time */
    }
    if (first < 0 || first >= V) return df_error_set(err, DF_ERR_INVALID_ARG, "token id %d outside [0, %d)", first, V);
    if (!(g->d_ids = be->ops->alloc(be, 2 * sizeof(int32_t)))) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    be->ops->to_device(be, g->d_ids, &first, sizeof first);
    df_status st = ahead_step(s, g, g->d_ids, g->d_ids + 1, err);
    if (st != DF_OK) {
        df_ahead_end(s, g);
        return st;
    }
    if (be->ops->submit) be->ops->submit(be);
    return DF_OK;
}

df_status df_ahead_next(df_session *s, df_ahead *g, int more, int32_t *tok, df_error *err) {
    df_backend *be = s->be;
    if (!g->d_ids) {
        df_status st = df_target_forward_argmax(s, &g->prev, 1, tok, err);
        if (st == DF_OK) g->prev = *tok;
        return st;
    }
    int32_t *cur = g->d_ids + (g->t & 1), *nxt = g->d_ids + ((g->t + 1) & 1);
    if (more) { /* the step fed with token t, queued behind the step that makes it */
        df_status st = ahead_step(s, g, cur, nxt, err);
        if (st != DF_OK) return st;
        if (be->ops->submit) be->ops->submit(be);
        be->ops->read_ahead(be, tok, cur, sizeof *tok);
    } else {
        be->ops->to_host(be, tok, cur, sizeof *tok);
    }
    g->t++;
    if (be->failed) {
        be->failed = 0;
        return df_error_set(err, DF_ERR_NOMEM, "forward: out of memory for scratch buffers");
    }
    return DF_OK;
}

void df_ahead_end(df_session *s, df_ahead *g) {
    if (g->d_ids) s->be->ops->dealloc(s->be, g->d_ids);
    g->d_ids = NULL;
}

/* RMSNorm of x into s->h, then n linears of it (backend.h `linears`, or the primitive ops). */
static void norm_linears(df_session *s, const float *x, const float *norm_w, int M, int n, const df_linear *const *Ws,
                         float *const *ys) {
    df_backend *be = s->be;
    const df_text_config *c = &s->eng->pack->cfg;
    if (be->ops->linears) {
        be->ops->linears(be, x, norm_w, c->rms_norm_eps, M, c->hidden_size, n, Ws, ys, s->h);
        return;
    }
    be->ops->rmsnorm(be, x, norm_w, M, c->hidden_size, c->rms_norm_eps, s->h);
    for (int i = 0; i < n; i++) be->ops->linear(be, Ws[i], s->h, M, ys[i]);
}

/* y += W · (up ? silu(x) ⊙ up : x) (backend.h `linear_add`, or swiglu into t3, linear into s->y,
 * add). */
static void linear_add(df_session *s, const df_linear *W, const float *x, const float *up, int M, float *y) {
    df_backend *be = s->be;
    if (be->ops->linear_add) {
        be->ops->linear_add(be, W, x, up, M, y);
        return;
    }
    if (up) {
        be->ops->swiglu(be, x, up, (size_t)M * (size_t)W->cols, s->t3);
        x = s->t3;
    }
    be->ops->linear(be, W, x, M, s->y);
    be->ops->add(be, y, s->y, (size_t)M * (size_t)W->rows);
}

/* The token outputs of forward_rows from the logits in s->logits [M, vocab]. */
static void logits_tokens(df_session *s, int M, int32_t *argmax, int32_t *d_argmax, const dev_draw *dd,
                          const top_k_out *tk) {
    df_backend *be = s->be;
    const int V = s->eng->pack->cfg.vocab_size;
    if (tk) be->ops->top_k(be, s->logits, V, tk->k, tk->ids, tk->vals);
    else if (dd) be->ops->sample_top_dev(be, s->logits, V, dd->d, dd->u, d_argmax);
    else if (d_argmax) be->ops->argmax_dev(be, s->logits, M, V, d_argmax, -1);
    else be->ops->argmax(be, s->logits, M, V, argmax);
}

static df_status forward_rows(df_session *s, const int32_t *ids, const int32_t *d_ids, int M, float *logits,
                              int32_t *argmax, int32_t *d_argmax, const dev_draw *dd, const top_k_out *tk,
                              int logits_from, df_error *err) {
    const df_pack *pk = s->eng->pack;
    const df_text_config *c = &pk->cfg;
    df_backend *be = s->be;
    const df_backend_ops *op = be->ops;
    const int H = c->hidden_size;
    if (M <= 0 || M > DF_MAX_ROWS) return df_error_set(err, DF_ERR_INTERNAL, "forward: %d rows", M);
    if (s->pos + M > s->max_ctx)
        return df_error_set(err, DF_ERR_RANGE, "context full: %d positions + %d tokens exceed %d", s->pos, M,
                            s->max_ctx);
    for (int m = 0; ids && m < M; m++)
        if (ids[m] < 0 || ids[m] >= c->vocab_size)
            return df_error_set(err, DF_ERR_INVALID_ARG, "token id %d outside [0, %d)", ids[m], c->vocab_size);
    df_status st = ensure_kv(s, s->pos + M, err);
    if (st != DF_OK) return st;

    int32_t positions[DF_MAX_ROWS];
    for (int m = 0; m < M; m++) positions[m] = s->pos + m;

    if (d_ids) op->embed_dev(be, &pk->embed, d_ids, M, s->x);
    else op->embed(be, &pk->embed, ids, M, s->x);
    if (s->capture) capture_plane(s, 0, s->x, M);

    const df_attn_shape ash = {
        .n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
        .rot_dims = ((int)((float)c->head_dim * c->partial_rotary_factor)) & ~1,
        .mrope_section = {c->mrope_section[0], c->mrope_section[1], c->mrope_section[2]},
        .rope_theta = c->rope_theta, .eps = c->rms_norm_eps, .gated = 1, .causal = 1};
    const df_gdn_shape gsh = {.n_k_heads = c->lin_n_k_heads, .n_v_heads = c->lin_n_v_heads,
                              .k_head_dim = c->lin_k_head_dim, .v_head_dim = c->lin_v_head_dim,
                              .conv_kernel = c->conv_kernel, .eps = c->rms_norm_eps};

    for (int l = 0; l < c->n_layers; l++) {
        const df_layer_weights *w = &pk->layers[l];
        df_session_layer *sl = &s->layer[l];
        if (w->kind == DF_LAYER_FULL_ATTENTION) {
            const df_linear *Ws[3] = {&w->q_proj, &w->k_proj, &w->v_proj};
            float *ys[3] = {s->t1, s->t2, s->t4};
            norm_linears(s, s->x, w->input_norm.data, M, 3, Ws, ys);
            op->attention(be, &ash, s->t1, s->t2, s->t4, w->q_norm.data, w->k_norm.data, positions, M,
                          sl->k_cache, sl->v_cache, s->pos, s->t3);
            linear_add(s, &w->o_proj, s->t3, NULL, M, s->x);
        } else {
            const df_linear *Ws[4] = {&w->in_proj_qkv, &w->in_proj_z, &w->in_proj_a, &w->in_proj_b};
            const df_gdn_redirect *rd = s->gdn_redirect;
            float *ys[4] = {s->t1, s->t2, s->ta, s->tb};
            if (rd) {
                ys[0] = rd->qkv[l];
                ys[1] = rd->z[l];
                ys[2] = rd->a[l];
                ys[3] = rd->b[l];
            }
            norm_linears(s, s->x, w->input_norm.data, M, 4, Ws, ys);
            if (rd && op->gdn_to) {
                op->gdn_to(be, &gsh, ys[0], ys[1], ys[2], ys[3], w->conv1d.data, w->A_log.data, w->dt_bias.data,
                           w->gdn_norm.data, M, sl->conv_state, sl->ssm_state, rd->conv[l], rd->ssm[l], s->t3);
            } else {
                float *cs = sl->conv_state, *ss = sl->ssm_state;
                if (rd) { /* the composition of gdn_to */
                    op->copy(be, rd->conv[l], cs, df_gdn_conv_bytes(s));
                    op->copy(be, rd->ssm[l], ss, df_gdn_ssm_bytes(s));
                    cs = rd->conv[l];
                    ss = rd->ssm[l];
                }
                op->gdn(be, &gsh, ys[0], ys[1], ys[2], ys[3], w->conv1d.data, w->A_log.data, w->dt_bias.data,
                        w->gdn_norm.data, M, cs, ss, s->t3);
            }
            linear_add(s, &w->out_proj, s->t3, NULL, M, s->x);
        }
        const df_linear *Wm[2] = {&w->gate_proj, &w->up_proj};
        float *ym[2] = {s->t1, s->t2};
        norm_linears(s, s->x, w->post_norm.data, M, 2, Wm, ym);
        linear_add(s, &w->down_proj, s->t1, s->t2, M, s->x);
        if (s->capture) capture_plane(s, l + 1, s->x, M);
        if (s->tap) s->tap(s->tap_user, l, s->x, M);
    }
    s->pos += M;
    if ((argmax || d_argmax || tk) && !logits && !s->capture) { /* greedy decode / verify, or the top-k
                                                                  * of a sampled step: final norm fused with lm_head */
        const df_linear *Wl[1] = {&pk->lm_head};
        float *yl[1] = {s->logits};
        norm_linears(s, s->x, pk->final_norm.data, M, 1, Wl, yl);
        logits_tokens(s, M, argmax, d_argmax, dd, tk);
        argmax = d_argmax = NULL;
        tk = NULL;
    } else if (s->capture || logits || argmax || d_argmax || tk) {
        op->rmsnorm(be, s->x, pk->final_norm.data, M, H, c->rms_norm_eps, s->h);
        if (s->capture) {
            capture_plane(s, c->n_layers + 1, s->h, M);
            s->capture_row += M;
        }
    }
    if (logits && logits_from < M) {
        int n = M - logits_from;
        op->linear(be, &pk->lm_head, s->h + (size_t)logits_from * (size_t)H, n, s->logits);
        op->to_host(be, logits, s->logits, (size_t)n * (size_t)c->vocab_size * sizeof(float));
    }
    if (argmax || d_argmax || tk) {
        op->linear(be, &pk->lm_head, s->h, M, s->logits);
        logits_tokens(s, M, argmax, d_argmax, dd, tk);
    }
    if (be->failed) {
        be->failed = 0;
        return df_error_set(err, DF_ERR_NOMEM, "forward: out of memory for scratch buffers");
    }
    return DF_OK;
}

/* Runs ids[0..n) in tiles; logits of the last token (or of every token with `all`). stop:
 * see df_target_prefill. */
static df_status run_tokens(df_session *s, const int32_t *ids, int n, float *logits, int all, int (*stop)(void *),
                            void *user, int *stopped, df_error *err) {
    if (stopped) *stopped = 0;
    if (n <= 0) return df_error_set(err, DF_ERR_INVALID_ARG, "no tokens to run");
    if (s->pos + n > s->max_ctx)
        return df_error_set(err, DF_ERR_RANGE, "context full: %d positions + %d tokens exceed %d", s->pos, n,
                            s->max_ctx);
    const int V = s->eng->pack->cfg.vocab_size;
    s->capture_n = n;
    s->capture_row = 0;
    for (int i = 0; i < n; i += DF_MAX_ROWS) {
        if (stop && stop(user)) {
            *stopped = 1;
            break;
        }
        int M = n - i < DF_MAX_ROWS ? n - i : DF_MAX_ROWS;
        float *lg = NULL;
        int from = M;
        if (logits && all) {
            lg = logits + (size_t)i * (size_t)V;
            from = 0;
        } else if (logits && i + M == n) {
            lg = logits;
            from = M - 1;
        }
        df_status st = df_target_forward_rows(s, ids + i, M, lg, from, err);
        if (st != DF_OK) {
            s->capture = NULL;
            return st;
        }
    }
    s->capture = NULL;
    return DF_OK;
}

df_status df_session_prefill(df_session *s, const int32_t *ids, int n, float *logits, df_error *err) {
    return run_tokens(s, ids, n, logits, 0, NULL, NULL, NULL, err);
}

df_status df_target_prefill(df_session *s, const int32_t *ids, int n, float *logits, int (*stop)(void *), void *user,
                            int *stopped, df_error *err) {
    int dummy;
    return run_tokens(s, ids, n, logits, 0, stop, user, stopped ? stopped : &dummy, err);
}

df_status df_session_prefill_all(df_session *s, const int32_t *ids, int n, float *logits, df_error *err) {
    return run_tokens(s, ids, n, logits, 1, NULL, NULL, NULL, err);
}

df_status df_session_decode(df_session *s, int32_t id, float *logits, df_error *err) {
    return run_tokens(s, &id, 1, logits, 0, NULL, NULL, NULL, err);
}
