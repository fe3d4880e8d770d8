/* config.json and generation_config.json of a Qwen3.5-architecture pack
 * (see include/dflash/pack.h; field meanings from Hugging Face transformers
 * `Qwen3_5TextConfig` and mlx-vlm `qwen3_5`, MODEL.md §1).
 *
 * Text fields are looked up under "text_config" first, then at the top level. RoPE fields
 * are looked up in "rope_parameters" (or the older "rope_scaling"), then beside the other
 * text fields, in both places. Defaults for optional fields follow the reference config:
 * head_dim = hidden/heads, conv kernel 4, rms_norm_eps 1e-6, max_position_embeddings 32768,
 * rope_theta 1e7, partial_rotary_factor 0.25, full_attention_interval 4. Without an
 * mrope_section the RoPE is plain partial RoPE: mrope_section = {rot/2, 0, 0}.
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/files.h"
#include "dflash/pack.h"
#include "io/io_internal.h"

char *df_path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t n = a;
    if (a && dir[a - 1] != '/') p[n++] = '/';
    memcpy(p + n, name, b + 1);
    return p;
}

df_status df_read_text_file(const char *path, size_t max_bytes, char **out, df_error *err) {
    *out = NULL;
    FILE *f = df_fopen_regular(path, err);
    if (!f) return err ? err->code : DF_ERR_IO;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    df_status st = DF_OK;
    while (buf) {
        if (n + 1 >= cap) {
            if (cap > max_bytes) {
                st = df_error_set(err, DF_ERR_IO, "%s: larger than %zu bytes", path, max_bytes);
                break;
            }
            char *nb = realloc(buf, cap * 2);
            if (!nb) break;
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - 1 - n, f);
        n += r;
        if (r == 0) {
            if (ferror(f)) st = df_error_set(err, DF_ERR_IO, "%s: read error", path);
            break;
        }
    }
    fclose(f);
    if (!buf) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    if (st == DF_OK && n > max_bytes)
        st = df_error_set(err, DF_ERR_IO, "%s: larger than %zu bytes", path, max_bytes);
    if (st != DF_OK) {
        free(buf);
        return st;
    }
    buf[n] = 0;
    *out = buf;
    return DF_OK;
}

/* ---- field access ----------------------------------------------------------------- */

/* The places a text field may live, most specific first. */
typedef struct cfg_src {
    json_t *obj[4];
    const char *where[4]; /* for messages: "text_config." or "" */
    int n;
} cfg_src;

static json_t *src_get(const cfg_src *s, const char *key, const char **where) {
    for (int i = 0; i < s->n; i++) {
        json_t *v = json_object_get(s->obj[i], key);
        if (v && !json_is_null(v)) {
            if (where) *where = s->where[i];
            return v;
        }
    }
    return NULL;
}

/* An integer field in [lo, hi]. required=0: *out keeps its default when absent. */
static df_status get_int(const cfg_src *s, const char *key, int required, long long lo,
                         long long hi, int *out, df_error *err) {
    const char *where = "";
    json_t *v = src_get(s, key, &where);
    if (!v) {
        if (required)
            return df_error_set(err, DF_ERR_FORMAT,
                                "missing required field \"%s\" (under text_config or at top level)",
                                key);
        return DF_OK;
    }
    if (!json_is_integer(v))
        return df_error_set(err, DF_ERR_FORMAT, "field %s%s must be an integer", where, key);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return df_error_set(err, DF_ERR_FORMAT, "field %s%s = %lld is out of range [%lld, %lld]",
                            where, key, x, lo, hi);
    *out = (int)x;
    return DF_OK;
}

/* A number field, finite, in [lo, hi] (lo_open: (lo, hi]). */
static df_status get_num(const cfg_src *s, const char *key, double lo, int lo_open, double hi,
                         float *out, df_error *err) {
    const char *where = "";
    json_t *v = src_get(s, key, &where);
    if (!v) return DF_OK;
    if (!json_is_number(v))
        return df_error_set(err, DF_ERR_FORMAT, "field %s%s must be a number", where, key);
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || (lo_open && x == lo) || x > hi)
        return df_error_set(err, DF_ERR_FORMAT, "field %s%s = %g is out of range %c%g, %g]", where,
                            key, x, lo_open ? '(' : '[', lo, hi);
    *out = (float)x;
    return DF_OK;
}

