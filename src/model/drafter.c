/* The DFlash (v1) drafter (include/dflash/drafter.h; MODEL.md §5, z-lab/dflash).
 *
 * Per draft layer (Qwen3-style, plain RMSNorm x·rsqrt(mean x²+eps)·w):
 *   h = RMSNorm(x, input_layernorm)
 *   q = RoPE(q_norm(W_q h))                    block rows
 *   K, V = RoPE(k_norm(W_k [C; h])), W_v [C; h] context rows (cached) + block rows
 *   x = x + W_o softmax(q Kᵀ/sqrt(d)) V        non-causal over context and block
 *   x = x + W_down(silu(W_gate u) ⊙ W_up u),  u = RMSNorm(x, post_attention_layernorm)
 * then logits = lm_head(RMSNorm(x, norm)) with the target's head.
 */
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/files.h"
#include "dflash/drafter.h"
#include "dflash/generate.h"
#include "dflash/safetensors.h"
#include "model/target.h"

typedef struct draft_layer {
    df_vecf in_norm, post_norm, q_norm, k_norm;
    df_linear q, k, v, o, gate, up, down;
    /* DFlash2: dynamic convolutions around attention and MLP */
    df_linear attn_kp, mlp_kp;   /* kernel_projection [2·K·G, H] */
    df_vecf attn_base, mlp_base; /* base_kernel [2, K, H] */
} draft_layer;

struct df_drafter {
    df_drafter_config cfg;
    df_engine *eng;
    df_tensor_set *ts;
    df_linear fc;
    df_vecf hidden_norm, norm;
    draft_layer *layers;
    /* DFlash2 candidate selector */
    df_linear sel_proj;          /* hidden_projection [r, H] */
    const df_tensor *sel_pred, *sel_succ; /* codebooks [V, r] */
    float **owned;
    int n_owned;
    void **qowned;  /* buffers of weights quantized at load (df_drafter_quantize) */
    int n_qowned;
    int quant_bits; /* 0: the weights as stored */
};

struct df_draft_state {
    df_drafter *d;
    int window, len;
    float **k_cache, **v_cache; /* per layer [window + DF_MAX_ROWS, n_kv, head_dim] */
    float *x, *h, *y, *t1, *t2, *t3, *tk, *tv, *ctx, *dyn;
    float *logits;
};

/* ---- loading ------------------------------------------------------------------------------- */

/* An integer field into *out (INT_MIN when it lies outside int's range: every caller's check
 * refuses that); 0 when absent or not an integer. */
static int json_int(json_t *o, const char *key, int *out) {
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v)) return 0;
    const json_int_t x = json_integer_value(v);
    *out = x >= INT_MIN && x <= INT_MAX ? (int)x : INT_MIN;
    return 1;
}

static int json_num(json_t *o, const char *key, float *out) {
    json_t *v = json_object_get(o, key);
    if (!json_is_number(v)) return 0;
    *out = (float)json_number_value(v);
    return 1;
}

