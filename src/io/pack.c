/* Pack loading: config + tensors bound to the Qwen3.5 hybrid architecture
 * (see include/dflash/pack.h; tensor names and the quantization/Hadamard rules are
 * MODEL.md §2, from mlx-vlm `qwen3_5` / `prism_hadamard_qwen35`).
 *
 * Binding walks the architecture derived from config.json (embedding, each layer's mixer
 * and MLP, final norm, lm_head), takes every tensor it needs from the set (checking
 * presence, dtype and shape), then reports any Hadamard manifest entry that named no
 * module and any tensor left untaken (other than vision_tower.*). Errors are DF_ERR_MODEL
 * naming the tensor and its file; config problems are DF_ERR_FORMAT/UNSUPPORTED naming
 * config.json and the field.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/files.h"
#include "dflash/pack.h"
#include "io/io_internal.h"

/* The pack with the allocations it owns (names, float vectors). */
typedef struct pack_impl {
    df_pack pub;
    void **owned;
    size_t n_owned, cap_owned;
} pack_impl;

static void *pack_alloc(pack_impl *p, size_t bytes) {
    if (p->n_owned == p->cap_owned) {
        size_t cap = p->cap_owned ? 2 * p->cap_owned : 256;
        void **o = realloc(p->owned, cap * sizeof *o);
        if (!o) return NULL;
        p->owned = o;
        p->cap_owned = cap;
    }
    void *m = malloc(bytes ? bytes : 1);
    if (m) p->owned[p->n_owned++] = m;
    return m;
}

static char *pack_strdup(pack_impl *p, const char *s) {
    size_t n = strlen(s) + 1;
    char *d = pack_alloc(p, n);
    if (d) memcpy(d, s, n);
    return d;
}

/* ---- quantization and Hadamard manifest (config.json) ----------------------------- */

typedef struct qspec {
    int quantized;         /* 0: not quantized (no config, or override false) */
    int bits, group_size;
} qspec;

typedef struct hentry {
    const char *path;      /* relative to "language_model." */
    int block;
    int embedding;
    int used;
} hentry;

typedef struct binder {
    pack_impl *p;
    df_tensor_set *set;
    json_t *quant;         /* the "quantization" object or NULL */
    qspec qdefault;
    hentry *hman;
    size_t n_hman;
    df_error *err;
} binder;

static int bits_ok(long long b) { return b == 2 || b == 3 || b == 4 || b == 5 || b == 6 || b == 8; }
static int group_ok(long long g) { return g == 32 || g == 64 || g == 128; }

/* Parses {bits, group_size[, mode]} (what names it in messages). */
static df_status parse_qspec(json_t *o, const char *what, qspec *q, df_error *err) {
    json_t *b = json_object_get(o, "bits"), *g = json_object_get(o, "group_size"),
           *m = json_object_get(o, "mode");
    if (!json_is_integer(b) || !json_is_integer(g))
        return df_error_set(err, DF_ERR_FORMAT, "%s: \"bits\" and \"group_size\" must be integers",
                            what);
    if (!bits_ok(json_integer_value(b)))
        return df_error_set(err, DF_ERR_UNSUPPORTED,
                            "%s: bits %lld is not supported (2, 3, 4, 5, 6 or 8)", what,
                            (long long)json_integer_value(b));
    if (!group_ok(json_integer_value(g)))
        return df_error_set(err, DF_ERR_UNSUPPORTED,
                            "%s: group_size %lld is not supported (32, 64 or 128)", what,
                            (long long)json_integer_value(g));
    if (m && (!json_is_string(m) || strcmp(json_string_value(m), "affine") != 0))
        return df_error_set(err, DF_ERR_UNSUPPORTED,
                            "%s: mode must be \"affine\" (MLX affine quantization)", what);
    q->quantized = 1;
    q->bits = (int)json_integer_value(b);
    q->group_size = (int)json_integer_value(g);
    return DF_OK;
}

