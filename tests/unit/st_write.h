/* Test helpers: safetensors files and packs built or edited in memory, written to a temp
 * folder (for the loader's positive and error tests). Header-only (static inline) so that
 * each test executable takes what it uses. Test code: aborts the test on I/O failure. */
#ifndef DFLASH_TEST_ST_WRITE_H
#define DFLASH_TEST_ST_WRITE_H

#include <ftw.h>
#include <sys/stat.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "support.h"

typedef struct tw_tensor {
    char *name;
    char dtype[16];
    int ndim;
    int64_t shape[8];
    uint8_t *data;
    size_t nbytes;
} tw_tensor;

/* One safetensors file in memory: tensors in data order. */
typedef struct tw_file {
    tw_tensor *t;
    size_t n, cap;
} tw_file;

static inline size_t tw_dtype_size(const char *d) {
    if (!strcmp(d, "F16") || !strcmp(d, "BF16")) return 2;
    if (!strcmp(d, "U8")) return 1;
    if (!strcmp(d, "I64") || !strcmp(d, "F64")) return 8;
    return 4;
}

static inline tw_tensor *tw_find(tw_file *f, const char *name) {
    for (size_t i = 0; i < f->n; i++)
        if (!strcmp(f->t[i].name, name)) return &f->t[i];
    return NULL;
}

/* As tw_find; a missing tensor fails the test. */
static inline tw_tensor *tw_get(tw_file *f, const char *name) {
    tw_tensor *t = tw_find(f, name);
    if (!t) {
        fail_msg("no tensor %s", name);
        abort();
    }
    return t;
}

/* Appends a tensor (data copied, or zero-filled when data is NULL). */
static inline tw_tensor *tw_add(tw_file *f, const char *name, const char *dtype, int ndim,
                                const int64_t *shape, const void *data) {
    if (f->n == f->cap) {
        f->cap = f->cap ? 2 * f->cap : 64;
        f->t = realloc(f->t, f->cap * sizeof *f->t);
        assert_non_null(f->t);
    }
    tw_tensor *t = &f->t[f->n++];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    snprintf(t->dtype, sizeof t->dtype, "%s", dtype);
    t->ndim = ndim;
    size_t numel = 1;
    for (int i = 0; i < ndim; i++) numel *= (size_t)(t->shape[i] = shape[i]);
    t->nbytes = numel * tw_dtype_size(dtype);
    t->data = calloc(t->nbytes ? t->nbytes : 1, 1);
    assert_non_null(t->data);
    if (data) memcpy(t->data, data, t->nbytes);
    return t;
}

/* Replaces a tensor's dtype and shape (data zero-filled to the new size). */
static inline void tw_retype(tw_tensor *t, const char *dtype, int ndim, const int64_t *shape) {
    snprintf(t->dtype, sizeof t->dtype, "%s", dtype);
    t->ndim = ndim;
    size_t numel = 1;
    for (int i = 0; i < ndim; i++) numel *= (size_t)(t->shape[i] = shape[i]);
    free(t->data);
    t->nbytes = numel * tw_dtype_size(dtype);
    t->data = calloc(t->nbytes ? t->nbytes : 1, 1);
}

static inline void tw_remove(tw_file *f, const char *name) {
    tw_tensor *t = tw_get(f, name);
    free(t->name);
    free(t->data);
    size_t i = (size_t)(t - f->t);
    memmove(t, t + 1, (f->n - i - 1) * sizeof *t);
    f->n--;
}

static inline void tw_free(tw_file *f) {
    for (size_t i = 0; i < f->n; i++) {
        free(f->t[i].name);
        free(f->t[i].data);
    }
    free(f->t);
    memset(f, 0, sizeof *f);
}

typedef struct tw_span {
    size_t begin;
    json_t *v;
    const char *k;
} tw_span;

static inline int tw_span_cmp(const void *a, const void *b) {
    const tw_span *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Reads a (trusted) safetensors file into f, tensors in data order. */
static inline void tw_read(tw_file *f, const char *path) {
    memset(f, 0, sizeof *f);
    size_t len = 0;
    uint8_t *buf = (uint8_t *)tu_read_file(path, &len);
    assert_non_null(buf);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | buf[i];
    json_t *h = json_loadb((const char *)buf + 8, (size_t)n, 0, NULL);
    assert_non_null(h);
    tw_span *sp = calloc(json_object_size(h), sizeof *sp);
    size_t k = 0;
    const char *key;
    json_t *v;
    json_object_foreach(h, key, v) {
        if (!strcmp(key, "__metadata__")) continue;
        sp[k].begin = (size_t)json_integer_value(json_array_get(json_object_get(v, "data_offsets"), 0));
        sp[k].v = v;
        sp[k++].k = key;
    }
    qsort(sp, k, sizeof *sp, tw_span_cmp);
    for (size_t i = 0; i < k; i++) {
        json_t *sh = json_object_get(sp[i].v, "shape");
        int64_t shape[8];
        int nd = (int)json_array_size(sh);
        for (int d = 0; d < nd; d++) shape[d] = json_integer_value(json_array_get(sh, (size_t)d));
        tw_add(f, sp[i].k, json_string_value(json_object_get(sp[i].v, "dtype")), nd, shape,
               buf + 8 + n + sp[i].begin);
    }
    free(sp);
    json_decref(h);
    free(buf);
}

/* The header object of f (contiguous offsets in tensor order) and its data blob. */
static inline json_t *tw_header(const tw_file *f, uint8_t **data, size_t *len) {
    json_t *h = json_object();
    json_object_set_new(h, "__metadata__", json_pack("{ss}", "format", "mlx"));
    size_t total = 0;
    for (size_t i = 0; i < f->n; i++) total += f->t[i].nbytes;
    *data = malloc(total ? total : 1);
    size_t at = 0;
    for (size_t i = 0; i < f->n; i++) {
        const tw_tensor *t = &f->t[i];
        json_t *sh = json_array();
        for (int d = 0; d < t->ndim; d++) json_array_append_new(sh, json_integer(t->shape[d]));
        json_object_set_new(h, t->name,
                            json_pack("{ss so s[II]}", "dtype", t->dtype, "shape", sh,
                                      "data_offsets", (json_int_t)at,
                                      (json_int_t)(at + t->nbytes)));
        memcpy(*data + at, t->data, t->nbytes);
        at += t->nbytes;
    }
    *len = total;
    return h;
}

/* Writes u64 header length | header text (padded with spaces to pad bytes) | data. */
static inline void tw_save_raw(const char *path, const char *hdr, size_t pad, const void *data,
                               size_t len) {
    size_t hl = strlen(hdr);
    size_t hp = pad > 1 ? (hl + pad - 1) / pad * pad : hl;
    uint8_t *out = malloc(8 + hp + len + 1);
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)((uint64_t)hp >> (8 * i));
    memcpy(out + 8, hdr, hl);
    memset(out + 8 + hl, ' ', hp - hl);
    if (len) memcpy(out + 8 + hp, data, len);
    assert_int_equal(tu_write_file(path, out, 8 + hp + len), 0);
    free(out);
}