static df_status parse_config(df_drafter_config *c, const char *dir, df_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t je;
    FILE *f = df_fopen_regular(path, err);
    if (!f) return err ? err->code : DF_ERR_IO;
    json_t *root = json_loadf(f, 0, &je);
    fclose(f);
    if (!root) {
        if (je.line > 0)
            return df_error_set(err, DF_ERR_FORMAT, "drafter config.json: %s (line %d)", je.text, je.line);
        return df_error_set(err, DF_ERR_IO, "%s", je.text);
    }
    df_status st = DF_OK;
    json_t *arch = json_array_get(json_object_get(root, "architectures"), 0);
    const char *a = json_string_value(arch);
    memset(c, 0, sizeof *c);
    if (a && strcmp(a, "DFlashDraftModel") == 0) c->version = 1;
    else if (a && strcmp(a, "DFlash2DraftModel") == 0) c->version = 2;
    else {
        st = df_error_set(err, DF_ERR_UNSUPPORTED,
                          "drafter config.json: architectures[0] is \"%s\"; expected \"DFlashDraftModel\" or "
                          "\"DFlash2DraftModel\"",
                          a ? a : "(missing)");
        goto done;
    }
    json_t *dc = json_object_get(root, "dflash_config");
    json_t *rp = json_object_get(root, "rope_parameters");
    if (!json_int(root, "hidden_size", &c->hidden_size) || !json_int(root, "num_hidden_layers", &c->n_layers) ||
        !json_int(root, "num_attention_heads", &c->n_heads) || !json_int(root, "num_key_value_heads", &c->n_kv_heads) ||
        !json_int(root, "intermediate_size", &c->intermediate_size) || !json_is_object(dc) ||
        !json_int(dc, "mask_token_id", &c->mask_token_id)) {
        st = df_error_set(err, DF_ERR_FORMAT,
                          "drafter config.json: hidden_size, num_hidden_layers, num_attention_heads, "
                          "num_key_value_heads, intermediate_size and dflash_config.mask_token_id are required integers");
        goto done;
    }
    const struct {
        const char *key;
        int v;
    } sizes[] = {{"hidden_size", c->hidden_size},
                 {"num_hidden_layers", c->n_layers},
                 {"num_attention_heads", c->n_heads},
                 {"num_key_value_heads", c->n_kv_heads},
                 {"intermediate_size", c->intermediate_size}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].v < 1) {
            st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: %s must be an integer from 1 to %d",
                              sizes[i].key, INT_MAX);
            goto done;
        }
    if (!json_int(root, "head_dim", &c->head_dim)) c->head_dim = c->hidden_size / c->n_heads;
    if (!json_int(root, "vocab_size", &c->vocab_size)) {
        c->vocab_size = 0;
    } else if (c->vocab_size < 1) { /* given: checked against the target's, so never taken as absent */
        st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: vocab_size must be an integer from 1 to %d",
                          INT_MAX);
        goto done;
    }
    if (!json_int(root, "num_target_layers", &c->num_target_layers) &&
        !json_int(dc, "num_target_layers", &c->num_target_layers))
        c->num_target_layers = 0; /* not given: not checked against the target */
    else if (c->num_target_layers < 1) {
        st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: num_target_layers %d: must be at least 1",
                          c->num_target_layers);
        goto done;
    }
    /* optional fields: absent gives the default; present, they must have the right type */
    const struct {
        json_t *obj;
        const char *key;
        int integer;
    } typed[] = {{root, "block_size", 1},           {dc, "block_size", 1},
                 {root, "rms_norm_eps", 0},         {root, "rope_theta", 0},
                 {root, "head_dim", 1},             {root, "vocab_size", 1},
                 {root, "num_target_layers", 1},    {dc, "num_target_layers", 1},
                 {root, "sliding_window", 1},       {dc, "conv_kernel_size", 1},
                 {dc, "conv_group_size", 1},        {dc, "selector_rank", 1},
                 {dc, "selector_top_k", 1},         {dc, "output_multiplier", 0},
                 {dc, "final_logit_softcapping", 0}, {root, "final_logit_softcapping", 0},
                 {dc, "input_embedding_scale", 0}};
    for (size_t i = 0; i < sizeof typed / sizeof typed[0]; i++) {
        json_t *v = typed[i].obj ? json_object_get(typed[i].obj, typed[i].key) : NULL;
        if (v && !json_is_null(v) && !(typed[i].integer ? json_is_integer(v) : json_is_number(v))) {
            st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: %s%s must be %s",
                              typed[i].obj == dc ? "dflash_config." : "", typed[i].key,
                              typed[i].integer ? "an integer" : "a number");
            goto done;
        }
    }
    if (!json_int(root, "block_size", &c->block_size) && !json_int(dc, "block_size", &c->block_size))
        c->block_size = 16;
    if (!json_num(root, "rms_norm_eps", &c->rms_norm_eps)) c->rms_norm_eps = 1e-6f;
    if (!json_num(root, "rope_theta", &c->rope_theta) && !(rp && json_num(rp, "rope_theta", &c->rope_theta)))
        c->rope_theta = 1e6f;
    if (!(c->rms_norm_eps > 0.0f && c->rms_norm_eps < 1.0f) || !(c->rope_theta > 0.0f) || isinf(c->rope_theta)) {
        st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: rms_norm_eps must lie in (0, 1) and rope_theta be "
                                              "a positive number (got %g, %g)", (double)c->rms_norm_eps,
                          (double)c->rope_theta);
        goto done;
    }
    json_t *taps = json_object_get(dc, "target_layer_ids");
    if (!json_is_array(taps) || json_array_size(taps) == 0 || json_array_size(taps) > DF_DRAFT_MAX_TAPS) {
        st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: dflash_config.target_layer_ids must be a list of "
                                              "1..%d layer ids", DF_DRAFT_MAX_TAPS);
        goto done;
    }
    c->n_taps = (int)json_array_size(taps);
    for (int i = 0; i < c->n_taps; i++) {
        json_t *v = json_array_get(taps, (size_t)i);
        if (!json_is_integer(v)) {
            st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: target_layer_ids[%d] is not an integer", i);
            goto done;
        }
        c->taps[i] = (int)json_integer_value(v);
    }
    c->output_multiplier = 1.0f;
    c->input_embedding_scale = 1.0f;
    if (c->version == 2) {
        json_int(dc, "block_size", &c->block_size);
        /* the convolutions and the selector are optional (absent: none); given, they are used */
        const struct {
            const char *key;
            int *v, max;
        } opt[] = {{"conv_kernel_size", &c->conv_kernel, 16},
                   {"conv_group_size", &c->conv_group_size, INT_MAX},
                   {"selector_rank", &c->selector_rank, INT_MAX},
                   {"selector_top_k", &c->selector_top_k, 64}};
        for (size_t i = 0; i < sizeof opt / sizeof opt[0]; i++)
            if (json_int(dc, opt[i].key, opt[i].v) && (*opt[i].v < 1 || *opt[i].v > opt[i].max)) {
                st = df_error_set(err, DF_ERR_FORMAT,
                                  "drafter config.json: dflash_config.%s must be an integer from 1 to %d (leave it "
                                  "out for none)",
                                  opt[i].key, opt[i].max);
                goto done;
            }
        json_num(dc, "output_multiplier", &c->output_multiplier);
        if (!json_num(dc, "final_logit_softcapping", &c->final_logit_softcapping))
            json_num(root, "final_logit_softcapping", &c->final_logit_softcapping);
        json_num(dc, "input_embedding_scale", &c->input_embedding_scale);
        if (!(c->output_multiplier > 0.0f) || isinf(c->output_multiplier) || !(c->input_embedding_scale > 0.0f) ||
            isinf(c->input_embedding_scale)) {
            st = df_error_set(err, DF_ERR_FORMAT,
                              "drafter config.json: dflash_config.output_multiplier and input_embedding_scale must be "
                              "positive finite numbers (got %g, %g)",
                              (double)c->output_multiplier, (double)c->input_embedding_scale);
            goto done;
        }
        if (c->final_logit_softcapping < 0.0f) {
            st = df_error_set(err, DF_ERR_FORMAT,
                              "drafter config.json: final_logit_softcapping %g must be positive (0 or absent: none)",
                              (double)c->final_logit_softcapping);
            goto done;
        }
        if (c->conv_kernel > 0 && (c->conv_group_size <= 0 || c->hidden_size % c->conv_group_size != 0)) {
            st = df_error_set(err, DF_ERR_FORMAT,
                              "drafter config.json: conv_kernel_size %d needs a dflash_config.conv_group_size that "
                              "divides hidden_size %d (got %s)",
                              c->conv_kernel, c->hidden_size, c->conv_group_size > 0 ? "one that does not" : "none");
            goto done;
        }
        if ((c->selector_rank > 0) != (c->selector_top_k > 0)) {
            st = df_error_set(err, DF_ERR_FORMAT,
                              "drafter config.json: a candidate selector needs both dflash_config.selector_rank and "
                              "selector_top_k (got %d, %d)",
                              c->selector_rank, c->selector_top_k);
            goto done;
        }
    }
    if (c->n_layers > DF_DRAFT_MAX_LAYERS) {
        st = df_error_set(err, DF_ERR_UNSUPPORTED, "drafter config.json: %d layers (at most %d)", c->n_layers,
                          DF_DRAFT_MAX_LAYERS);
        goto done;
    }
    json_t *lt = json_object_get(root, "layer_types");
    json_t *is_causal = json_object_get(root, "is_causal");
    if (lt && !json_is_null(lt) && (!json_is_array(lt) || json_array_size(lt) != (size_t)c->n_layers)) {
        st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: layer_types must be a list of %d entries, one per "
                                              "layer (got %s)",
                          c->n_layers, json_is_array(lt) ? "another length" : "no list");
        goto done;
    }
    json_int(root, "sliding_window", &c->sliding_window);
    for (int l = 0; l < c->n_layers && c->n_layers > 0; l++) {
        const char *t = json_string_value(json_array_get(lt, (size_t)l));
        if (json_is_array(lt) && (!t || (strcmp(t, "sliding_attention") != 0 && strcmp(t, "full_attention") != 0))) {
            st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: layer_types[%d] must be \"full_attention\" "
                              "or \"sliding_attention\"", l);
            goto done;
        }
        c->sliding[l] = t && strcmp(t, "sliding_attention") == 0;
        c->causal[l] = json_is_boolean(is_causal) ? json_is_true(is_causal) : c->sliding[l];
        if (c->sliding[l] && c->sliding_window < 2) {
            st = df_error_set(err, DF_ERR_FORMAT,
                              "drafter config.json: sliding_attention layers need a sliding_window from 2 to %d",
                              INT_MAX);
            goto done;
        }
    }
    if (c->block_size < 2)
        st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: block_size %d: must be at least 2 (a block is the "
                                              "bonus token and at least one draft)", c->block_size);
    else if (c->hidden_size <= 0 || c->n_layers <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 ||
             c->n_heads % c->n_kv_heads != 0 || c->head_dim <= 0 || c->head_dim > 1024 || c->head_dim % 2 ||
             c->intermediate_size <= 0)
        st = df_error_set(err, DF_ERR_FORMAT, "drafter config.json: inconsistent sizes (heads %d/%d, head_dim %d, "
                                              "block_size %d)", c->n_heads, c->n_kv_heads, c->head_dim, c->block_size);