static df_status get_bool(const cfg_src *s, const char *key, int *out, df_error *err) {
    const char *where = "";
    json_t *v = src_get(s, key, &where);
    if (!v) return DF_OK;
    if (!json_is_boolean(v))
        return df_error_set(err, DF_ERR_FORMAT, "field %s%s must be true or false", where, key);
    *out = json_is_true(v);
    return DF_OK;
}

/* Adds eos ids (an integer or a list of integers) to cfg, without duplicates. */
static df_status add_eos(df_text_config *cfg, json_t *v, const char *what, df_error *err) {
    if (!v || json_is_null(v)) return DF_OK;
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_is_array(v) ? json_array_get(v, i) : v;
        if (!json_is_integer(e) || json_integer_value(e) < 0 ||
            (cfg->vocab_size > 0 && json_integer_value(e) >= cfg->vocab_size))
            return df_error_set(err, DF_ERR_FORMAT,
                                "%s must be a token id or a list of token ids in [0, %d)", what,
                                cfg->vocab_size);
        int32_t id = (int32_t)json_integer_value(e);
        int have = 0;
        for (int k = 0; k < cfg->n_eos; k++) have |= cfg->eos_ids[k] == id;
        if (have) continue;
        if (cfg->n_eos == DF_MAX_EOS)
            return df_error_set(err, DF_ERR_FORMAT, "%s: more than %d distinct eos ids", what,
                                DF_MAX_EOS);
        cfg->eos_ids[cfg->n_eos++] = id;
    }
    return DF_OK;
}

/* An optional string field that, when present, must equal want. */
static df_status require_str(json_t *root, const char *key, const char *want, df_error *err) {
    json_t *v = json_object_get(root, key);
    if (!v) return DF_OK;
    if (!json_is_string(v) || strcmp(json_string_value(v), want) != 0)
        return df_error_set(err, DF_ERR_UNSUPPORTED, "field %s must be \"%s\"", key, want);
    return DF_OK;
}

/* ---- text config ------------------------------------------------------------------ */

static df_status parse_layer_types(df_text_config *cfg, const cfg_src *src, df_error *err) {
    cfg->layer_kinds = calloc((size_t)cfg->n_layers, sizeof *cfg->layer_kinds);
    if (!cfg->layer_kinds) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    const char *where = "";
    json_t *lt = src_get(src, "layer_types", &where);
    if (lt) {
        if (!json_is_array(lt) || json_array_size(lt) != (size_t)cfg->n_layers)
            return df_error_set(err, DF_ERR_FORMAT,
                                "field %slayer_types must be a list of %d entries (one per layer)",
                                where, cfg->n_layers);
        for (int i = 0; i < cfg->n_layers; i++) {
            const char *s = json_string_value(json_array_get(lt, (size_t)i));
            if (s && strcmp(s, "linear_attention") == 0)
                cfg->layer_kinds[i] = DF_LAYER_LINEAR_ATTENTION;
            else if (s && strcmp(s, "full_attention") == 0)
                cfg->layer_kinds[i] = DF_LAYER_FULL_ATTENTION;
            else
                return df_error_set(err, DF_ERR_FORMAT,
                                    "field %slayer_types[%d] must be \"linear_attention\" or "
                                    "\"full_attention\"", where, i);
        }
        return DF_OK;
    }
    int interval = 4;
    df_status st = get_int(src, "full_attention_interval", 0, 1, 1 << 20, &interval, err);
    if (st != DF_OK) return st;
    for (int i = 0; i < cfg->n_layers; i++)
        cfg->layer_kinds[i] = (i + 1) % interval == 0 ? DF_LAYER_FULL_ATTENTION
                                                      : DF_LAYER_LINEAR_ATTENTION;
    return DF_OK;
}