static df_status parse_quant(binder *b, json_t *root) {
    json_t *q = json_object_get(root, "quantization");
    if (!q) q = json_object_get(root, "quantization_config");
    if (!q || json_is_null(q)) return DF_OK;
    if (!json_is_object(q))
        return df_error_set(b->err, DF_ERR_FORMAT, "field quantization must be an object");
    b->quant = q;
    df_status st = parse_qspec(q, "field quantization", &b->qdefault, b->err);
    if (st != DF_OK) return st;
    const char *key;
    json_t *v;
    json_object_foreach(q, key, v) {
        if (!strcmp(key, "bits") || !strcmp(key, "group_size") || !strcmp(key, "mode")) continue;
        char what[300];
        snprintf(what, sizeof what, "field quantization.\"%.200s\"", key);
        qspec tmp;
        if (json_is_false(v)) continue;
        if (!json_is_object(v))
            return df_error_set(b->err, DF_ERR_FORMAT,
                                "%s: a module override must be {bits, group_size} or false", what);
        if ((st = parse_qspec(v, what, &tmp, b->err)) != DF_OK) return st;
    }
    return DF_OK;
}

/* The quantization config.json gives module (full path): an override under the full
 * path or the path relative to "language_model.", else the default. */
static qspec quant_for(const binder *b, const char *module) {
    qspec q = {0, 0, 0};
    if (!b->quant) return q;
    json_t *v = json_object_get(b->quant, module);
    if (!v && strncmp(module, "language_model.", 15) == 0)
        v = json_object_get(b->quant, module + 15);
    if (!v) return b->qdefault;
    if (json_is_object(v)) parse_qspec(v, "", &q, NULL); /* validated in parse_quant */
    return q;
}

static df_status parse_manifest(binder *b, json_t *root) {
    json_t *mods = json_object_get(root, "modules");
    if (!mods || json_is_null(mods)) return DF_OK;
    if (!json_is_array(mods))
        return df_error_set(b->err, DF_ERR_FORMAT, "field modules must be a list");
    size_t n = json_array_size(mods);
    b->hman = calloc(n ? n : 1, sizeof *b->hman);
    if (!b->hman) return df_error_set(b->err, DF_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(mods, i);
        json_t *path = json_object_get(e, "path"), *block = json_object_get(e, "block"),
               *emb = json_object_get(e, "embedding"), *dt = json_object_get(e, "dtype");
        if (!json_is_string(path) || !json_string_length(path))
            return df_error_set(b->err, DF_ERR_FORMAT, "field modules[%zu]: missing \"path\"", i);
        const char *ps = json_string_value(path);
        if (!json_is_integer(block) || json_integer_value(block) < 0 ||
            json_integer_value(block) > (1 << 24))
            return df_error_set(b->err, DF_ERR_FORMAT,
                                "field modules[%zu] (%.200s): \"block\" must be a non-negative "
                                "integer", i, ps);
        long long blk = json_integer_value(block);
        if (blk > 0 && (blk & (blk - 1)) != 0)
            return df_error_set(b->err, DF_ERR_MODEL,
                                "field modules[%zu] (%.200s): Hadamard block %lld is not a power "
                                "of two", i, ps, blk);
        if (emb && !json_is_boolean(emb))
            return df_error_set(b->err, DF_ERR_FORMAT,
                                "field modules[%zu] (%.200s): \"embedding\" must be true or false",
                                i, ps);
        if (dt && (!json_is_string(dt) || strcmp(json_string_value(dt), "float16") != 0))
            return df_error_set(b->err, DF_ERR_UNSUPPORTED,
                                "field modules[%zu] (%.200s): dtype must be \"float16\"", i, ps);
        for (size_t k = 0; k < i; k++)
            if (strcmp(b->hman[k].path, ps) == 0)
                return df_error_set(b->err, DF_ERR_FORMAT,
                                    "field modules: %.200s is listed twice", ps);
        b->hman[i].path = ps;
        b->hman[i].block = (int)blk;
        b->hman[i].embedding = json_is_true(emb);
        b->n_hman = i + 1;
    }
    return DF_OK;
}