done:
    json_decref(root);
    return st;
}

/* Takes tensor `name` (marking it used) and checks a float dtype and the shape
 * [d0] / [d0, d1] / [d0, d1, d2] for ndim 1..3. */
static df_tensor *take3(df_drafter *d, const char *name, int ndim, int64_t d0, int64_t d1, int64_t d2, df_error *err,
                        df_status *st) {
    df_tensor *t = df_tensors_take(d->ts, name);
    if (!t) {
        *st = df_error_set(err, DF_ERR_MODEL, "drafter: tensor %s is missing", name);
        return NULL;
    }
    if (t->dtype != DF_DTYPE_BF16 && t->dtype != DF_DTYPE_F16 && t->dtype != DF_DTYPE_F32) {
        *st = df_error_set(err, DF_ERR_MODEL, "drafter: tensor %s has dtype %s; expected BF16, F16 or F32", name,
                           df_dtype_name(t->dtype));
        return NULL;
    }
    const int64_t want[3] = {d0, d1, d2};
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == want[i];
    if (!ok) {
        char buf[96];
        int n = snprintf(buf, sizeof buf, "[%lld", (long long)d0);
        for (int i = 1; i < ndim; i++) n += snprintf(buf + n, sizeof buf - (size_t)n, ", %lld", (long long)want[i]);
        snprintf(buf + n, sizeof buf - (size_t)n, "]");
        *st = df_error_set(err, DF_ERR_MODEL, "drafter: tensor %s has the wrong shape; expected %s", name, buf);
        return NULL;
    }
    return t;
}

static df_tensor *take(df_drafter *d, const char *name, int ndim, int64_t d0, int64_t d1, df_error *err,
                       df_status *st) {
    return take3(d, name, ndim, d0, d1, 0, err, st);
}

static int bind_dense(df_drafter *d, df_linear *L, const char *name, int rows, int cols, df_error *err,
                      df_status *st) {
    df_tensor *t = take(d, name, 2, rows, cols, err, st);
    if (!t) return 0;
    memset(L, 0, sizeof *L);
    L->name = t->name;
    L->rows = rows;
    L->cols = cols;
    L->wdtype = t->dtype;
    L->w = t->data;
    return 1;
}

static int vec_from(df_drafter *d, df_vecf *v, const df_tensor *t, int n, df_error *err, df_status *st);

static int bind_vec(df_drafter *d, df_vecf *v, const char *name, int n, df_error *err, df_status *st) {
    df_tensor *t = take(d, name, 1, n, 0, err, st);
    return t ? vec_from(d, v, t, n, err, st) : 0;
}

/* A [2, K, H] base kernel as floats. */
static int bind_base(df_drafter *d, df_vecf *v, const char *name, int K, int H, df_error *err, df_status *st) {
    df_tensor *t = take3(d, name, 3, 2, K, H, err, st);
    return t ? vec_from(d, v, t, 2 * K * H, err, st) : 0;
}

static int vec_from(df_drafter *d, df_vecf *v, const df_tensor *t, int n, df_error *err, df_status *st) {
    float *f = malloc((size_t)n * sizeof(float));
    float **o = realloc(d->owned, (size_t)(d->n_owned + 1) * sizeof *o);
    if (!f || !o) {
        free(f);
        if (o) d->owned = o;
        *st = df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory");
        return 0;
    }
    d->owned = o;
    d->owned[d->n_owned++] = f;
    for (int i = 0; i < n; i++) {
        if (t->dtype == DF_DTYPE_F32) f[i] = ((const float *)t->data)[i];
        else if (t->dtype == DF_DTYPE_BF16) f[i] = df_bf16_to_f32(((const uint16_t *)t->data)[i]);
        else f[i] = df_f16_to_f32(((const uint16_t *)t->data)[i]);
    }
    v->data = f;
    v->n = n;
    return 1;
}