static df_status parse_rope(df_text_config *cfg, json_t *text, json_t *root, df_error *err) {
    cfg_src rs = {.n = 0};
    const char *names[2] = {"rope_parameters", "rope_scaling"};
    json_t *levels[2] = {text, root};
    const char *lw[2] = {"text_config.", ""};
    for (int l = 0; l < 2; l++) {
        if (!levels[l]) continue;
        for (int k = 0; k < 2; k++) {
            json_t *o = json_object_get(levels[l], names[k]);
            if (o && !json_is_null(o) && !json_is_object(o))
                return df_error_set(err, DF_ERR_FORMAT, "field %s%s must be an object", lw[l], names[k]);
            if (json_is_object(o) && rs.n < 3) {
                rs.obj[rs.n] = o;
                rs.where[rs.n++] = k == 0 ? "rope_parameters." : "rope_scaling.";
                break;
            }
        }
    }
    /* then the text level itself */
    for (int l = 0; l < 2 && rs.n < 4; l++)
        if (levels[l]) {
            rs.obj[rs.n] = levels[l];
            rs.where[rs.n++] = lw[l];
        }
    /* only unscaled rotary embeddings: a scaling (yarn, linear, dynamic, ...) would change every
     * position's angles, so a pack that asks for one is refused rather than run wrongly */
    static const char *const kinds[2] = {"rope_type", "type"};
    for (int k = 0; k < 2; k++) {
        const char *where = "";
        json_t *t = src_get(&rs, kinds[k], &where);
        if (t && (!json_is_string(t) || (strcmp(json_string_value(t), "default") != 0 &&
                                         strcmp(json_string_value(t), "mrope") != 0)))
            return df_error_set(err, DF_ERR_UNSUPPORTED,
                                "field %s%s must be \"default\" (or \"mrope\"): scaled rotary embeddings are not "
                                "supported",
                                where, kinds[k]);
    }
    cfg->rope_theta = 1e7f;
    cfg->partial_rotary_factor = 0.25f;
    df_status st;
    if ((st = get_num(&rs, "rope_theta", 0.0, 1, 1e30, &cfg->rope_theta, err)) != DF_OK) return st;
    if ((st = get_num(&rs, "partial_rotary_factor", 0.0, 1, 1.0, &cfg->partial_rotary_factor, err)) !=
        DF_OK)
        return st;
    double rot_d = (double)cfg->head_dim * cfg->partial_rotary_factor;
    int rot = (int)lround(rot_d);
    if (fabs(rot_d - rot) > 1e-3 || rot < 2 || rot % 2 != 0)
        return df_error_set(err, DF_ERR_FORMAT,
                            "head_dim %d × partial_rotary_factor %g is not an even number of "
                            "rotary dimensions", cfg->head_dim, (double)cfg->partial_rotary_factor);
    const char *where = "";
    json_t *ms = src_get(&rs, "mrope_section", &where);
    if (ms) {
        int sum = 0, ok = json_is_array(ms) && json_array_size(ms) == 3;
        for (size_t i = 0; ok && i < 3; i++) {
            json_t *e = json_array_get(ms, i);
            ok = json_is_integer(e) && json_integer_value(e) >= 0 && json_integer_value(e) <= rot;
            if (ok) sum += cfg->mrope_section[i] = (int)json_integer_value(e);
        }
        if (!ok || sum != rot / 2)
            return df_error_set(err, DF_ERR_FORMAT,
                                "field %smrope_section must be 3 non-negative integers summing to "
                                "rot/2 = %d", where, rot / 2);
    } else {
        cfg->mrope_section[0] = rot / 2;
    }
    return get_bool(&rs, "mrope_interleaved", &cfg->mrope_interleaved, err);
}

