/* Synthetic packs (include/dflash/synth.h): config.json + model.safetensors with production
 * shapes and random weights, and a DFlash v1 drafter folder.
 *
 * The safetensors file is laid out first (header with every tensor's dtype, shape and byte
 * range), then filled in parallel: the data is cut into tasks of at most 64 MB, each
 * generated from a counter-based hash of (seed, tensor, element) and written with pwrite,
 * so the bytes do not depend on the thread count or the task order. biases = -scales holds
 * because both tensors hash the same counters.
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/threads.h"
#include "dflash/synth.h"
#include "dflash/tokenizer.h"

typedef struct synth_shape {
    int hidden, layers, heads, kv_heads, head_dim, lin_k_heads, lin_v_heads, lin_k_dim, lin_v_dim, conv_k;
    int intermediate, vocab, hadamard, max_pos;
    int mrope[3]; /* interleaved M-RoPE sections (sum = rotary dims / 2) */
    int eos[2];
    /* drafter */
    int d_layers, d_heads, d_kv_heads, d_head_dim, d_intermediate, d_block, d_mask, d_n_taps;
    int d_taps[8];
} synth_shape;

static const synth_shape SHAPE_27B = {
    .hidden = 5120, .layers = 64, .heads = 24, .kv_heads = 4, .head_dim = 256, .lin_k_heads = 16,
    .lin_v_heads = 48, .lin_k_dim = 128, .lin_v_dim = 128, .conv_k = 4, .intermediate = 17408, .vocab = 248320,
    .hadamard = 1024, .max_pos = 262144, .mrope = {11, 11, 10}, .eos = {248046, 248044}, .d_layers = 5, .d_heads = 32, .d_kv_heads = 8,
    .d_head_dim = 128, .d_intermediate = 17408, .d_block = 16, .d_mask = 248070, .d_n_taps = 5,
    .d_taps = {5, 19, 33, 47, 61}};

static const synth_shape SHAPE_TINY = {
    .hidden = 256, .layers = 4, .heads = 4, .kv_heads = 2, .head_dim = 64, .lin_k_heads = 2, .lin_v_heads = 4,
    .lin_k_dim = 64, .lin_v_dim = 64, .conv_k = 4, .intermediate = 512, .vocab = 4096, .hadamard = 256,
    .max_pos = 4096, .mrope = {3, 3, 2}, .eos = {4094, 4093}, .d_layers = 2, .d_heads = 4, .d_kv_heads = 2, .d_head_dim = 64,
    .d_intermediate = 512, .d_block = 16, .d_mask = 4000, .d_n_taps = 2, .d_taps = {1, 2}};

/* ---- tensors ------------------------------------------------------------------------------- */

typedef enum gen_kind {
    G_CODES,     /* uint32 words of ternary 2-bit codes */
    G_SCALES,    /* fp16 sqrt(2/in) * (0.75 + 0.5 u) */
    G_BIASES,    /* fp16 -scales (same counters as the scales tensor `pair`) */
    G_SIGNS,     /* f32 ±1 */
    G_F16,       /* fp16 center + spread * (2u - 1) */
    G_BF16,      /* bf16 center + spread * (2u - 1) */
    G_F32        /* f32 center + spread * (2u - 1) */
} gen_kind;

typedef struct stensor {
    char name[160];
    const char *dtype; /* safetensors dtype */
    int ndim;
    int64_t shape[3];
    size_t bytes, offset;
    gen_kind kind;
    int in;            /* input width (scales) */
    float center, spread;
    uint64_t seed;     /* counter stream (biases reuse their scales' seed) */
} stensor;

typedef struct tlist {
    stensor *t;
    size_t n, cap;
} tlist;

static uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static float unit(uint64_t h) { return (float)(h >> 40) / (float)(1ULL << 24); } /* [0, 1) */

static uint16_t f16_bits(float f) {
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

static uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even (finite values) */
    return (uint16_t)(u >> 16);
}