df_status df_drafter_load(df_drafter **out, const char *dir, df_engine *eng, df_error *err) {
    *out = NULL;
    df_drafter *d = calloc(1, sizeof *d);
    if (!d) return df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory");
    d->eng = eng;
    df_status st = parse_config(&d->cfg, dir, err);
    if (st != DF_OK) goto fail;
    const df_drafter_config *c = &d->cfg;
    const df_text_config *tc = &eng->pack->cfg;
    if (c->hidden_size != tc->hidden_size) {
        st = df_error_set(err, DF_ERR_MODEL, "drafter hidden_size %d does not match the target's %d", c->hidden_size,
                          tc->hidden_size);
        goto fail;
    }
    if (c->vocab_size > 0 && c->vocab_size != tc->vocab_size) {
        st = df_error_set(err, DF_ERR_MODEL, "drafter vocab_size %d does not match the target's %d (a drafter for another "
                          "model?)", c->vocab_size, tc->vocab_size);
        goto fail;
    }
    if (c->num_target_layers > 0 && c->num_target_layers != tc->n_layers) {
        st = df_error_set(err, DF_ERR_MODEL, "drafter num_target_layers %d does not match the target's %d layers (a "
                          "drafter for another model?)", c->num_target_layers, tc->n_layers);
        goto fail;
    }
    for (int i = 0; i < c->n_taps; i++)
        if (c->taps[i] < 0 || c->taps[i] >= tc->n_layers) {
            st = df_error_set(err, DF_ERR_MODEL, "drafter target_layer_ids[%d] = %d is not a layer of the target (0..%d)",
                              i, c->taps[i], tc->n_layers - 1);
            goto fail;
        }
    if (c->mask_token_id < 0 || c->mask_token_id >= tc->vocab_size) {
        st = df_error_set(err, DF_ERR_MODEL, "drafter mask_token_id %d is outside the target vocabulary (%d)",
                          c->mask_token_id, tc->vocab_size);
        goto fail;
    }
    st = df_tensors_open_dir(&d->ts, dir, err);
    if (st != DF_OK) goto fail;
    df_backend_tensors_const(eng->be, d->ts, 1); /* until df_drafter_free unmaps them */
    const int H = c->hidden_size, hd = c->head_dim, I = c->intermediate_size;
    d->layers = calloc((size_t)c->n_layers, sizeof *d->layers);
    if (!d->layers) {
        st = df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory");
        goto fail;
    }
    if (!bind_dense(d, &d->fc, "fc.weight", H, c->n_taps * H, err, &st) ||
        !bind_vec(d, &d->hidden_norm, "hidden_norm.weight", H, err, &st) ||
        !bind_vec(d, &d->norm, "norm.weight", H, err, &st))
        goto fail;
    for (int l = 0; l < c->n_layers; l++) {
        draft_layer *L = &d->layers[l];
        char n[160];
#define NAME(s) (snprintf(n, sizeof n, "layers.%d.%s", l, s), n)
        if (!bind_vec(d, &L->in_norm, NAME("input_layernorm.weight"), H, err, &st) ||
            !bind_vec(d, &L->post_norm, NAME("post_attention_layernorm.weight"), H, err, &st) ||
            !bind_vec(d, &L->q_norm, NAME("self_attn.q_norm.weight"), hd, err, &st) ||
            !bind_vec(d, &L->k_norm, NAME("self_attn.k_norm.weight"), hd, err, &st) ||
            !bind_dense(d, &L->q, NAME("self_attn.q_proj.weight"), c->n_heads * hd, H, err, &st) ||
            !bind_dense(d, &L->k, NAME("self_attn.k_proj.weight"), c->n_kv_heads * hd, H, err, &st) ||
            !bind_dense(d, &L->v, NAME("self_attn.v_proj.weight"), c->n_kv_heads * hd, H, err, &st) ||
            !bind_dense(d, &L->o, NAME("self_attn.o_proj.weight"), H, c->n_heads * hd, err, &st) ||
            !bind_dense(d, &L->gate, NAME("mlp.gate_proj.weight"), I, H, err, &st) ||
            !bind_dense(d, &L->up, NAME("mlp.up_proj.weight"), I, H, err, &st) ||
            !bind_dense(d, &L->down, NAME("mlp.down_proj.weight"), H, I, err, &st))
            goto fail;
        if (c->version == 2 && c->conv_kernel > 0) {
            const int KG = 2 * c->conv_kernel * (H / c->conv_group_size);
            if (!bind_dense(d, &L->attn_kp, NAME("attention_conv.kernel_projection.weight"), KG, H, err, &st) ||
                !bind_base(d, &L->attn_base, NAME("attention_conv.base_kernel"), c->conv_kernel, H, err, &st) ||
                !bind_dense(d, &L->mlp_kp, NAME("mlp_conv.kernel_projection.weight"), KG, H, err, &st) ||
                !bind_base(d, &L->mlp_base, NAME("mlp_conv.base_kernel"), c->conv_kernel, H, err, &st))
                goto fail;
        }
#undef NAME
    }
    if (c->version == 2 && c->selector_rank > 0 && c->selector_top_k > 0) {
        const int V = tc->vocab_size, r = c->selector_rank;
        if (!bind_dense(d, &d->sel_proj, "candidate_selector.hidden_projection.weight", r, H, err, &st) ||
            !(d->sel_pred = take(d, "candidate_selector.predecessor_codebook", 2, V, r, err, &st)) ||
            !(d->sel_succ = take(d, "candidate_selector.successor_codebook", 2, V, r, err, &st)))
            goto fail;
    }
    for (size_t i = 0; i < df_tensors_count(d->ts); i++) {
        df_tensor *t = df_tensors_at(d->ts, i);
        if (!t->used) {
            st = df_error_set(err, DF_ERR_MODEL, "drafter: unexpected tensor %s", t->name);
            goto fail;
        }
    }
    *out = d;
    return DF_OK;
fail:
    df_drafter_free(d);
    return st;
}

void df_drafter_free(df_drafter *d) {
    if (!d) return;
    for (int i = 0; i < d->n_owned; i++) free(d->owned[i]);
    free(d->owned);
    for (int i = 0; i < d->n_qowned; i++) free(d->qowned[i]);
    free(d->qowned);
    free(d->layers);
    df_backend_tensors_const(d->eng ? d->eng->be : NULL, d->ts, 0);
    df_tensors_free(d->ts);
    free(d);
}

const df_drafter_config *df_drafter_get_config(const df_drafter *d) { return &d->cfg; }
const df_engine *df_drafter_engine(const df_drafter *d) { return d->eng; }

/* ---- quantization at load ------------------------------------------------------------------ */