static df_status text_config_parse_root(df_text_config *cfg, json_t *root, df_error *err) {
    if (!json_is_object(root))
        return df_error_set(err, DF_ERR_FORMAT, "config is not a JSON object");
    json_t *mt = json_object_get(root, "model_type");
    if (!json_is_string(mt))
        return df_error_set(err, DF_ERR_FORMAT, "missing or non-string field \"model_type\"");
    const char *model_type = json_string_value(mt);
    int prism = strcmp(model_type, "prism_hadamard_qwen35") == 0;
    if (!prism && strcmp(model_type, "qwen3_5") != 0 && strcmp(model_type, "qwen3_5_text") != 0)
        return df_error_set(err, DF_ERR_UNSUPPORTED,
                            "unknown model_type \"%.40s\" (expected \"qwen3_5\" or "
                            "\"prism_hadamard_qwen35\")", model_type);
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", model_type);
    df_status st;
    if (prism) {
        json_t *sv = json_object_get(root, "schema_version");
        if (sv && (!json_is_integer(sv) || json_integer_value(sv) != 2))
            return df_error_set(err, DF_ERR_UNSUPPORTED, "field schema_version must be 2");
        if ((st = require_str(root, "base_model_type", "qwen3_5", err)) != DF_OK ||
            (st = require_str(root, "tensor_namespace", "mlx-vlm-qwen3_5", err)) != DF_OK ||
            (st = require_str(root, "gdn_activation_layout", "grouped", err)) != DF_OK)
            return st;
    }
    json_t *text = json_object_get(root, "text_config");
    if (text && !json_is_object(text))
        return df_error_set(err, DF_ERR_FORMAT, "field text_config must be an object");
    cfg_src src = {.n = 0};
    if (text) {
        src.obj[src.n] = text;
        src.where[src.n++] = "text_config.";
    }
    src.obj[src.n] = root;
    src.where[src.n++] = "";

    const int big = 1 << 24;
    struct {
        const char *key;
        int *out;
        int required, hi;
    } ints[] = {
        {"hidden_size", &cfg->hidden_size, 1, big},
        {"num_hidden_layers", &cfg->n_layers, 1, 4096},
        {"num_attention_heads", &cfg->n_heads, 1, 4096},
        {"num_key_value_heads", &cfg->n_kv_heads, 1, 4096},
        {"linear_num_key_heads", &cfg->lin_n_k_heads, 1, 4096},
        {"linear_num_value_heads", &cfg->lin_n_v_heads, 1, 4096},
        {"linear_key_head_dim", &cfg->lin_k_head_dim, 1, 65536},
        {"linear_value_head_dim", &cfg->lin_v_head_dim, 1, 65536},
        {"intermediate_size", &cfg->intermediate_size, 1, big},
        {"vocab_size", &cfg->vocab_size, 1, big},
        {"head_dim", &cfg->head_dim, 0, 65536},
        {"linear_conv_kernel_dim", &cfg->conv_kernel, 0, 64},
        {"max_position_embeddings", &cfg->max_position_embeddings, 0, 1 << 30},
    };
    cfg->conv_kernel = 4;
    cfg->max_position_embeddings = 32768;
    cfg->rms_norm_eps = 1e-6f;
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if ((st = get_int(&src, ints[i].key, ints[i].required, 1, ints[i].hi, ints[i].out, err)) !=
            DF_OK)
            return st;
    if (cfg->head_dim == 0) {
        if (cfg->hidden_size % cfg->n_heads != 0)
            return df_error_set(err, DF_ERR_FORMAT,
                                "missing head_dim and hidden_size %d is not a multiple of "
                                "num_attention_heads %d", cfg->hidden_size, cfg->n_heads);
        cfg->head_dim = cfg->hidden_size / cfg->n_heads;
    }
    if (cfg->n_heads % cfg->n_kv_heads != 0)
        return df_error_set(err, DF_ERR_FORMAT,
                            "num_attention_heads %d is not a multiple of num_key_value_heads %d",
                            cfg->n_heads, cfg->n_kv_heads);
    if (cfg->lin_n_v_heads % cfg->lin_n_k_heads != 0)
        return df_error_set(err, DF_ERR_FORMAT,
                            "linear_num_value_heads %d is not a multiple of linear_num_key_heads %d",
                            cfg->lin_n_v_heads, cfg->lin_n_k_heads);
    if ((st = get_num(&src, "rms_norm_eps", 0.0, 1, 1.0, &cfg->rms_norm_eps, err)) != DF_OK) return st;

    /* tie_word_embeddings: both levels must agree when both are given */
    int tie_text = -1, tie_top = -1;
    cfg_src s1 = {.obj = {text}, .where = {"text_config."}, .n = text ? 1 : 0};
    cfg_src s2 = {.obj = {root}, .where = {""}, .n = 1};
    if ((st = get_bool(&s1, "tie_word_embeddings", &tie_text, err)) != DF_OK ||
        (st = get_bool(&s2, "tie_word_embeddings", &tie_top, err)) != DF_OK)
        return st;
    if (tie_text >= 0 && tie_top >= 0 && tie_text != tie_top)
        return df_error_set(err, DF_ERR_FORMAT,
                            "text_config.tie_word_embeddings and tie_word_embeddings disagree");
    cfg->tie_word_embeddings = tie_text >= 0 ? tie_text : (tie_top >= 0 ? tie_top : 0);

    json_t *v;
    if ((v = src_get(&src, "hidden_act", NULL)) &&
        (!json_is_string(v) || strcmp(json_string_value(v), "silu") != 0))
        return df_error_set(err, DF_ERR_UNSUPPORTED, "field hidden_act must be \"silu\"");
    if ((v = src_get(&src, "attn_output_gate", NULL)) && !json_is_true(v))
        return df_error_set(err, DF_ERR_UNSUPPORTED,
                            "field attn_output_gate must be true (gated attention)");
    if ((v = src_get(&src, "attention_bias", NULL)) && !json_is_false(v))
        return df_error_set(err, DF_ERR_UNSUPPORTED, "field attention_bias must be false (no attention biases)");
    if ((st = parse_rope(cfg, text, root, err)) != DF_OK) return st;
    if ((st = parse_layer_types(cfg, &src, err)) != DF_OK) return st;
    if (text && (st = add_eos(cfg, json_object_get(text, "eos_token_id"),
                              "field text_config.eos_token_id", err)) != DF_OK)
        return st;
    return add_eos(cfg, json_object_get(root, "eos_token_id"), "field eos_token_id", err);
}