static hentry *manifest_find(binder *b, const char *module) {
    const char *rel = strncmp(module, "language_model.", 15) == 0 ? module + 15 : module;
    for (size_t i = 0; i < b->n_hman; i++)
        if (strcmp(b->hman[i].path, rel) == 0) return &b->hman[i];
    return NULL;
}

/* ---- tensor checks ---------------------------------------------------------------- */

#define DT(x) (1u << (x))
#define DT_FLOAT (DT(DF_DTYPE_F16) | DT(DF_DTYPE_BF16) | DT(DF_DTYPE_F32))
#define DT_HALF (DT(DF_DTYPE_F16) | DT(DF_DTYPE_BF16))

static void fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

static void fmt_dtypes(char *buf, size_t cap, unsigned mask) {
    buf[0] = 0;
    size_t n = 0;
    for (int t = DF_DTYPE_F32; t <= DF_DTYPE_I64 && n < cap; t++)
        if (mask & DT(t))
            n += (size_t)snprintf(buf + n, cap - n, "%s%s", n ? " or " : "", df_dtype_name((df_dtype)t));
}

static const char *tfile(const binder *b, const df_tensor *t) {
    return df_tensors_file_path(b->set, t->file_index);
}

/* Takes tensor name; missing is an error. */
static df_tensor *need(binder *b, const char *name) {
    df_tensor *t = df_tensors_take(b->set, name);
    if (!t) df_error_set(b->err, DF_ERR_MODEL, "missing tensor %s", name);
    return t;
}

static int check_dtype(binder *b, const df_tensor *t, unsigned mask) {
    if (mask & DT(t->dtype)) return 1;
    char want[64];
    fmt_dtypes(want, sizeof want, mask);
    df_error_set(b->err, DF_ERR_MODEL, "tensor %s (%s): dtype %s, expected %s", t->name,
                 tfile(b, t), df_dtype_name(t->dtype), want);
    return 0;
}

static int shape_is(const df_tensor *t, int ndim, const int64_t *shape) {
    if (t->ndim != ndim) return 0;
    for (int i = 0; i < ndim; i++)
        if (t->shape[i] != shape[i]) return 0;
    return 1;
}

static int check_shape(binder *b, const df_tensor *t, int ndim, const int64_t *shape,
                       const char *why) {
    if (shape_is(t, ndim, shape)) return 1;
    char have[128], want[128];
    fmt_shape(have, sizeof have, t->ndim, t->shape);
    fmt_shape(want, sizeof want, ndim, shape);
    df_error_set(b->err, DF_ERR_MODEL, "tensor %s (%s): shape %s, expected %s%s", t->name,
                 tfile(b, t), have, want, why ? why : "");
    return 0;
}

/* A tensor of the given dtypes and shape (ndim 1 or 2), or NULL with the error set. */
static df_tensor *need_checked(binder *b, const char *name, unsigned mask, int ndim, int64_t d0,
                               int64_t d1, const char *why) {
    df_tensor *t = need(b, name);
    int64_t shape[2] = {d0, d1};
    if (!t || !check_dtype(b, t, mask) || !check_shape(b, t, ndim, shape, why)) return NULL;
    return t;
}

static int to_f32(binder *b, const df_tensor *t, df_vecf *out) {
    out->n = t->numel;
    out->data = pack_alloc(b->p, (size_t)t->numel * sizeof(float));
    if (!out->data) {
        df_error_set(b->err, DF_ERR_NOMEM, "out of memory");
        return 0;
    }
    for (int64_t i = 0; i < t->numel; i++) {
        if (t->dtype == DF_DTYPE_F32) {
            out->data[i] = ((const float *)t->data)[i];
        } else {
            uint16_t h = ((const uint16_t *)t->data)[i];
            out->data[i] = t->dtype == DF_DTYPE_F16 ? df_f16_to_f32(h) : df_bf16_to_f32(h);
        }
    }
    return 1;
}