static float dense_value(const df_linear *L, size_t i) {
    if (L->wdtype == DF_DTYPE_F32) return ((const float *)L->w)[i];
    const uint16_t h = ((const uint16_t *)L->w)[i];
    if (L->wdtype == DF_DTYPE_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static uint16_t f16_bits(float f) {
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

static float f16_value(uint16_t u) {
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float)h;
}

static int keep_buffer(df_drafter *d, void *p) {
    void **n = realloc(d->qowned, (size_t)(d->n_qowned + 1) * sizeof *n);
    if (!n) return 0;
    d->qowned = n;
    d->qowned[d->n_qowned++] = p;
    return 1;
}

/* Rebinds a dense linear to MLX affine codes of `bits` bits in groups of 64 columns: per
 * group scale = (max − min)/(2^bits − 1) and bias = min, both rounded to fp16, then
 * q = clamp(round((w − bias)/scale), 0, 2^bits − 1) with the rounded scale and bias (so that
 * w ≈ scale·q + bias, MODEL.md §2). Widths not divisible by 64 stay dense. Returns 0 when out of
 * memory. */
static int quantize_linear(df_drafter *d, df_linear *L, int bits) {
    const int gs = 64, rows = L->rows, cols = L->cols;
    if (L->bits != 0 || cols % gs != 0) return 1;
    const int ng = cols / gs, qmax = (1 << bits) - 1;
    const size_t wpr = (size_t)cols * (size_t)bits / 32;
    uint32_t *codes = calloc((size_t)rows * wpr, sizeof *codes);
    uint16_t *sc = malloc((size_t)rows * (size_t)ng * sizeof *sc), *bi = malloc((size_t)rows * (size_t)ng * sizeof *bi);
    if (!codes || !sc || !bi || !keep_buffer(d, codes)) {
        free(codes);
        free(sc);
        free(bi);
        return 0;
    }
    if (!keep_buffer(d, sc)) {
        free(sc);
        free(bi);
        return 0;
    }
    if (!keep_buffer(d, bi)) {
        free(bi);
        return 0;
    }
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < ng; g++) {
            const size_t base = (size_t)r * (size_t)cols + (size_t)g * gs;
            float mn = dense_value(L, base), mx = mn;
            for (int i = 1; i < gs; i++) {
                const float v = dense_value(L, base + (size_t)i);
                if (v < mn) mn = v;
                if (v > mx) mx = v;
            }
            const uint16_t sh = f16_bits((mx - mn) / (float)qmax), bh = f16_bits(mn);
            const float s = f16_value(sh), b = f16_value(bh);
            sc[(size_t)r * ng + g] = sh;
            bi[(size_t)r * ng + g] = bh;
            for (int i = 0; i < gs; i++) {
                int q = 0;
                if (s > 0.0f) {
                    const float t = rintf((dense_value(L, base + (size_t)i) - b) / s);
                    q = t < 0.0f ? 0 : (t > (float)qmax ? qmax : (int)t);
                }
                const size_t bit = (size_t)(g * gs + i) * (size_t)bits;
                codes[(size_t)r * wpr + bit / 32] |= (uint32_t)q << (bit % 32);
            }
        }
    }
    L->bits = bits;
    L->group_size = gs;
    L->wdtype = DF_DTYPE_U32;
    L->w = codes;
    L->sdtype = DF_DTYPE_F16;
    L->scales = sc;
    L->biases = bi;
    L->hadamard_block = 0;
    L->signs = NULL;
    return 1;
}

df_status df_drafter_quantize(df_drafter *d, int bits, df_error *err) {
    if (bits != 4 && bits != 8)
        return df_error_set(err, DF_ERR_INVALID_ARG, "drafter quantization: %d bits (expected 4 or 8)", bits);
    if (d->quant_bits)
        return df_error_set(err, DF_ERR_INVALID_ARG, "drafter quantization: the weights are already %d-bit",
                            d->quant_bits);
    int ok = quantize_linear(d, &d->fc, bits);
    for (int l = 0; ok && l < d->cfg.n_layers; l++) {
        draft_layer *L = &d->layers[l];
        df_linear *lins[] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        for (size_t i = 0; ok && i < sizeof lins / sizeof lins[0]; i++) ok = quantize_linear(d, lins[i], bits);
    }
    if (!ok) return df_error_set(err, DF_ERR_NOMEM, "drafter quantization: out of memory");
    d->quant_bits = bits;
    return DF_OK;
}

int df_drafter_quant_bits(const df_drafter *d) { return d->quant_bits; }

/* ---- state ---------------------------------------------------------------------------------- */

static df_backend *dbe(const df_drafter *d) { return d->eng->be; }

/* Floats per row of the wide scratch buffers t1, t2, t3, tk, tv: the widest of the MLP, the
 * attention heads, the taps' features and every layer's K (or V) rows side by side. */
static size_t state_wide(const df_drafter_config *c) {
    size_t wide = (size_t)c->intermediate_size;
    const size_t heads = (size_t)c->n_heads * (size_t)c->head_dim, taps = (size_t)c->n_taps * (size_t)c->hidden_size;
    const size_t kvs = (size_t)c->n_layers * (size_t)c->n_kv_heads * (size_t)c->head_dim;
    if (heads > wide) wide = heads;
    if (taps > wide) wide = taps;
    if (kvs > wide) wide = kvs;
    return wide;
}

