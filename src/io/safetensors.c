/* safetensors files, memory-mapped and validated (see include/dflash/safetensors.h).
 *
 * Layout of one file: u64le N | N bytes of JSON header | data region. Every tensor entry
 * is checked before the set is handed out: known dtype, non-negative shape whose product
 * times the dtype size equals end - begin (with overflow checks), begin <= end <= the data
 * region's size, no two tensors overlapping, no duplicate names (within a file through
 * jansson's duplicate-key check, across shards through the name table).
 *
 * A tensor whose address in the mapping is not aligned to its element size (possible
 * when a writer did not pad the header to 8 bytes) gets an aligned private copy, so that
 * callers may read it through typed pointers.
 */
#include "dflash/safetensors.h"

#include "core/files.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io_internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "dflash reads little-endian safetensors data in place: big-endian hosts are not supported"
#endif

/* Largest header accepted (the reference implementation's limit is 100 MB). */
#define ST_MAX_HEADER ((uint64_t)100 << 20)

typedef struct st_file {
    char *path;
    int fd;
    uint8_t *map;          /* whole file, read-only */
    size_t size;           /* file size in bytes */
    size_t data_off;       /* 8 + header length */
} st_file;

struct df_tensor_set {
    st_file *files;
    int n_files;
    df_tensor *tensors;
    size_t n_tensors, cap_tensors;
    void **copies;         /* aligned private copies (see file comment) */
    size_t n_copies;
    size_t *table;         /* open addressing: tensor index + 1, 0 = empty */
    size_t table_size;     /* power of two */
    char *format;          /* __metadata__.format of the first file */
};

/* ---- dtypes and conversions ------------------------------------------------------- */

size_t df_dtype_size(df_dtype t) {
    switch (t) {
    case DF_DTYPE_F32: case DF_DTYPE_U32: case DF_DTYPE_I32: return 4;
    case DF_DTYPE_F16: case DF_DTYPE_BF16: return 2;
    case DF_DTYPE_U8: return 1;
    case DF_DTYPE_I64: return 8;
    case DF_DTYPE_INVALID: break;
    }
    return 0;
}

const char *df_dtype_name(df_dtype t) {
    switch (t) {
    case DF_DTYPE_F32: return "F32";
    case DF_DTYPE_F16: return "F16";
    case DF_DTYPE_BF16: return "BF16";
    case DF_DTYPE_U32: return "U32";
    case DF_DTYPE_I32: return "I32";
    case DF_DTYPE_U8: return "U8";
    case DF_DTYPE_I64: return "I64";
    case DF_DTYPE_INVALID: break;
    }
    return "INVALID";
}

static df_dtype dtype_parse(const char *s) {
    for (int t = DF_DTYPE_F32; t <= DF_DTYPE_I64; t++)
        if (strcmp(s, df_dtype_name((df_dtype)t)) == 0) return (df_dtype)t;
    return DF_DTYPE_INVALID;
}

/* dtypes of the safetensors format that dflash does not read. */
static int dtype_is_other_known(const char *s) {
    static const char *const other[] = {"F64", "I8", "I16", "U16", "U64", "BOOL",
                                        "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3",
                                        "F6_E3M2", "C64"};
    for (size_t i = 0; i < sizeof other / sizeof other[0]; i++)
        if (strcmp(s, other[i]) == 0) return 1;
    return 0;
}

float df_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);          /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13); /* normal: rebias 15 -> 127 */
    } else if (man == 0) {
        bits = sign;                                       /* zero */
    } else {                                               /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t df_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t exp = (x >> 23) & 0xffu, man = x & 0x7fffffu;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00u); /* overflow -> inf */
    if (e <= 0) {
        /* subnormal or zero: shift the full mantissa (with the implicit 1) into place */
        if (e < -10) return sign;
        uint32_t m = man | 0x800000u;
        int shift = 14 - e;                 /* 13 + (1 - e) */
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t q = ((uint32_t)e << 10) | (man >> 13), rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++; /* may carry into inf: correct */
    return (uint16_t)(sign | q);
}

float df_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- the name table --------------------------------------------------------------- */

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;                 /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* Builds the table; on a duplicate name stores its two indices in *dup_a and *dup_b and
 * returns DF_ERR_FORMAT (the caller words the message). */