/* A float vector [n] (F16/BF16/F32) converted to float32. */
static df_status bind_vec(binder *b, df_vecf *out, const char *name, int64_t n) {
    df_tensor *t = need_checked(b, name, DT_FLOAT, 1, n, 0, NULL);
    if (!t || !to_f32(b, t, out)) return b->err->code;
    return DF_OK;
}

/* The depthwise conv weight: MLX [C, K, 1] or HF [C, 1, K], both row-major [C][K]. */
static df_status bind_conv(binder *b, df_vecf *out, const char *name, int64_t c, int64_t k) {
    df_tensor *t = need(b, name);
    if (!t || !check_dtype(b, t, DT_FLOAT)) return b->err->code;
    int64_t mlx[3] = {c, k, 1}, hf[3] = {c, 1, k};
    if (!shape_is(t, 3, hf) && !check_shape(b, t, 3, mlx, " (MLX layout; HF [C, 1, K] also accepted)"))
        return b->err->code;
    return to_f32(b, t, out) ? DF_OK : b->err->code;
}

enum { LIN_DENSE_ONLY = 1, LIN_EMBEDDING = 2 };

static df_status bind_linear(binder *b, df_linear *out, const char *module, int64_t rows,
                             int64_t cols, int flags) {
    char name[512];
    df_error *err = b->err;
    memset(out, 0, sizeof *out);
    out->name = pack_strdup(b->p, module);
    if (!out->name) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    out->rows = (int)rows;
    out->cols = (int)cols;

    snprintf(name, sizeof name, "%s.scales", module);
    df_tensor *sc = df_tensors_take(b->set, name);
    snprintf(name, sizeof name, "%s.weight", module);
    if (sc) {
        if (flags & LIN_DENSE_ONLY)
            return df_error_set(err, DF_ERR_MODEL,
                                "tensor %s (%s): %s must be dense (not quantized)", sc->name,
                                tfile(b, sc), module);
        qspec q = quant_for(b, module);
        if (!q.quantized)
            return df_error_set(err, DF_ERR_MODEL,
                                "tensor %s (%s): module is quantized but config.json quantization "
                                "%s", sc->name, tfile(b, sc),
                                b->quant ? "marks it not quantized (false)" : "is absent");
        if ((cols * q.bits) % 32 != 0)
            return df_error_set(err, DF_ERR_MODEL,
                                "module %s: input width %lld × %d bits is not a whole number of "
                                "32-bit words", module, (long long)cols, q.bits);
        if (cols % q.group_size != 0)
            return df_error_set(err, DF_ERR_MODEL,
                                "module %s: input width %lld is not a multiple of group_size %d",
                                module, (long long)cols, q.group_size);
        char why[96];
        snprintf(why, sizeof why, " (%d-bit, group %d)", q.bits, q.group_size);
        df_tensor *w = need_checked(b, name, DT(DF_DTYPE_U32), 2, rows, cols * q.bits / 32, why);
        if (!w) return err->code;
        int64_t ng = cols / q.group_size;
        if (!check_dtype(b, sc, DT_HALF) || !check_shape(b, sc, 2, (int64_t[]){rows, ng}, why))
            return err->code;
        snprintf(name, sizeof name, "%s.biases", module);
        df_tensor *bi = need_checked(b, name, DT(sc->dtype), 2, rows, ng, why);
        if (!bi) return err->code;
        out->bits = q.bits;
        out->group_size = q.group_size;
        out->wdtype = DF_DTYPE_U32;
        out->w = w->data;
        out->sdtype = sc->dtype;
        out->scales = sc->data;
        out->biases = bi->data;
    } else {
        df_tensor *w = need(b, name);
        if (!w) return err->code;
        if (w->dtype == DF_DTYPE_U32)
            return df_error_set(err, DF_ERR_MODEL,
                                "tensor %s (%s): U32 (quantized) weight but %s.scales is missing",
                                w->name, tfile(b, w), module);
        if (!check_dtype(b, w, DT_FLOAT) || !check_shape(b, w, 2, (int64_t[]){rows, cols}, NULL))
            return err->code;
        out->wdtype = w->dtype;
        out->w = w->data;
    }

    hentry *h = manifest_find(b, module);
    if (h) {
        h->used = 1;
        if (h->embedding != ((flags & LIN_EMBEDDING) != 0))
            return df_error_set(err, DF_ERR_MODEL,
                                "config.json modules entry %s: \"embedding\" is %s but the module "
                                "is %san embedding", h->path, h->embedding ? "true" : "false",
                                (flags & LIN_EMBEDDING) ? "" : "not ");
    }
    if (h && h->block > 0) {
        if (cols % h->block != 0)
            return df_error_set(err, DF_ERR_MODEL,
                                "config.json modules entry %s: Hadamard block %d does not divide "
                                "the input width %lld", h->path, h->block, (long long)cols);
        snprintf(name, sizeof name, "%s.signs", module);
        df_tensor *s = need_checked(b, name, DT(DF_DTYPE_F32), 1, cols, 0, NULL);
        if (!s) return err->code;
        const float *sg = s->data;
        for (int64_t i = 0; i < cols; i++)
            if (sg[i] != 1.0f && sg[i] != -1.0f)
                return df_error_set(err, DF_ERR_MODEL,
                                    "tensor %s (%s): element %lld is %g, signs must be +1 or -1",
                                    s->name, tfile(b, s), (long long)i, (double)sg[i]);
        out->hadamard_block = h->block;
        out->signs = sg;
    }
    return DF_OK;
}