df_status df_draft_state_init(df_draft_state **out, df_drafter *d, int window, df_error *err) {
    *out = NULL;
    if (window < 1) return df_error_set(err, DF_ERR_INVALID_ARG, "draft window must be >= 1 (got %d)", window);
    df_draft_state *s = calloc(1, sizeof *s);
    if (!s) return df_error_set(err, DF_ERR_NOMEM, "drafter state: out of memory");
    s->d = d;
    s->window = window;
    const df_drafter_config *c = &d->cfg;
    df_backend *be = dbe(d);
    const size_t R = DF_MAX_ROWS, H = (size_t)c->hidden_size, kv = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    const size_t wide = state_wide(c);
    s->k_cache = calloc((size_t)c->n_layers, sizeof(float *));
    s->v_cache = calloc((size_t)c->n_layers, sizeof(float *));
    if (!s->k_cache || !s->v_cache) goto oom;
    for (int l = 0; l < c->n_layers; l++) {
        s->k_cache[l] = be->ops->alloc(be, ((size_t)window + R) * kv * sizeof(float));
        s->v_cache[l] = be->ops->alloc(be, ((size_t)window + R) * kv * sizeof(float));
        if (!s->k_cache[l] || !s->v_cache[l]) goto oom;
    }
    float **bufs[] = {&s->x, &s->h, &s->y, &s->ctx};
    for (size_t i = 0; i < 4; i++)
        if (!(*bufs[i] = be->ops->alloc(be, R * H * sizeof(float)))) goto oom;
    float **wbufs[] = {&s->t1, &s->t2, &s->t3, &s->tk, &s->tv};
    for (size_t i = 0; i < 5; i++)
        if (!(*wbufs[i] = be->ops->alloc(be, R * wide * sizeof(float)))) goto oom;
    s->logits = be->ops->alloc(be, R * (size_t)d->eng->pack->cfg.vocab_size * sizeof(float));
    if (!s->logits) goto oom;
    if (c->conv_kernel > 0) {
        s->dyn = be->ops->alloc(be, R * 2 * (size_t)c->conv_kernel * (H / (size_t)c->conv_group_size) * sizeof(float));
        if (!s->dyn) goto oom;
    }
    *out = s;
    return DF_OK;
oom:
    df_draft_state_free(s);
    return df_error_set(err, DF_ERR_NOMEM, "drafter state: out of memory for a window of %d", window);
}

void df_draft_state_free(df_draft_state *s) {
    if (!s) return;
    df_backend *be = dbe(s->d);
    for (int l = 0; l < s->d->cfg.n_layers; l++) {
        if (s->k_cache) be->ops->dealloc(be, s->k_cache[l]);
        if (s->v_cache) be->ops->dealloc(be, s->v_cache[l]);
    }
    free(s->k_cache);
    free(s->v_cache);
    float *bufs[] = {s->x, s->h, s->y, s->ctx, s->t1, s->t2, s->t3, s->tk, s->tv, s->logits, s->dyn};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->ops->dealloc(be, bufs[i]);
    free(s);
}

void df_draft_state_reset(df_draft_state *s) { s->len = 0; }
int df_draft_state_len(const df_draft_state *s) { return s->len; }
df_drafter *df_draft_state_drafter(const df_draft_state *s) { return s->d; }
int df_draft_state_window(const df_draft_state *s) { return s->window; }

/* Attention geometry of draft layer l (layer < 0: context rows, where masks do not apply). */
static df_attn_shape attn_shape(const df_drafter_config *c, int l) {
    df_attn_shape sh = {.n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                        .rot_dims = c->head_dim, .rope_theta = c->rope_theta, .eps = c->rms_norm_eps,
                        .gated = 0, .causal = 0};
    if (l >= 0) {
        sh.causal = c->causal[l];
        sh.sliding_window = c->sliding[l] ? c->sliding_window : 0;
    }
    return sh;
}

/* df_draft_add_context and df_draft_add_context_device: feats on the host (on_device 0) or in
 * the drafter backend's memory. */
static df_status add_context(df_draft_state *s, const float *feats, int on_device, int n, int32_t first_pos,
                             df_error *err) {
    df_drafter *d = s->d;
    const df_drafter_config *c = &d->cfg;
    df_backend *be = dbe(d);
    const df_backend_ops *op = be->ops;
    const int H = c->hidden_size, F = c->n_taps * H;
    const size_t kv = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    if (n > s->window) { /* only the last `window` rows can ever be attended */
        feats += (size_t)(n - s->window) * (size_t)F;
        first_pos += n - s->window;
        n = s->window;
    }
    if (s->len + n > s->window) { /* drop the oldest rows */
        int drop = s->len + n - s->window;
        for (int l = 0; l < c->n_layers; l++) {
            op->copy(be, s->k_cache[l], s->k_cache[l] + (size_t)drop * kv, (size_t)(s->len - drop) * kv * sizeof(float));
            op->copy(be, s->v_cache[l], s->v_cache[l] + (size_t)drop * kv, (size_t)(s->len - drop) * kv * sizeof(float));
        }
        s->len -= drop;
    }
    const df_attn_shape sh = attn_shape(c, -1);
    for (int i = 0; i < n; i += DF_MAX_ROWS) {
        int M = n - i < DF_MAX_ROWS ? n - i : DF_MAX_ROWS;
        int32_t pos[DF_MAX_ROWS];
        for (int m = 0; m < M; m++) pos[m] = first_pos + i + m;
        const float *fi = feats + (size_t)i * (size_t)F;
        if (!on_device) {
            op->to_device(be, s->t1, fi, (size_t)M * (size_t)F * sizeof(float));
            fi = s->t1;
        }
        op->linear(be, &d->fc, fi, M, s->y);
        op->rmsnorm(be, s->y, d->hidden_norm.data, M, H, c->rms_norm_eps, s->ctx);
        /* every layer's K and V projections of the one input ctx, four linears a `linears` call
         * where the backend has it (a GPU runs each call as one launch), into t2 (K) and t3 (V),
         * layer l at offset l·M·kv; t1 (the features) is free once fc has run */
        const df_linear *Ws[4];
        float *ys[4];
        int k = 0;
        for (int l = 0; l < c->n_layers; l++)
            for (int j = 0; j < 2; j++) {
                Ws[k] = j ? &d->layers[l].v : &d->layers[l].k;
                ys[k] = (j ? s->t3 : s->t2) + (size_t)l * (size_t)M * kv;
                if (++k < 4 && !(l == c->n_layers - 1 && j == 1)) continue;
                if (op->linears) op->linears(be, s->ctx, NULL, 0.0f, M, H, k, Ws, ys, NULL);
                else
                    for (int q = 0; q < k; q++) op->linear(be, Ws[q], s->ctx, M, ys[q]);
                k = 0;
            }
        for (int l = 0; l < c->n_layers; l++) {
            const size_t o = (size_t)l * (size_t)M * kv;
            op->kv_append(be, &sh, s->t2 + o, s->t3 + o, d->layers[l].k_norm.data, pos, M, s->k_cache[l],
                          s->v_cache[l], s->len);
        }
        s->len += M;
    }
    if (be->failed) {
        be->failed = 0;
        return df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory for scratch buffers");
    }
    return DF_OK;
}