static df_status table_build(df_tensor_set *s, size_t *dup_a, size_t *dup_b) {
    size_t size = 16;
    while (size < 2 * s->n_tensors) size *= 2;
    free(s->table);
    s->table = calloc(size, sizeof *s->table);
    if (!s->table) return DF_ERR_NOMEM;
    s->table_size = size;
    for (size_t i = 0; i < s->n_tensors; i++) {
        size_t j = (size_t)name_hash(s->tensors[i].name) & (size - 1);
        while (s->table[j]) {
            size_t k = s->table[j] - 1;
            if (strcmp(s->tensors[k].name, s->tensors[i].name) == 0) {
                *dup_a = k;
                *dup_b = i;
                return DF_ERR_FORMAT;
            }
            j = (j + 1) & (size - 1);
        }
        s->table[j] = i + 1;
    }
    return DF_OK;
}

df_tensor *df_tensors_find(df_tensor_set *set, const char *name) {
    if (!set || !name || !set->table) return NULL;
    size_t j = (size_t)name_hash(name) & (set->table_size - 1);
    while (set->table[j]) {
        df_tensor *t = &set->tensors[set->table[j] - 1];
        if (strcmp(t->name, name) == 0) return t;
        j = (j + 1) & (set->table_size - 1);
    }
    return NULL;
}

df_tensor *df_tensors_take(df_tensor_set *set, const char *name) {
    df_tensor *t = df_tensors_find(set, name);
    if (t) t->used = 1;
    return t;
}

size_t df_tensors_count(const df_tensor_set *set) { return set ? set->n_tensors : 0; }

df_tensor *df_tensors_at(df_tensor_set *set, size_t i) {
    return (set && i < set->n_tensors) ? &set->tensors[i] : NULL;
}

const char *df_tensors_format(const df_tensor_set *set) { return set ? set->format : NULL; }

const char *df_tensors_file_path(const df_tensor_set *set, int file_index) {
    if (!set || file_index < 0 || file_index >= set->n_files) return "?";
    return set->files[file_index].path;
}

int df_tensors_file_count(const df_tensor_set *set) { return set ? set->n_files : 0; }

const void *df_tensors_file_map(const df_tensor_set *set, int file_index, size_t *bytes) {
    *bytes = 0;
    if (!set || file_index < 0 || file_index >= set->n_files) return NULL;
    *bytes = set->files[file_index].size;
    return set->files[file_index].map;
}

void df_tensors_free(df_tensor_set *set) {
    if (!set) return;
    for (int i = 0; i < set->n_files; i++) {
        if (set->files[i].map) munmap(set->files[i].map, set->files[i].size);
        if (set->files[i].fd >= 0) close(set->files[i].fd);
        free(set->files[i].path);
    }
    for (size_t i = 0; i < set->n_tensors; i++) free((char *)set->tensors[i].name);
    for (size_t i = 0; i < set->n_copies; i++) free(set->copies[i]);
    free(set->copies);
    free(set->files);
    free(set->tensors);
    free(set->table);
    free(set->format);
    free(set);
}

/* ---- one file --------------------------------------------------------------------- */

/* Offsets are kept while parsing a header, to check overlaps. */
typedef struct st_span {
    uint64_t begin, end;
    size_t tensor;         /* index into set->tensors */
} st_span;