static stensor *add(tlist *l, const char *name, const char *dtype, int ndim, int64_t d0, int64_t d1, int64_t d2,
                    gen_kind kind, uint64_t seed) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 1024;
        stensor *t = realloc(l->t, cap * sizeof *t);
        if (!t) return NULL;
        l->t = t;
        l->cap = cap;
    }
    stensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    size_t nl = strlen(name);
    if (nl >= sizeof t->name) nl = sizeof t->name - 1;
    memcpy(t->name, name, nl);
    t->name[nl] = 0;
    t->dtype = dtype;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->shape[2] = d2;
    size_t numel = (size_t)d0 * (size_t)(ndim > 1 ? d1 : 1) * (size_t)(ndim > 2 ? d2 : 1);
    size_t esz = strcmp(dtype, "F32") == 0 || strcmp(dtype, "U32") == 0 ? 4 : 2;
    t->bytes = numel * esz;
    t->kind = kind;
    t->seed = mix64(seed * 0x9e3779b97f4a7c15ULL + l->n);
    return t;
}

static int add_vec(tlist *l, const char *name, const char *dtype, int64_t n, gen_kind k, float center, float spread,
                   uint64_t seed) {
    stensor *t = add(l, name, dtype, 1, n, 0, 0, k, seed);
    if (!t) return 0;
    t->center = center;
    t->spread = spread;
    return 1;
}

/* A quantized 2-bit module [rows, cols] with Hadamard signs. */
static int add_quant(tlist *l, const char *module, int64_t rows, int64_t cols, uint64_t seed) {
    char n[200];
    snprintf(n, sizeof n, "%s.weight", module);
    if (!add(l, n, "U32", 2, rows, cols / 16, 0, G_CODES, seed)) return 0;
    snprintf(n, sizeof n, "%s.scales", module);
    stensor *s = add(l, n, "F16", 2, rows, cols / 128, 0, G_SCALES, seed);
    if (!s) return 0;
    s->in = (int)cols;
    uint64_t sseed = s->seed;
    snprintf(n, sizeof n, "%s.biases", module);
    stensor *b = add(l, n, "F16", 2, rows, cols / 128, 0, G_BIASES, seed);
    if (!b) return 0;
    b->in = (int)cols;
    b->seed = sseed;
    snprintf(n, sizeof n, "%s.signs", module);
    return add(l, n, "F32", 1, cols, 0, 0, G_SIGNS, seed) != NULL;
}

static int add_dense(tlist *l, const char *name, const char *dtype, int64_t rows, int64_t cols, uint64_t seed) {
    gen_kind k = strcmp(dtype, "BF16") == 0 ? G_BF16 : G_F16;
    stensor *t = add(l, name, dtype, 2, rows, cols, 0, k, seed);
    if (!t) return 0;
    t->spread = sqrtf(3.0f / (float)cols); /* variance 1/cols */
    return 1;
}

static int target_tensors(tlist *l, const synth_shape *s, uint64_t seed) {
    char n[200];
    const int64_t H = s->hidden, I = s->intermediate;
    const int64_t Kd = (int64_t)s->lin_k_heads * s->lin_k_dim, Vd = (int64_t)s->lin_v_heads * s->lin_v_dim;
    if (!add_quant(l, "language_model.model.embed_tokens", s->vocab, H, seed)) return 0;
    for (int i = 0; i < s->layers; i++) {
        const int full = (i + 1) % 4 == 0;
#define P(suffix) (snprintf(n, sizeof n, "language_model.model.layers.%d.%s", i, suffix), n)
        if (!add_vec(l, P("input_layernorm.weight"), "F16", H, G_F16, 1.0f, 0.1f, seed) ||
            !add_vec(l, P("post_attention_layernorm.weight"), "F16", H, G_F16, 1.0f, 0.1f, seed))
            return 0;
        if (full) {
            if (!add_quant(l, P("self_attn.q_proj"), (int64_t)s->heads * 2 * s->head_dim, H, seed) ||
                !add_quant(l, P("self_attn.k_proj"), (int64_t)s->kv_heads * s->head_dim, H, seed) ||
                !add_quant(l, P("self_attn.v_proj"), (int64_t)s->kv_heads * s->head_dim, H, seed) ||
                !add_quant(l, P("self_attn.o_proj"), H, (int64_t)s->heads * s->head_dim, seed) ||
                !add_vec(l, P("self_attn.q_norm.weight"), "F16", s->head_dim, G_F16, 1.0f, 0.1f, seed) ||
                !add_vec(l, P("self_attn.k_norm.weight"), "F16", s->head_dim, G_F16, 1.0f, 0.1f, seed))
                return 0;
        } else {
            stensor *c;
            if (!add_quant(l, P("linear_attn.in_proj_qkv"), 2 * Kd + Vd, H, seed) ||
                !add_quant(l, P("linear_attn.in_proj_z"), Vd, H, seed) ||
                !add_dense(l, P("linear_attn.in_proj_a.weight"), "F16", s->lin_v_heads, H, seed) ||
                !add_dense(l, P("linear_attn.in_proj_b.weight"), "F16", s->lin_v_heads, H, seed) ||
                !add_quant(l, P("linear_attn.out_proj"), H, Vd, seed) ||
                !(c = add(l, P("linear_attn.conv1d.weight"), "F16", 3, 2 * Kd + Vd, s->conv_k, 1, G_F16, seed)) ||
                !add_vec(l, P("linear_attn.norm.weight"), "F16", s->lin_v_dim, G_F16, 1.0f, 0.1f, seed) ||
                !add_vec(l, P("linear_attn.A_log"), "F32", s->lin_v_heads, G_F32, 1.4f, 1.3f, seed) ||
                !add_vec(l, P("linear_attn.dt_bias"), "F16", s->lin_v_heads, G_F16, 0.0f, 0.5f, seed))
                return 0;
            c->spread = 0.3f;
        }
        if (!add_quant(l, P("mlp.gate_proj"), I, H, seed) || !add_quant(l, P("mlp.up_proj"), I, H, seed) ||
            !add_quant(l, P("mlp.down_proj"), H, I, seed))
            return 0;
#undef P
    }
    if (!add_vec(l, "language_model.model.norm.weight", "F16", H, G_F16, 1.0f, 0.1f, seed)) return 0;
    return add_quant(l, "language_model.lm_head", s->vocab, H, seed);
}