/* ---- the architecture ------------------------------------------------------------- */

static df_status bind_layer(binder *b, int i) {
    const df_text_config *c = &b->p->pub.cfg;
    df_layer_weights *L = &b->p->pub.layers[i];
    char pre[96], n[160];
    df_status st;
    snprintf(pre, sizeof pre, "language_model.model.layers.%d.", i);
    L->kind = c->layer_kinds[i];
    const int64_t H = c->hidden_size;
#define NAME(suffix) (snprintf(n, sizeof n, "%s%s", pre, suffix), n)
#define TRY(x) do { if ((st = (x)) != DF_OK) return st; } while (0)
    TRY(bind_vec(b, &L->input_norm, NAME("input_layernorm.weight"), H));
    TRY(bind_vec(b, &L->post_norm, NAME("post_attention_layernorm.weight"), H));
    if (L->kind == DF_LAYER_FULL_ATTENTION) {
        const int64_t hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv_heads;
        TRY(bind_linear(b, &L->q_proj, NAME("self_attn.q_proj"), nh * 2 * hd, H, 0));
        TRY(bind_linear(b, &L->k_proj, NAME("self_attn.k_proj"), nkv * hd, H, 0));
        TRY(bind_linear(b, &L->v_proj, NAME("self_attn.v_proj"), nkv * hd, H, 0));
        TRY(bind_linear(b, &L->o_proj, NAME("self_attn.o_proj"), H, nh * hd, 0));
        TRY(bind_vec(b, &L->q_norm, NAME("self_attn.q_norm.weight"), hd));
        TRY(bind_vec(b, &L->k_norm, NAME("self_attn.k_norm.weight"), hd));
    } else {
        const int64_t nk = c->lin_n_k_heads, nv = c->lin_n_v_heads;
        const int64_t Kd = nk * c->lin_k_head_dim, Vd = nv * c->lin_v_head_dim;
        TRY(bind_linear(b, &L->in_proj_qkv, NAME("linear_attn.in_proj_qkv"), 2 * Kd + Vd, H, 0));
        TRY(bind_linear(b, &L->in_proj_z, NAME("linear_attn.in_proj_z"), Vd, H, 0));
        TRY(bind_linear(b, &L->in_proj_b, NAME("linear_attn.in_proj_b"), nv, H, LIN_DENSE_ONLY));
        TRY(bind_linear(b, &L->in_proj_a, NAME("linear_attn.in_proj_a"), nv, H, LIN_DENSE_ONLY));
        TRY(bind_linear(b, &L->out_proj, NAME("linear_attn.out_proj"), H, Vd, 0));
        TRY(bind_conv(b, &L->conv1d, NAME("linear_attn.conv1d.weight"), 2 * Kd + Vd, c->conv_kernel));
        TRY(bind_vec(b, &L->gdn_norm, NAME("linear_attn.norm.weight"), c->lin_v_head_dim));
        TRY(bind_vec(b, &L->A_log, NAME("linear_attn.A_log"), nv));
        TRY(bind_vec(b, &L->dt_bias, NAME("linear_attn.dt_bias"), nv));
    }
    TRY(bind_linear(b, &L->gate_proj, NAME("mlp.gate_proj"), c->intermediate_size, H, 0));
    TRY(bind_linear(b, &L->up_proj, NAME("mlp.up_proj"), c->intermediate_size, H, 0));
    TRY(bind_linear(b, &L->down_proj, NAME("mlp.down_proj"), H, c->intermediate_size, 0));
#undef NAME
#undef TRY
    return DF_OK;
}