static int span_cmp(const void *a, const void *b) {
    const st_span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

static df_status set_push_tensor(df_tensor_set *s, df_tensor **out) {
    if (s->n_tensors == s->cap_tensors) {
        size_t cap = s->cap_tensors ? 2 * s->cap_tensors : 64;
        df_tensor *t = realloc(s->tensors, cap * sizeof *t);
        if (!t) return DF_ERR_NOMEM;
        s->tensors = t;
        s->cap_tensors = cap;
    }
    *out = &s->tensors[s->n_tensors++];
    memset(*out, 0, sizeof **out);
    return DF_OK;
}

/* Parses one tensor entry of a header into t (name already set). Offsets to *span. */
static df_status parse_entry(const char *path, const char *name, json_t *v, df_tensor *t,
                             st_span *span, df_error *err) {
    if (!json_is_object(v))
        return df_error_set(err, DF_ERR_FORMAT, "%s: tensor %s: header entry is not an object",
                            path, name);
    json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"),
           *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd))
        return df_error_set(err, DF_ERR_FORMAT, "%s: tensor %s: missing or non-string \"dtype\"",
                            path, name);
    const char *ds = json_string_value(jd);
    t->dtype = dtype_parse(ds);
    if (t->dtype == DF_DTYPE_INVALID) {
        if (dtype_is_other_known(ds))
            return df_error_set(err, DF_ERR_FORMAT,
                                "%s: tensor %s: unsupported dtype \"%s\" (dflash reads F32, F16, "
                                "BF16, U32, I32, U8, I64)", path, name, ds);
        return df_error_set(err, DF_ERR_FORMAT, "%s: tensor %s: unknown dtype \"%.32s\"", path,
                            name, ds);
    }
    if (!json_is_array(js))
        return df_error_set(err, DF_ERR_FORMAT, "%s: tensor %s: missing or non-array \"shape\"",
                            path, name);
    size_t nd = json_array_size(js);
    if (nd > DF_TENSOR_MAX_DIMS)
        return df_error_set(err, DF_ERR_FORMAT, "%s: tensor %s: %zu dimensions (at most %d)",
                            path, name, nd, DF_TENSOR_MAX_DIMS);
    t->ndim = (int)nd;
    uint64_t numel = 1;
    int overflow = 0;
    for (size_t d = 0; d < nd; d++) {
        json_t *e = json_array_get(js, d);
        if (!json_is_integer(e) || json_integer_value(e) < 0)
            return df_error_set(err, DF_ERR_FORMAT,
                                "%s: tensor %s: shape[%zu] is not a non-negative integer", path,
                                name, d);
        uint64_t dim = (uint64_t)json_integer_value(e);
        t->shape[d] = (int64_t)dim;
        if (dim && numel > (UINT64_MAX >> 4) / dim) overflow = 1;
        else numel *= dim;
    }
    if (overflow)
        return df_error_set(err, DF_ERR_FORMAT, "%s: tensor %s: shape product overflows", path,
                            name);
    t->numel = (int64_t)numel;
    if (!json_is_array(jo) || json_array_size(jo) != 2 ||
        !json_is_integer(json_array_get(jo, 0)) || !json_is_integer(json_array_get(jo, 1)))
        return df_error_set(err, DF_ERR_FORMAT,
                            "%s: tensor %s: \"data_offsets\" must be [begin, end] integers", path,
                            name);
    json_int_t b = json_integer_value(json_array_get(jo, 0));
    json_int_t e = json_integer_value(json_array_get(jo, 1));
    if (b < 0 || e < b)
        return df_error_set(err, DF_ERR_FORMAT,
                            "%s: tensor %s: bad data_offsets [%lld, %lld] (need 0 <= begin <= end)",
                            path, name, (long long)b, (long long)e);
    uint64_t want = numel * df_dtype_size(t->dtype);
    if ((uint64_t)(e - b) != want)
        return df_error_set(err, DF_ERR_FORMAT,
                            "%s: tensor %s: data_offsets [%lld, %lld] hold %llu bytes but shape "
                            "and dtype %s need %llu", path, name, (long long)b, (long long)e,
                            (unsigned long long)(e - b), ds, (unsigned long long)want);
    span->begin = (uint64_t)b;
    span->end = (uint64_t)e;
    t->nbytes = (size_t)want;
    return DF_OK;
}

/* Words a jansson error: for a duplicate key, names the key (the last string before the
 * error position). */
static df_status header_json_error(const char *path, const char *hdr, size_t n,
                                   const json_error_t *je, df_error *err) {
    if (json_error_code(je) == json_error_duplicate_key) {
        size_t pos = (size_t)je->position < n ? (size_t)je->position : n;
        /* the key ends at the last '"' before pos; find its opening quote */
        size_t end = pos;
        while (end > 0 && hdr[end - 1] != '"') end--;
        size_t beg = end > 0 ? end - 1 : 0;
        while (beg > 0 && hdr[beg - 1] != '"') beg--;
        int len = end > beg + 1 ? (int)(end - 1 - beg) : 0;
        if (len > 200) len = 200;
        return df_error_set(err, DF_ERR_FORMAT, "%s: duplicate tensor name \"%.*s\" in header",
                            path, len, hdr + beg);
    }
    return df_error_set(err, DF_ERR_FORMAT, "%s: header is not valid JSON: %s (byte %d)", path,
                        je->text, je->position);
}