static int drafter_tensors(tlist *l, const synth_shape *s, uint64_t seed) {
    char n[200];
    const int64_t H = s->hidden, I = s->d_intermediate, hd = s->d_head_dim;
    if (!add_dense(l, "fc.weight", "BF16", H, (int64_t)s->d_n_taps * H, seed) ||
        !add_vec(l, "hidden_norm.weight", "BF16", H, G_BF16, 1.0f, 0.1f, seed) ||
        !add_vec(l, "norm.weight", "BF16", H, G_BF16, 1.0f, 0.1f, seed))
        return 0;
    for (int i = 0; i < s->d_layers; i++) {
#define P(suffix) (snprintf(n, sizeof n, "layers.%d.%s", i, suffix), n)
        if (!add_vec(l, P("input_layernorm.weight"), "BF16", H, G_BF16, 1.0f, 0.1f, seed) ||
            !add_vec(l, P("post_attention_layernorm.weight"), "BF16", H, G_BF16, 1.0f, 0.1f, seed) ||
            !add_vec(l, P("self_attn.q_norm.weight"), "BF16", hd, G_BF16, 1.0f, 0.1f, seed) ||
            !add_vec(l, P("self_attn.k_norm.weight"), "BF16", hd, G_BF16, 1.0f, 0.1f, seed) ||
            !add_dense(l, P("self_attn.q_proj.weight"), "BF16", (int64_t)s->d_heads * hd, H, seed) ||
            !add_dense(l, P("self_attn.k_proj.weight"), "BF16", (int64_t)s->d_kv_heads * hd, H, seed) ||
            !add_dense(l, P("self_attn.v_proj.weight"), "BF16", (int64_t)s->d_kv_heads * hd, H, seed) ||
            !add_dense(l, P("self_attn.o_proj.weight"), "BF16", H, (int64_t)s->d_heads * hd, seed) ||
            !add_dense(l, P("mlp.gate_proj.weight"), "BF16", I, H, seed) ||
            !add_dense(l, P("mlp.up_proj.weight"), "BF16", I, H, seed) ||
            !add_dense(l, P("mlp.down_proj.weight"), "BF16", H, I, seed))
            return 0;
#undef P
    }
    return 1;
}

/* ---- generation ----------------------------------------------------------------------------- */