df_status df_draft_add_context(df_draft_state *s, const float *feats, int n, int32_t first_pos, df_error *err) {
    return add_context(s, feats, 0, n, first_pos, err);
}

df_status df_draft_add_context_device(df_draft_state *s, const float *feats, int n, int32_t first_pos,
                                      df_error *err) {
    return add_context(s, feats, 1, n, first_pos, err);
}

static float cb_at(const df_tensor *t, size_t i) {
    if (t->dtype == DF_DTYPE_F32) return ((const float *)t->data)[i];
    const uint16_t h = ((const uint16_t *)t->data)[i];
    return t->dtype == DF_DTYPE_BF16 ? df_bf16_to_f32(h) : df_f16_to_f32(h);
}

/* Greedy candidate-selector path over rows 1..B-1 (s->h holds the normed block hidden
 * states, lg the processed logits [B-1, V]); see df_draft_block. */
static df_status select_path(df_draft_state *s, int32_t bonus, int B, const float *lg, int32_t *drafts,
                             df_error *err) {
    df_drafter *d = s->d;
    const df_drafter_config *c = &d->cfg;
    df_backend *be = dbe(d);
    const int V = d->eng->pack->cfg.vocab_size, r = c->selector_rank, k = c->selector_top_k, H = c->hidden_size;
    float *p = malloc((size_t)(B - 1) * (size_t)r * sizeof(float));
    if (!p) return df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory");
    be->ops->linear(be, &d->sel_proj, s->h + H, B - 1, s->t3);
    be->ops->to_host(be, p, s->t3, (size_t)(B - 1) * (size_t)r * sizeof(float));
    int32_t prev = bonus;
    for (int j = 0; j < B - 1; j++) {
        const float *row = lg + (size_t)j * (size_t)V;
        int32_t cand[64] = {0};
        int n = 0;
        for (int i = 0; i < V; i++) { /* top-k, highest first, lower id first on ties */
            if (n == k && !(row[i] > row[cand[n - 1]])) continue;
            int at = n < k ? n++ : k - 1;
            while (at > 0 && row[i] > row[cand[at - 1]]) {
                cand[at] = cand[at - 1];
                at--;
            }
            cand[at] = i;
        }
        int32_t best = cand[0];
        float best_score = -INFINITY;
        for (int q = 0; q < n; q++) {
            float e = 0.0f;
            for (int t = 0; t < r; t++)
                e = e + cb_at(d->sel_pred, (size_t)prev * (size_t)r + (size_t)t) * p[(size_t)j * (size_t)r + (size_t)t] *
                            cb_at(d->sel_succ, (size_t)cand[q] * (size_t)r + (size_t)t);
            float score = row[cand[q]] + e;
            if (score > best_score) {
                best_score = score;
                best = cand[q];
            }
        }
        drafts[j] = best;
        prev = best;
    }
    free(p);
    return DF_OK;
}

/* The input of a block's first linears: RMSNorm of s->x with norm_w into s->h; for DFlash2
 * (dynamic convolutions), then the convolution of it with the kernels kp computes from it
 * (into s->dyn) and the base kernels base, into s->ctx. */
static const float *block_input(df_draft_state *s, const float *norm_w, const df_linear *kp, const float *base,
                                int B) {
    const df_drafter_config *c = &s->d->cfg;
    df_backend *be = dbe(s->d);
    const int H = c->hidden_size, K = c->conv_kernel;
    be->ops->rmsnorm(be, s->x, norm_w, B, H, c->rms_norm_eps, s->h);
    if (K <= 0) return s->h;
    const int KG = K * (H / c->conv_group_size);
    be->ops->linear(be, kp, s->h, B, s->dyn);
    be->ops->dyn_conv(be, s->h, s->dyn, 2 * KG, base, K, c->conv_group_size, B, H, s->ctx);
    return s->ctx;
}

/* The block's forward pass of df_draft_block: the normed hidden states into s->h [B, hidden]
 * (and `hidden` on the host when not NULL), rows 1..B-1 through the target's lm_head into
 * s->logits [B-1, vocab] (raw: no multiplier, no softcapping). Recorded, not awaited. */