static df_status bind_all(binder *b) {
    df_pack *p = &b->p->pub;
    const df_text_config *c = &p->cfg;
    df_status st;
    p->layers = pack_alloc(b->p, (size_t)c->n_layers * sizeof *p->layers);
    if (!p->layers) return df_error_set(b->err, DF_ERR_NOMEM, "out of memory");
    memset(p->layers, 0, (size_t)c->n_layers * sizeof *p->layers);
    if ((st = bind_linear(b, &p->embed, "language_model.model.embed_tokens", c->vocab_size,
                          c->hidden_size, LIN_EMBEDDING)) != DF_OK)
        return st;
    for (int i = 0; i < c->n_layers; i++)
        if ((st = bind_layer(b, i)) != DF_OK) return st;
    if ((st = bind_vec(b, &p->final_norm, "language_model.model.norm.weight", c->hidden_size)) !=
        DF_OK)
        return st;
    if (c->tie_word_embeddings)
        p->lm_head = p->embed;
    else if ((st = bind_linear(b, &p->lm_head, "language_model.lm_head", c->vocab_size,
                               c->hidden_size, 0)) != DF_OK)
        return st;

    for (size_t i = 0; i < b->n_hman; i++)
        if (!b->hman[i].used)
            return df_error_set(b->err, DF_ERR_MODEL,
                                "config.json modules entry %s names no linear module of the "
                                "architecture%s", b->hman[i].path,
                                c->tie_word_embeddings && strstr(b->hman[i].path, "lm_head")
                                    ? " (tie_word_embeddings is true: the embedding serves as lm_head)"
                                    : "");
    size_t n = df_tensors_count(b->set);
    for (size_t i = 0; i < n; i++) {
        const df_tensor *t = df_tensors_at(b->set, i);
        if (t->used || strncmp(t->name, "vision_tower.", 13) == 0) continue;
        size_t len = strlen(t->name);
        const char *hint = "";
        if (len > 6 && strcmp(t->name + len - 6, ".signs") == 0)
            hint = " (Hadamard signs of a module with no block in config.json modules)";
        else if (len > 7 && strcmp(t->name + len - 7, ".biases") == 0)
            hint = " (biases without scales)";
        else if (c->tie_word_embeddings && strncmp(t->name, "language_model.lm_head.", 23) == 0)
            hint = " (tie_word_embeddings is true)";
        return df_error_set(b->err, DF_ERR_MODEL, "unexpected tensor %s (%s)%s", t->name,
                            tfile(b, t), hint);
    }
    return DF_OK;
}