/* Fills out with bytes [b0, b0+n) of tensor t (b0, n multiples of the element size). */
static void gen_bytes(const stensor *t, size_t b0, size_t n, unsigned char *out) {
    const uint64_t seed = t->seed;
    switch (t->kind) {
    case G_CODES: {
        uint32_t *w = (uint32_t *)out;
        for (size_t i = 0; i < n / 4; i++) {
            uint64_t h = mix64(seed ^ (uint64_t)(b0 / 4 + i));
            uint32_t a = (uint32_t)h, b = (uint32_t)(h >> 32);
            w[i] = (a & 0x55555555u) | ((~a & b & 0x55555555u) << 1); /* q = 1 (p 1/2), 0 or 2 (p 1/4 each) */
        }
        break;
    }
    case G_SCALES:
    case G_BIASES: {
        uint16_t *h = (uint16_t *)out;
        const float base = sqrtf(2.0f / (float)t->in);
        for (size_t i = 0; i < n / 2; i++) {
            float s = base * (0.75f + 0.5f * unit(mix64(seed ^ (uint64_t)(b0 / 2 + i))));
            h[i] = f16_bits(t->kind == G_SCALES ? s : -s);
        }
        break;
    }
    case G_SIGNS: {
        float *f = (float *)out;
        for (size_t i = 0; i < n / 4; i++) f[i] = (mix64(seed ^ (uint64_t)(b0 / 4 + i)) >> 63) ? 1.0f : -1.0f;
        break;
    }
    case G_F16:
    case G_BF16: {
        uint16_t *h = (uint16_t *)out;
        for (size_t i = 0; i < n / 2; i++) {
            float v = t->center + t->spread * (2.0f * unit(mix64(seed ^ (uint64_t)(b0 / 2 + i))) - 1.0f);
            h[i] = t->kind == G_F16 ? f16_bits(v) : bf16_bits(v);
        }
        break;
    }
    case G_F32: {
        float *f = (float *)out;
        for (size_t i = 0; i < n / 4; i++)
            f[i] = t->center + t->spread * (2.0f * unit(mix64(seed ^ (uint64_t)(b0 / 4 + i))) - 1.0f);
        break;
    }
    }
}

#define TASK_BYTES ((size_t)64 << 20)

typedef struct wtask {
    const stensor *t;
    size_t b0, n;
} wtask;

typedef struct wctx {
    int fd;
    size_t data_start;
    wtask *tasks;
    int failed_errno;
    pthread_mutex_t mu;
    size_t done;
} wctx;

static void write_task(void *vctx, int task, int n_tasks, int worker) {
    (void)n_tasks;
    (void)worker;
    wctx *c = vctx;
    const wtask *w = &c->tasks[task];
    unsigned char *buf = malloc(w->n ? w->n : 1);
    int e = 0;
    if (!buf) {
        e = ENOMEM;
    } else {
        gen_bytes(w->t, w->b0, w->n, buf);
        size_t off = 0;
        while (off < w->n) {
            ssize_t k = pwrite(c->fd, buf + off, w->n - off, (off_t)(c->data_start + w->t->offset + w->b0 + off));
            if (k <= 0) {
                e = k < 0 ? errno : EIO;
                break;
            }
            off += (size_t)k;
        }
    }
    free(buf);
    pthread_mutex_lock(&c->mu);
    if (e && !c->failed_errno) c->failed_errno = e;
    c->done += w->n;
    pthread_mutex_unlock(&c->mu);
}