/* Validates a parsed header and appends its tensors to s as file file_index. */
static df_status add_header(df_tensor_set *s, int file_index, json_t *root, df_error *err) {
    st_file *f = &s->files[file_index];
    const char *path = f->path;
    uint64_t data_len = f->size - f->data_off;
    if (!json_is_object(root))
        return df_error_set(err, DF_ERR_FORMAT, "%s: header is not a JSON object", path);
    json_t *meta = json_object_get(root, "__metadata__");
    if (meta) {
        if (!json_is_object(meta))
            return df_error_set(err, DF_ERR_FORMAT, "%s: __metadata__ is not an object", path);
        json_t *fmt = json_object_get(meta, "format");
        if (file_index == 0 && json_is_string(fmt) && !s->format) {
            s->format = strdup(json_string_value(fmt));
            if (!s->format) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
        }
    }
    size_t n = json_object_size(root) - (meta ? 1 : 0);
    st_span *spans = calloc(n ? n : 1, sizeof *spans);
    if (!spans) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    size_t k = 0;
    df_status st = DF_OK;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0) continue;
        df_tensor *t;
        if ((st = set_push_tensor(s, &t)) != DF_OK) {
            df_error_set(err, st, "out of memory");
            break;
        }
        t->name = strdup(key);
        t->file_index = file_index;
        if (!t->name) {
            st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
            break;
        }
        if ((st = parse_entry(path, key, v, t, &spans[k], err)) != DF_OK) break;
        spans[k].tensor = s->n_tensors - 1;
        k++;
    }
    if (st == DF_OK) {
        qsort(spans, k, sizeof *spans, span_cmp);
        /* overlaps first (a lying header), then the end of the data region */
        const st_span *prev = NULL;
        for (size_t i = 0; i < k && st == DF_OK; i++) {
            if (spans[i].begin == spans[i].end) continue; /* empty tensors overlap nothing */
            if (prev && spans[i].begin < prev->end)
                st = df_error_set(err, DF_ERR_FORMAT,
                                  "%s: tensors %s [%llu, %llu) and %s [%llu, %llu) overlap", path,
                                  s->tensors[prev->tensor].name,
                                  (unsigned long long)prev->begin, (unsigned long long)prev->end,
                                  s->tensors[spans[i].tensor].name,
                                  (unsigned long long)spans[i].begin,
                                  (unsigned long long)spans[i].end);
            prev = &spans[i];
        }
        if (st == DF_OK && prev && prev->end > data_len) {
            /* Contiguous data that runs past the end is a truncated file; a tensor
             * beyond a gap is a header that lies about its offsets. */
            int contiguous = 1;
            uint64_t at = 0;
            for (size_t i = 0; i < k; i++) {
                if (spans[i].begin == spans[i].end) continue;
                if (spans[i].begin != at) contiguous = 0;
                at = spans[i].end;
            }
            const st_span *cut = NULL;
            for (size_t i = 0; i < k && !cut; i++)
                if (spans[i].end > data_len) cut = &spans[i];
            if (contiguous)
                st = df_error_set(err, DF_ERR_FORMAT,
                                  "%s: file truncated: the header describes %llu bytes of tensor "
                                  "data but the file holds %llu (tensor %s is cut)", path,
                                  (unsigned long long)prev->end, (unsigned long long)data_len,
                                  s->tensors[cut->tensor].name);
            else
                st = df_error_set(err, DF_ERR_FORMAT,
                                  "%s: tensor %s: data_offsets [%llu, %llu] past the end of the "
                                  "data region (%llu bytes)", path, s->tensors[cut->tensor].name,
                                  (unsigned long long)cut->begin, (unsigned long long)cut->end,
                                  (unsigned long long)data_len);
        }
    }
    for (size_t i = 0; i < k && st == DF_OK; i++) {
        df_tensor *t = &s->tensors[spans[i].tensor];
        const uint8_t *p = f->map + f->data_off + spans[i].begin;
        size_t al = df_dtype_size(t->dtype);
        if (t->nbytes && ((uintptr_t)p % al) != 0) {
            void **c = realloc(s->copies, (s->n_copies + 1) * sizeof *c);
            if (!c) {
                st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
                break;
            }
            s->copies = c;
            void *copy = aligned_alloc(16, (t->nbytes + 15) & ~(size_t)15);
            if (!copy) {
                st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
                break;
            }
            memcpy(copy, p, t->nbytes);
            s->copies[s->n_copies++] = copy;
            p = copy;
        }
        t->data = p;
    }
    free(spans);
    return st;
}