static inline void tw_save_json(const char *path, json_t *hdr, const void *data, size_t len) {
    char *s = json_dumps(hdr, JSON_COMPACT);
    tw_save_raw(path, s, 8, data, len);
    free(s);
}

static inline void tw_save(const tw_file *f, const char *path) {
    uint8_t *data;
    size_t len;
    json_t *h = tw_header(f, &data, &len);
    tw_save_json(path, h, data, len);
    json_decref(h);
    free(data);
}

/* "dir/name" in a static buffer (one of four, rotating). */
static inline const char *tw_path(const char *dir, const char *name) {
    static char buf[4][4096];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

static inline void tw_copy(const char *src, const char *dst) {
    size_t len;
    char *d = tu_read_file(src, &len);
    assert_non_null(d);
    assert_int_equal(tu_write_file(dst, d, len), 0);
    free(d);
}

static inline json_t *tw_load_json(const char *path) {
    json_t *j = json_load_file(path, 0, NULL);
    assert_non_null(j);
    return j;
}

static inline void tw_write_json(const char *path, json_t *j) {
    assert_int_equal(json_dump_file(j, path, JSON_INDENT(1)), 0);
}

static inline int tw_rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

/* Removes a temp folder and everything in it. */
static inline void tw_rm_rf(const char *dir) {
    if (strncmp(dir, "/tmp/dflash-test-", 17) == 0) nftw(dir, tw_rm_one, 8, FTW_DEPTH | FTW_PHYS);
}

/* The test group's temp folder (tw_setup / tw_teardown as cmocka group fixtures). */
static char tw_dir[256];

static inline int tw_setup(void **state) {
    (void)state;
    snprintf(tw_dir, sizeof tw_dir, "%s", tu_tmpdir());
    return 0;
}

static inline int tw_teardown(void **state) {
    (void)state;
    tw_rm_rf(tw_dir);
    return 0;
}

/* A fresh numbered subfolder of base (static buffer). */
static inline const char *tw_subdir(const char *base) {
    static char buf[1024];
    static int n;
    snprintf(buf, sizeof buf, "%s/p%03d", base, ++n);
    assert_int_equal(mkdir(buf, 0700), 0);
    return buf;
}

/* Copies a pack's config.json, generation_config.json and model.safetensors. */
static inline void tw_pack_copy(const char *src, const char *dst) {
    static const char *const files[] = {"config.json", "generation_config.json",
                                        "model.safetensors"};
    for (int i = 0; i < 3; i++) tw_copy(tw_path(src, files[i]), tw_path(dst, files[i]));
}

/* Splits the tiny pack's tensors at index cut into two shards with an index; the index
 * maps tensor `misplace` (if any) to the other shard. */
static inline void tw_pack_shard(const char *d, size_t cut, const char *misplace, const char *shard2) {
    tw_file all, a = {0}, b = {0};
    tw_read(&all, tw_path(d, "model.safetensors"));
    assert_int_equal(remove(tw_path(d, "model.safetensors")), 0);
    json_t *wm = json_object();
    for (size_t i = 0; i < all.n; i++) {
        tw_tensor *t = &all.t[i];
        tw_add(i < cut ? &a : &b, t->name, t->dtype, t->ndim, t->shape, t->data);
        int second = i >= cut;
        if (misplace && !strcmp(t->name, misplace)) second = !second;
        json_object_set_new(wm, t->name,
                            json_string(second ? shard2 : "model-00001-of-00002.safetensors"));
    }
    tw_save(&a, tw_path(d, "model-00001-of-00002.safetensors"));
    tw_save(&b, tw_path(d, "model-00002-of-00002.safetensors"));
    json_t *ix = json_pack("{s{si}so}", "metadata", "total_size", 0, "weight_map", wm);
    tw_write_json(tw_path(d, "model.safetensors.index.json"), ix);
    json_decref(ix);
    tw_free(&all);
    tw_free(&a);
    tw_free(&b);
}

#endif