/* Writes tensors l as a safetensors file at path. */
static df_status write_safetensors(const char *path, tlist *l, df_pool *pool, const df_synth_options *o,
                                   df_error *err) {
    size_t off = 0;
    json_t *hdr = json_object();
    if (!hdr) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < l->n; i++) {
        stensor *t = &l->t[i];
        t->offset = off;
        off += t->bytes;
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++) json_array_append_new(shape, json_integer(t->shape[d]));
        json_t *e = json_pack("{s:s, s:o, s:[I, I]}", "dtype", t->dtype, "shape", shape, "data_offsets",
                              (json_int_t)t->offset, (json_int_t)(t->offset + t->bytes));
        if (!e || json_object_set_new(hdr, t->name, e) != 0) {
            json_decref(hdr);
            return df_error_set(err, DF_ERR_NOMEM, "out of memory");
        }
    }
    json_object_set_new(hdr, "__metadata__", json_pack("{s:s}", "format", "mlx"));
    char *text = json_dumps(hdr, JSON_COMPACT);
    json_decref(hdr);
    if (!text) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    size_t hlen = strlen(text), padded = (hlen + 7) / 8 * 8;
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
    if (fd < 0) {
        free(text);
        return df_error_set(err, DF_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    char *hbuf = malloc(padded);
    int ok = hbuf != NULL;
    if (ok) {
        memcpy(hbuf, text, hlen);
        memset(hbuf + hlen, ' ', padded - hlen);
        ok = pwrite(fd, len8, 8, 0) == 8 && pwrite(fd, hbuf, padded, 8) == (ssize_t)padded;
    }
    free(hbuf);
    free(text);
    if (!ok) {
        close(fd);
        return df_error_set(err, DF_ERR_IO, "%s: write failed: %s", path, strerror(errno));
    }
    /* tasks */
    size_t nt = 0;
    for (size_t i = 0; i < l->n; i++) nt += (l->t[i].bytes + TASK_BYTES - 1) / TASK_BYTES;
    wtask *tasks = calloc(nt ? nt : 1, sizeof *tasks);
    if (!tasks) {
        close(fd);
        return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    }
    size_t k = 0;
    for (size_t i = 0; i < l->n; i++)
        for (size_t b = 0; b < l->t[i].bytes; b += TASK_BYTES) {
            tasks[k].t = &l->t[i];
            tasks[k].b0 = b;
            tasks[k].n = l->t[i].bytes - b < TASK_BYTES ? l->t[i].bytes - b : TASK_BYTES;
            k++;
        }
    wctx c = {.fd = fd, .data_start = 8 + padded, .tasks = tasks};
    pthread_mutex_init(&c.mu, NULL);
    /* in batches so that progress can be reported */
    const int batch = 4 * df_pool_size(pool);
    for (size_t t0 = 0; t0 < nt && !c.failed_errno; t0 += (size_t)batch) {
        int n = nt - t0 < (size_t)batch ? (int)(nt - t0) : batch;
        c.tasks = tasks + t0;
        df_pool_run(pool, n, write_task, &c);
        if (o->progress) o->progress(o->progress_user, path, (double)c.done, (double)off);
    }
    pthread_mutex_destroy(&c.mu);
    free(tasks);
    int e = c.failed_errno;
    if (close(fd) != 0 && !e) e = errno;
    if (e) return df_error_set(err, DF_ERR_IO, "%s: write failed: %s", path, strerror(e));
    return DF_OK;
}

/* ---- config files --------------------------------------------------------------------------- */

static df_status write_json(const char *path, json_t *j, df_error *err) {
    if (!j) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    int rc = json_dump_file(j, path, JSON_INDENT(2));
    json_decref(j);
    if (rc != 0) return df_error_set(err, DF_ERR_IO, "%s: cannot write", path);
    return DF_OK;
}

static json_t *target_config(const synth_shape *s) {
    json_t *types = json_array(), *mods = json_array();
    for (int i = 0; i < s->layers; i++)
        json_array_append_new(types, json_string((i + 1) % 4 == 0 ? "full_attention" : "linear_attention"));
    char p[160];
#define MOD(path, emb)                                                                                                 \
    json_array_append_new(mods, json_pack("{s:s, s:i, s:b, s:s}", "path", path, "block", s->hadamard, "embedding",   \
                                          emb, "dtype", "float16"))
    for (int i = 0; i < s->layers; i++) {
        const char *names[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                               "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"};
        const int full = (i + 1) % 4 == 0;
        for (int k = 0; k < 10; k++) {
            if ((k < 4) != full && k < 7) continue;
            snprintf(p, sizeof p, "model.layers.%d.%s", i, names[k]);
            MOD(p, 0);
        }
    }
    MOD("lm_head", 0);
    MOD("model.embed_tokens", 1);
#undef MOD
    json_t *text = json_pack(
        "{s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:i, s:b, s:s, s:b, s:o, s:[i,i], s:s,"
        " s:o, s:f, s:b}",
        "vocab_size", s->vocab, "hidden_size", s->hidden, "intermediate_size", s->intermediate, "num_hidden_layers",
        s->layers, "num_attention_heads", s->heads, "num_key_value_heads", s->kv_heads, "head_dim", s->head_dim,
        "linear_num_key_heads", s->lin_k_heads, "linear_num_value_heads", s->lin_v_heads, "linear_key_head_dim",
        s->lin_k_dim, "linear_value_head_dim", s->lin_v_dim, "rms_norm_eps", 1e-6, "max_position_embeddings",
        s->max_pos, "tie_word_embeddings", 0, "hidden_act", "silu", "attention_bias", 0, "rope_parameters",
        json_pack("{s:s, s:f, s:f, s:[i,i,i], s:b}", "rope_type", "default", "rope_theta", 1e7,
                  "partial_rotary_factor", 0.25, "mrope_section", s->mrope[0], s->mrope[1], s->mrope[2],
                  "mrope_interleaved", 1),
        "eos_token_id", s->eos[0], s->eos[1], "model_type", "qwen3_5_text", "layer_types", types,
        "partial_rotary_factor", 0.25, "attn_output_gate", 1);
    json_object_set_new(text, "linear_conv_kernel_dim", json_integer(s->conv_k));
    return json_pack("{s:[s], s:s, s:o, s:b, s:[i,i], s:i, s:s, s:s, s:s, s:{s:i, s:i, s:s}, s:o}", "architectures",
                     "Qwen3_5ForConditionalGeneration", "model_type", "prism_hadamard_qwen35", "text_config", text,
                     "tie_word_embeddings", 0, "eos_token_id", s->eos[0], s->eos[1], "schema_version", 2,
                     "base_model_type", "qwen3_5", "tensor_namespace", "mlx-vlm-qwen3_5", "gdn_activation_layout",
                     "grouped", "quantization", "bits", 2, "group_size", 128, "mode", "affine", "modules", mods);
}

static json_t *drafter_config(const synth_shape *s) {
    json_t *taps = json_array(), *types = json_array();
    for (int i = 0; i < s->d_n_taps; i++) json_array_append_new(taps, json_integer(s->d_taps[i]));
    for (int i = 0; i < s->d_layers; i++) json_array_append_new(types, json_string("full_attention"));
    return json_pack("{s:[s], s:s, s:i, s:{s:i, s:o}, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:o, s:f, s:f, s:i, s:i,"
                     " s:b, s:s}",
                     "architectures", "DFlashDraftModel", "model_type", "qwen3", "block_size", s->d_block,
                     "dflash_config", "mask_token_id", s->d_mask, "target_layer_ids", taps, "hidden_size", s->hidden,
                     "intermediate_size", s->d_intermediate, "num_hidden_layers", s->d_layers, "num_attention_heads",
                     s->d_heads, "num_key_value_heads", s->d_kv_heads, "head_dim", s->d_head_dim, "num_target_layers",
                     s->layers, "layer_types", types, "rope_theta", 1e7, "rms_norm_eps", 1e-6,
                     "max_position_embeddings", s->max_pos, "vocab_size", s->vocab, "tie_word_embeddings", 0,
                     "hidden_act", "silu");
}

static df_status copy_file(const char *src, const char *dst, int optional, df_error *err) {
    FILE *in = fopen(src, "rb");
    if (!in) {
        if (optional) return DF_OK;
        return df_error_set(err, DF_ERR_IO, "%s: cannot open: %s", src, strerror(errno));
    }
    FILE *out = fopen(dst, "wb");
    if (!out) {
        fclose(in);
        return df_error_set(err, DF_ERR_IO, "%s: cannot create: %s", dst, strerror(errno));
    }
    char buf[1 << 16];
    size_t n;
    int ok = 1;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) ok = 0;
    if (ferror(in)) ok = 0;
    fclose(in);
    if (fclose(out) != 0) ok = 0;
    return ok ? DF_OK : df_error_set(err, DF_ERR_IO, "copying %s to %s failed", src, dst);
}