/* Maps path and appends its tensors to s. */
static df_status add_file(df_tensor_set *s, const char *path, df_error *err) {
    st_file *fs = realloc(s->files, (size_t)(s->n_files + 1) * sizeof *fs);
    if (!fs) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    s->files = fs;
    st_file *f = &s->files[s->n_files];
    memset(f, 0, sizeof *f);
    f->fd = -1;
    f->path = strdup(path);
    if (!f->path) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    int index = s->n_files++;

    f->fd = df_open_regular(path, err);
    if (f->fd < 0) return err ? err->code : DF_ERR_IO;
    struct stat sb;
    if (fstat(f->fd, &sb) != 0)
        return df_error_set(err, DF_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    if (sb.st_size < 8)
        return df_error_set(err, DF_ERR_FORMAT,
                            "%s: file truncated: %lld bytes, too short for the 8-byte header "
                            "length", path, (long long)sb.st_size);
    f->size = (size_t)sb.st_size;
    void *m = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, f->fd, 0);
    if (m == MAP_FAILED)
        return df_error_set(err, DF_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
    f->map = m;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f->map[i];
    if (hlen > f->size - 8)
        return df_error_set(err, DF_ERR_FORMAT,
                            "%s: header length %llu exceeds the file size (%zu bytes): "
                            "truncated or not a safetensors file", path,
                            (unsigned long long)hlen, f->size);
    if (hlen > ST_MAX_HEADER)
        return df_error_set(err, DF_ERR_FORMAT, "%s: header length %llu exceeds the %llu-byte limit",
                            path, (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER);
    f->data_off = 8 + (size_t)hlen;
    const char *hdr = (const char *)f->map + 8;
    json_error_t je;
    json_t *root = json_loadb(hdr, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root) return header_json_error(path, hdr, (size_t)hlen, &je, err);
    df_status st = add_header(s, index, root, err);
    json_decref(root);
    return st;
}

/* Builds the name table; a name in two files is an error naming both. */
static df_status finish_set(df_tensor_set *s, df_error *err) {
    size_t a = 0, b = 0;
    df_status st = table_build(s, &a, &b);
    if (st == DF_ERR_NOMEM) return df_error_set(err, st, "out of memory");
    if (st != DF_OK)
        return df_error_set(err, DF_ERR_FORMAT, "tensor %s is present in two files: %s and %s",
                            s->tensors[a].name, s->files[s->tensors[a].file_index].path,
                            s->files[s->tensors[b].file_index].path);
    return DF_OK;
}

df_status df_tensors_open_file(df_tensor_set **out, const char *path, df_error *err) {
    *out = NULL;
    df_tensor_set *s = calloc(1, sizeof *s);
    if (!s) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    df_status st = add_file(s, path, err);
    if (st == DF_OK) st = finish_set(s, err);
    if (st != DF_OK) {
        df_tensors_free(s);
        return st;
    }
    *out = s;
    return DF_OK;
}

/* ---- a folder: index or single file ----------------------------------------------- */

static int shard_name_ok(const char *n) {
    if (!*n || n[0] == '/') return 0;
    for (const char *p = n; *p; p++)
        if (p[0] == '.' && p[1] == '.' && (p == n || p[-1] == '/') && (p[2] == '/' || !p[2]))
            return 0;
    return 1;
}

static df_status open_index(df_tensor_set **out, const char *dir, const char *index_path,
                            df_error *err) {
    json_error_t je;
    FILE *jf = df_fopen_regular(index_path, err);
    if (!jf) return err ? err->code : DF_ERR_IO;
    json_t *root = json_loadf(jf, JSON_REJECT_DUPLICATES, &je);
    fclose(jf);
    if (!root)
        return df_error_set(err, DF_ERR_FORMAT, "%s: not valid JSON: %s (line %d)", index_path,
                            je.text, je.line);
    df_status st = DF_OK;
    df_tensor_set *s = NULL;
    char **shards = NULL;        /* unique shard names, in order of first appearance */
    size_t n_shards = 0;
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm) || json_object_size(wm) == 0) {
        st = df_error_set(err, DF_ERR_FORMAT, "%s: missing or empty \"weight_map\" object",
                          index_path);
        goto done;
    }
    shards = calloc(json_object_size(wm), sizeof *shards);
    s = calloc(1, sizeof *s);
    if (!shards || !s) {
        st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
        goto done;
    }
    const char *key;
    json_t *v;
    json_object_foreach(wm, key, v) {
        if (!json_is_string(v) || !shard_name_ok(json_string_value(v))) {
            st = df_error_set(err, DF_ERR_FORMAT,
                              "%s: weight_map entry for tensor %s is not a file name in the folder",
                              index_path, key);
            goto done;
        }
        const char *f = json_string_value(v);
        size_t i = 0;
        while (i < n_shards && strcmp(shards[i], f) != 0) i++;
        if (i == n_shards) shards[n_shards++] = (char *)f;
    }
    for (size_t i = 0; i < n_shards; i++) {
        char *p = df_path_join(dir, shards[i]);
        if (!p) {
            st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
            goto done;
        }
        if (access(p, F_OK) != 0) {
            st = df_error_set(err, DF_ERR_IO, "%s: names shard %s, which does not exist (%s)",
                              index_path, shards[i], strerror(errno));
            free(p);
            goto done;
        }
        st = add_file(s, p, err);
        free(p);
        if (st != DF_OK) goto done;
    }
    if ((st = finish_set(s, err)) != DF_OK) goto done;
    /* every tensor the index names is in the shard it names, and nothing else is there */
    json_object_foreach(wm, key, v) {
        const char *want = json_string_value(v);
        df_tensor *t = df_tensors_find(s, key);
        if (!t) {
            st = df_error_set(err, DF_ERR_FORMAT,
                              "%s: tensor %s is mapped to shard %s but is not in it", index_path,
                              key, want);
            goto done;
        }
        size_t want_file = 0;
        while (strcmp(shards[want_file], want) != 0) want_file++; /* present: built above */
        if ((size_t)t->file_index != want_file) {
            st = df_error_set(err, DF_ERR_FORMAT,
                              "%s: tensor %s is mapped to shard %s but is in %s", index_path, key,
                              want, s->files[t->file_index].path);
            goto done;
        }
    }
    for (size_t i = 0; i < s->n_tensors; i++)
        if (!json_object_get(wm, s->tensors[i].name)) {
            st = df_error_set(err, DF_ERR_FORMAT, "%s: tensor %s in %s is not listed in the index",
                              index_path, s->tensors[i].name, s->files[s->tensors[i].file_index].path);
            goto done;
        }
done:
    free(shards);
    json_decref(root);
    if (st != DF_OK) {
        df_tensors_free(s);
        return st;
    }
    *out = s;
    return DF_OK;
}