static df_status draft_forward(df_draft_state *s, int32_t bonus, int32_t p0, int B, float *hidden, df_error *err) {
    df_drafter *d = s->d;
    const df_drafter_config *c = &d->cfg;
    const df_pack *pk = d->eng->pack;
    df_backend *be = dbe(d);
    const df_backend_ops *op = be->ops;
    const int H = c->hidden_size;
    if (B < 2 || B > DF_MAX_ROWS) return df_error_set(err, DF_ERR_INVALID_ARG, "draft block size %d outside 2..%d", B,
                                                      DF_MAX_ROWS);
    int32_t ids[DF_MAX_ROWS], pos[DF_MAX_ROWS];
    for (int m = 0; m < B; m++) {
        ids[m] = m == 0 ? bonus : c->mask_token_id;
        pos[m] = p0 + m;
    }
    const size_t BH = (size_t)B * (size_t)H;
    const int K = c->conv_kernel, KG = K > 0 ? K * (H / c->conv_group_size) : 0;
    op->embed(be, &pk->embed, ids, B, s->x);
    if (c->input_embedding_scale != 1.0f) {
        float *tmp = malloc(BH * sizeof(float));
        if (!tmp) return df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory");
        op->to_host(be, tmp, s->x, BH * sizeof(float));
        for (size_t i = 0; i < BH; i++) tmp[i] = tmp[i] * c->input_embedding_scale;
        op->to_device(be, s->x, tmp, BH * sizeof(float));
        free(tmp);
    }
    for (int l = 0; l < c->n_layers; l++) {
        const draft_layer *L = &d->layers[l];
        const df_attn_shape sh = attn_shape(c, l);
        /* the backend's fused ops where the layer is plain (no dynamic convolution): the same bits
         * as the composition (backend.h), fewer launches */
        const int fused = K == 0 && op->linears && op->linear_add;
        /* attention (DFlash2: dynamic convolution before and after, kernels from the normed input) */
        if (fused) {
            const df_linear *Wa[3] = {&L->q, &L->k, &L->v};
            float *ya[3] = {s->t1, s->tk, s->tv};
            op->linears(be, s->x, L->in_norm.data, c->rms_norm_eps, B, H, 3, Wa, ya, s->h);
        } else {
            const float *a_in = block_input(s, L->in_norm.data, &L->attn_kp, L->attn_base.data, B);
            op->linear(be, &L->q, a_in, B, s->t1);
            op->linear(be, &L->k, a_in, B, s->tk);
            op->linear(be, &L->v, a_in, B, s->tv);
        }
        /* block K/V go after the context (index s->len..) and are discarded afterwards */
        op->attention(be, &sh, s->t1, s->tk, s->tv, L->q_norm.data, L->k_norm.data, pos, B, s->k_cache[l],
                      s->v_cache[l], s->len, s->t2);
        if (fused) {
            op->linear_add(be, &L->o, s->t2, NULL, B, s->x);
            const df_linear *Wm[2] = {&L->gate, &L->up};
            float *ym[2] = {s->t1, s->t2};
            op->linears(be, s->x, L->post_norm.data, c->rms_norm_eps, B, H, 2, Wm, ym, s->h);
            op->linear_add(be, &L->down, s->t1, s->t2, B, s->x);
            continue;
        }
        op->linear(be, &L->o, s->t2, B, s->y);
        if (K > 0) {
            op->dyn_conv(be, s->y, s->dyn + KG, 2 * KG, L->attn_base.data + (size_t)K * H, K, c->conv_group_size, B,
                         H, s->h);
            op->add(be, s->x, s->h, BH);
        } else {
            op->add(be, s->x, s->y, BH);
        }
        /* MLP */
        const float *m_in = block_input(s, L->post_norm.data, &L->mlp_kp, L->mlp_base.data, B);
        op->linear(be, &L->gate, m_in, B, s->t1);
        op->linear(be, &L->up, m_in, B, s->t2);
        op->swiglu(be, s->t1, s->t2, (size_t)B * (size_t)c->intermediate_size, s->t3);
        op->linear(be, &L->down, s->t3, B, s->y);
        if (K > 0) {
            op->dyn_conv(be, s->y, s->dyn + KG, 2 * KG, L->mlp_base.data + (size_t)K * H, K, c->conv_group_size, B, H,
                         s->h);
            op->add(be, s->x, s->h, BH);
        } else {
            op->add(be, s->x, s->y, BH);
        }
    }
    op->rmsnorm(be, s->x, d->norm.data, B, H, c->rms_norm_eps, s->h);
    if (hidden) op->to_host(be, hidden, s->h, BH * sizeof(float));
    op->linear(be, &pk->lm_head, s->h + H, B - 1, s->logits);
    return DF_OK;
}

/* 1 when the proposals are the plain argmax of the lm_head's logits (no candidate selector,
 * output multiplier or softcapping). */
static int plain_argmax_drafts(const df_drafter *d) {
    return !d->sel_pred && d->cfg.output_multiplier == 1.0f && !(d->cfg.final_logit_softcapping > 0.0f);
}

int df_draft_device_ok(const df_draft_state *s) {
    const df_backend_ops *op = dbe(s->d)->ops;
    return plain_argmax_drafts(s->d) && op->argmax_dev != NULL;
}

df_status df_draft_block_dev(df_draft_state *s, int32_t bonus, int32_t p0, int B, int32_t *drafts, df_error *err) {
    if (!df_draft_device_ok(s))
        return df_error_set(err, DF_ERR_UNSUPPORTED, "drafter: these proposals are not taken on the device");
    df_status st = draft_forward(s, bonus, p0, B, NULL, err);
    if (st != DF_OK) return st;
    df_backend *be = dbe(s->d);
    be->ops->argmax_dev(be, s->logits, B - 1, s->d->eng->pack->cfg.vocab_size, drafts, 0);
    if (be->failed) {
        be->failed = 0;
        return df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory for scratch buffers");
    }
    return DF_OK;
}

df_status df_draft_block(df_draft_state *s, int32_t bonus, int32_t p0, int B, int32_t *drafts, float *hidden,
                         float *logits, df_error *err) {
    df_drafter *d = s->d;
    const df_drafter_config *c = &d->cfg;
    df_backend *be = dbe(d);
    const df_backend_ops *op = be->ops;
    const int V = d->eng->pack->cfg.vocab_size;
    df_status st0 = draft_forward(s, bonus, p0, B, hidden, err);
    if (st0 != DF_OK) return st0;
    if (!logits && plain_argmax_drafts(d)) {
        /* plain argmax drafts: taken where the logits are (no vocab-wide copy from a device) */
        op->argmax(be, s->logits, B - 1, V, drafts);
        for (int m = 0; m < B - 1; m++)
            if (drafts[m] < 0) drafts[m] = 0; /* non-finite logits: a draft only proposes */
        if (be->failed) {
            be->failed = 0;
            return df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory for scratch buffers");
        }
        return DF_OK;
    }
    float *lg = logits;
    float *tmp = NULL;
    if (!lg) {
        tmp = malloc((size_t)(B - 1) * (size_t)V * sizeof(float));
        if (!tmp) return df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory");
        lg = tmp;
    }
    op->to_host(be, lg, s->logits, (size_t)(B - 1) * (size_t)V * sizeof(float));
    const size_t NL = (size_t)(B - 1) * (size_t)V;
    if (c->output_multiplier != 1.0f)
        for (size_t i = 0; i < NL; i++) lg[i] = lg[i] * c->output_multiplier;
    if (c->final_logit_softcapping > 0.0f) {
        const float cap = c->final_logit_softcapping;
        for (size_t i = 0; i < NL; i++) lg[i] = cap * tanhf(lg[i] / cap);
    }
    df_status st = DF_OK;
    if (d->sel_pred) st = select_path(s, bonus, B, lg, drafts, err);
    else
        for (int m = 0; m < B - 1; m++) {
            drafts[m] = df_argmax(lg + (size_t)m * (size_t)V, V);
            if (drafts[m] < 0) drafts[m] = 0; /* non-finite logits: a draft only proposes */
        }
    free(tmp);
    if (st != DF_OK) return st;
    if (be->failed) {
        be->failed = 0;
        return df_error_set(err, DF_ERR_NOMEM, "drafter: out of memory for scratch buffers");
    }
    return DF_OK;
}