df_status df_text_config_parse_json(df_text_config *cfg, json_t *root, df_error *err) {
    memset(cfg, 0, sizeof *cfg);
    df_status st = text_config_parse_root(cfg, root, err);
    if (st != DF_OK) df_text_config_free(cfg);
    return st;
}

df_status df_text_config_parse(df_text_config *cfg, const char *json_text, df_error *err) {
    memset(cfg, 0, sizeof *cfg);
    json_error_t je;
    json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return df_error_set(err, DF_ERR_FORMAT, "not valid JSON: %s (line %d, column %d)", je.text,
                            je.line, je.column);
    df_status st = df_text_config_parse_json(cfg, root, err);
    json_decref(root);
    return st;
}

df_status df_pack_vocab_size(const char *dir, int *vocab, df_error *err) {
    char *path = df_path_join(dir, "config.json"), *text = NULL;
    if (!path) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    df_status st = df_read_text_file(path, DF_CONFIG_MAX_BYTES, &text, err);
    if (st == DF_OK) {
        df_text_config cfg;
        st = df_text_config_parse(&cfg, text, err);
        if (st == DF_OK) *vocab = cfg.vocab_size;
        df_text_config_free(&cfg);
    }
    free(text);
    free(path);
    return st;
}

void df_text_config_free(df_text_config *cfg) {
    if (!cfg) return;
    free(cfg->layer_kinds);
    cfg->layer_kinds = NULL;
}

/* ---- generation_config.json ------------------------------------------------------- */

df_status df_generation_config_parse(df_generation_defaults *gen, df_text_config *cfg,
                                     const char *json_text, df_error *err) {
    memset(gen, 0, sizeof *gen);
    json_error_t je;
    json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return df_error_set(err, DF_ERR_FORMAT, "not valid JSON: %s (line %d, column %d)", je.text,
                            je.line, je.column);
    df_status st = DF_OK;
    cfg_src src = {.obj = {root}, .where = {""}, .n = 1};
    if (!json_is_object(root)) {
        st = df_error_set(err, DF_ERR_FORMAT, "not a JSON object");
        goto done;
    }
    struct {
        const char *key;
        float *out;
        int *has;
        double lo;
        int lo_open;
        double hi;
    } nums[] = {
        {"temperature", &gen->temperature, &gen->has_temperature, 0.0, 0, 1e6},
        {"top_p", &gen->top_p, &gen->has_top_p, 0.0, 1, 1.0},
        {"min_p", &gen->min_p, &gen->has_min_p, 0.0, 0, 1.0},
        {"repetition_penalty", &gen->repetition_penalty, &gen->has_repetition_penalty, 0.0, 1, 1e6},
    };
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        if (!src_get(&src, nums[i].key, NULL)) continue;
        if ((st = get_num(&src, nums[i].key, nums[i].lo, nums[i].lo_open, nums[i].hi, nums[i].out,
                          err)) != DF_OK)
            goto done;
        *nums[i].has = 1;
    }
    if (src_get(&src, "top_k", NULL)) {
        if ((st = get_int(&src, "top_k", 1, 0, 1 << 30, &gen->top_k, err)) != DF_OK) goto done;
        gen->has_top_k = 1;
    }
    if (cfg) st = add_eos(cfg, json_object_get(root, "eos_token_id"), "field eos_token_id", err);
done:
    json_decref(root);
    return st;
}