static int has_suffix(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

df_status df_tensors_open_dir(df_tensor_set **out, const char *dir, df_error *err) {
    *out = NULL;
    char *index = df_path_join(dir, "model.safetensors.index.json");
    char *single = df_path_join(dir, "model.safetensors");
    df_status st;
    if (!index || !single) {
        st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
    } else if (access(index, F_OK) == 0) {
        st = open_index(out, dir, index, err);
    } else if (access(single, F_OK) == 0) {
        st = df_tensors_open_file(out, single, err);
    } else {
        DIR *d = opendir(dir);
        if (!d) {
            st = df_error_set(err, DF_ERR_IO, "%s: cannot open folder: %s", dir, strerror(errno));
        } else {
            char *found = NULL;
            int n = 0;
            struct dirent *e;
            while ((e = readdir(d)) != NULL)
                if (has_suffix(e->d_name, ".safetensors") && n++ == 0) found = strdup(e->d_name);
            closedir(d);
            if (n == 0)
                st = df_error_set(err, DF_ERR_IO, "%s: no model.safetensors, index or *.safetensors file",
                                  dir);
            else if (n > 1)
                st = df_error_set(err, DF_ERR_FORMAT,
                                  "%s: %d *.safetensors files but no model.safetensors.index.json",
                                  dir, n);
            else if (!found)
                st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
            else {
                char *p = df_path_join(dir, found);
                st = p ? df_tensors_open_file(out, p, err) : df_error_set(err, DF_ERR_NOMEM, "out of memory");
                free(p);
            }
            free(found);
        }
    }
    free(index);
    free(single);
    return st;
}