static df_status make_dir(const char *d, df_error *err) {
    if (mkdir(d, 0755) != 0 && errno != EEXIST)
        return df_error_set(err, DF_ERR_IO, "%s: cannot create the folder: %s", d, strerror(errno));
    struct stat sb;
    if (stat(d, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return df_error_set(err, DF_ERR_IO, "%s: not a folder (the output must be a new or empty folder)", d);
    return DF_OK;
}

df_status df_synth_pack(const df_synth_options *o, df_error *err) {
    if (!o || !o->out_dir || !o->out_dir[0]) return df_error_set(err, DF_ERR_INVALID_ARG, "synth: no output folder");
    const synth_shape *s;
    const char *preset = o->preset ? o->preset : "27b";
    if (strcmp(preset, "27b") == 0) s = &SHAPE_27B;
    else if (strcmp(preset, "tiny") == 0) s = &SHAPE_TINY;
    else return df_error_set(err, DF_ERR_INVALID_ARG, "synth: unknown config \"%s\" (expected 27b or tiny)", preset);
    const char *tokdir = o->tokenizer_dir ? o->tokenizer_dir : "models/demo";
    char path[4096], src[4096];
    /* never overwrite a pack (or the tokenizer folder the files are copied from) */
    static const char *const pack_files[] = {"config.json", "model.safetensors", "model.safetensors.index.json",
                                             "tokenizer.json"};
    for (size_t i = 0; i < sizeof pack_files / sizeof pack_files[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", o->out_dir, pack_files[i]);
        if (access(path, F_OK) == 0)
            return df_error_set(err, DF_ERR_INVALID_ARG,
                                "synth: %s already exists; the output folder must be new or hold no pack files (a pack, or "
                                "the part of one an interrupted run left: delete it or choose another folder)",
                                path);
    }
    snprintf(src, sizeof src, "%s/tokenizer.json", tokdir);
    if (access(src, R_OK) != 0)
        return df_error_set(err, DF_ERR_IO, "synth: %s: %s (give the folder of a tokenizer.json with --tokenizer)", src,
                            strerror(errno));
    { /* the tokenizer is copied as it is: it must load, and its ids fit the pack's vocabulary */
        df_tokenizer *tok = NULL;
        df_status ts = df_tokenizer_load(&tok, src, err);
        const int32_t n = ts == DF_OK ? df_tokenizer_vocab_size(tok) : 0;
        df_tokenizer_free(tok);
        if (ts != DF_OK) return df_error_prefix(err, "synth: --tokenizer");
        if (n > s->vocab)
            return df_error_set(err, DF_ERR_INVALID_ARG,
                                "synth: %s has ids up to %d; the %s pack's vocabulary has %d (give a tokenizer with at "
                                "most that many ids)",
                                src, n - 1, preset, s->vocab);
    }
    df_status st = make_dir(o->out_dir, err);
    if (st != DF_OK) return st;
    df_pool *pool = NULL;
    st = df_pool_init(&pool, o->n_threads > 0 ? o->n_threads : df_cpu_count(), err);
    if (st != DF_OK) return st;
    tlist l = {0};
    snprintf(path, sizeof path, "%s/config.json", o->out_dir);
    st = write_json(path, target_config(s), err);
    if (st == DF_OK) {
        snprintf(src, sizeof src, "%s/tokenizer.json", tokdir);
        snprintf(path, sizeof path, "%s/tokenizer.json", o->out_dir);
        st = copy_file(src, path, 0, err);
    }
    if (st == DF_OK) {
        snprintf(src, sizeof src, "%s/tokenizer_config.json", tokdir);
        snprintf(path, sizeof path, "%s/tokenizer_config.json", o->out_dir);
        st = copy_file(src, path, 1, err);
    }
    if (st == DF_OK) {
        snprintf(src, sizeof src, "%s/chat_template.jinja", tokdir);
        snprintf(path, sizeof path, "%s/chat_template.jinja", o->out_dir);
        st = copy_file(src, path, 1, err);
    }
    if (st == DF_OK) {
        if (!target_tensors(&l, s, o->seed)) st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
        snprintf(path, sizeof path, "%s/model.safetensors", o->out_dir);
        if (st == DF_OK) st = write_safetensors(path, &l, pool, o, err);
    }
    if (st == DF_OK && o->drafter) {
        snprintf(path, sizeof path, "%s/drafter", o->out_dir);
        st = make_dir(path, err);
        if (st == DF_OK) {
            snprintf(path, sizeof path, "%s/drafter/config.json", o->out_dir);
            st = write_json(path, drafter_config(s), err);
        }
        l.n = 0;
        if (st == DF_OK && !drafter_tensors(&l, s, o->seed + 1)) st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
        snprintf(path, sizeof path, "%s/drafter/model.safetensors", o->out_dir);
        if (st == DF_OK) st = write_safetensors(path, &l, pool, o, err);
    }
    free(l.t);
    df_pool_free(pool);
    return st;
}