/* ---- loading ---------------------------------------------------------------------- */

static df_status load_config(pack_impl *p, binder *b, json_t **root_out, df_error *err) {
    df_pack *pk = &p->pub;
    char *path = df_path_join(pk->dir, "config.json");
    char *text = NULL;
    df_status st = DF_OK;
    if (!path) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    if ((st = df_read_text_file(path, DF_CONFIG_MAX_BYTES, &text, err)) != DF_OK) goto done;
    json_error_t je;
    json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        st = df_error_set(err, DF_ERR_FORMAT, "%s: not valid JSON: %s (line %d, column %d)", path,
                          je.text, je.line, je.column);
        goto done;
    }
    *root_out = root;
    if ((st = df_text_config_parse_json(&pk->cfg, root, err)) != DF_OK ||
        (st = parse_quant(b, root)) != DF_OK || (st = parse_manifest(b, root)) != DF_OK)
        df_error_prefix(err, "%s", path);
    if (st != DF_OK) goto done;

    /* generation_config.json is optional */
    free(path);
    free(text);
    text = NULL;
    path = df_path_join(pk->dir, "generation_config.json");
    if (!path) {
        st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (df_path_present(path)) { /* present but unreadable (a FIFO, a folder, a link loop): an error */
        if ((st = df_read_text_file(path, DF_CONFIG_MAX_BYTES, &text, err)) != DF_OK) goto done;
        if ((st = df_generation_config_parse(&pk->gen, &pk->cfg, text, err)) != DF_OK)
            df_error_prefix(err, "%s", path);
    }
done:
    free(path);
    free(text);
    return st;
}

int df_linear_biases_negate_scales(const df_linear *L) {
    if (L->bits <= 0 || !L->scales || !L->biases || L->group_size <= 0 ||
        (L->sdtype != DF_DTYPE_F16 && L->sdtype != DF_DTYPE_BF16))
        return 0;
    const uint16_t *s = L->scales, *b = L->biases;
    const size_t n = (size_t)L->rows * (size_t)(L->cols / L->group_size);
    for (size_t i = 0; i < n; i++)
        if (b[i] != (uint16_t)(s[i] ^ 0x8000u)) return 0;
    return 1;
}

df_status df_pack_load(df_pack **out, const char *dir, df_error *err) {
    *out = NULL;
    df_error local = {0};
    if (!err) err = &local;
    pack_impl *p = calloc(1, sizeof *p);
    if (!p) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    binder b = {.p = p, .err = err};
    json_t *root = NULL;
    df_status st;
    p->pub.dir = strdup(dir);
    if (!p->pub.dir) {
        st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
        goto done;
    }
    if ((st = load_config(p, &b, &root, err)) != DF_OK) goto done;
    if ((st = df_tensors_open_dir(&p->pub.tensors, dir, err)) != DF_OK) goto done;
    b.set = p->pub.tensors;
    st = bind_all(&b);
done:
    free(b.hman); /* its paths point into root */
    json_decref(root);
    if (st != DF_OK) {
        df_pack_free(&p->pub);
        return st;
    }
    *out = &p->pub;
    return DF_OK;
}

void df_pack_free(df_pack *pack) {
    if (!pack) return;
    pack_impl *p = (pack_impl *)pack; /* df_pack is the first member */
    df_tensors_free(pack->tensors);
    df_text_config_free(&pack->cfg);
    free(pack->dir);
    for (size_t i = 0; i < p->n_owned; i++) free(p->owned[i]);
    free(p->owned);
    free(p);
}
