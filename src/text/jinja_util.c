/* Small text utilities of the Jinja2 engine: growable buffer, arena, UTF-8, and Python's
 * repr() / json.dumps() formatting (the facts are from CPython's float_repr_style 'short'
 * and json.encoder; the code is ours). */
#include "text/jinja_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- jbuf ----------------------------------------------------------------------------- */

static int jbuf_reserve(jbuf *b, size_t extra) {
    if (extra > SIZE_MAX / 2 - b->n) return -1;
    size_t need = b->n + extra + 1;
    if (b->limit && b->n + extra > b->limit) {
        b->over_limit = 1;
        return -1;
    }
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

int jbuf_put(jbuf *b, const char *s, size_t n) {
    if (jbuf_reserve(b, n)) return -1;
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

int jbuf_putc(jbuf *b, char c) { return jbuf_put(b, &c, 1); }

int jbuf_puts(jbuf *b, const char *s) { return jbuf_put(b, s, strlen(s)); }

int jbuf_printf(jbuf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0) return -1;
    if ((size_t)k < sizeof tmp) return jbuf_put(b, tmp, (size_t)k);
    if (jbuf_reserve(b, (size_t)k)) return -1;
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t)k + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)k;
    return 0;
}

void jbuf_free(jbuf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

char *jbuf_take(jbuf *b, size_t *len) {
    if (!b->p) {
        if (jbuf_reserve(b, 0)) return NULL;
        b->p[0] = 0;
    }
    char *p = b->p;
    if (len) *len = b->n;
    b->p = NULL;
    b->n = b->cap = 0;
    return p;
}

/* ---- arena ---------------------------------------------------------------------------- */

struct jarena_chunk {
    jarena_chunk *next;
    size_t used, cap;
    max_align_t data[];
};

void *jarena_alloc(jarena *a, size_t n) {
    n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    jarena_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 16384 ? n : 16384;
        c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
    }
    void *p = (char *)c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *jarena_strndup(jarena *a, const char *s, size_t n) {
    char *p = jarena_alloc(a, n + 1);
    if (p) {
        if (n) memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}

void jarena_free(jarena *a) {
    jarena_chunk *c = a->head;
    while (c) {
        jarena_chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
}

/* ---- UTF-8 ---------------------------------------------------------------------------- */

size_t ju8_len(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) k++;
    return k;
}

size_t ju8_offset(const char *s, size_t n, size_t i) {
    size_t k = 0;
    for (size_t b = 0; b < n; b++) {
        if (((unsigned char)s[b] & 0xC0) != 0x80) {
            if (k == i) return b;
            k++;
        }
    }
    return n;
}

int32_t ju8_decode(const char *s, size_t n, size_t *adv) {
    const unsigned char *u = (const unsigned char *)s;
    *adv = 1;
    if (n == 0) return 0;
    unsigned c = u[0];
    size_t len;
    int32_t cp;
    if (c < 0x80) return (int32_t)c;
    if ((c & 0xE0) == 0xC0) len = 2, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0) len = 3, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0) len = 4, cp = c & 0x07;
    else return (int32_t)c;
    if (len > n) return (int32_t)c;
    for (size_t i = 1; i < len; i++) {
        if ((u[i] & 0xC0) != 0x80) return (int32_t)c;
        cp = (cp << 6) | (u[i] & 0x3F);
    }
    *adv = len;
    return cp;
}

int ju8_put(jbuf *b, int32_t c) {
    char t[4];
    size_t n;
    if (c < 0 || c > 0x10FFFF) c = 0xFFFD;
    if (c < 0x80) t[0] = (char)c, n = 1;
    else if (c < 0x800) t[0] = (char)(0xC0 | (c >> 6)), t[1] = (char)(0x80 | (c & 0x3F)), n = 2;
    else if (c < 0x10000)
        t[0] = (char)(0xE0 | (c >> 12)), t[1] = (char)(0x80 | ((c >> 6) & 0x3F)), t[2] = (char)(0x80 | (c & 0x3F)),
        n = 3;
    else
        t[0] = (char)(0xF0 | (c >> 18)), t[1] = (char)(0x80 | ((c >> 12) & 0x3F)),
        t[2] = (char)(0x80 | ((c >> 6) & 0x3F)), t[3] = (char)(0x80 | (c & 0x3F)), n = 4;
    return jbuf_put(b, t, n);
}

size_t ju8_invalid_at(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned c = u[i];
        size_t len;
        unsigned cp;
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1F;
        else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0F;
        else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07;
        else return i;
        if (i + len > n) return i;
        for (size_t k = 1; k < len; k++) {
            if ((u[i + k] & 0xC0) != 0x80) return i;
            cp = (cp << 6) | (u[i + k] & 0x3F);
        }
        if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
            return i;
        i += len;
    }
    return n;
}

int ju8_sanitize(jbuf *b, const char *s, size_t n) {
    while (n > 0) {
        size_t ok = ju8_invalid_at(s, n);
        if (jbuf_put(b, s, ok)) return -1;
        if (ok == n) break;
        if (jbuf_put(b, "\xEF\xBF\xBD", 3)) return -1; /* U+FFFD for the bad byte */
        s += ok + 1;
        n -= ok + 1;
    }
    return 0;
}

int ju_isspace(int c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

/* ---- Python formatting ---------------------------------------------------------------- */

void jpy_float_repr(double d, char *buf) {
    if (isnan(d)) {
        strcpy(buf, "nan");
        return;
    }
    if (isinf(d)) {
        strcpy(buf, d < 0 ? "-inf" : "inf");
        return;
    }
    if (d == 0) {
        strcpy(buf, signbit(d) ? "-0.0" : "0.0");
        return;
    }
    /* Shortest precision that round-trips, then Python's layout: positional when the
     * decimal exponent is in [-4, 16), else d.ddde+XX. */
    char e[40];
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, d);
        if (strtod(e, NULL) == d) break;
    }
    /* e = [-]D[.DDD]e[+-]XX */
    const char *p = e;
    int neg = 0;
    if (*p == '-') neg = 1, p++;
    char digits[24];
    int nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char *o = buf;
    if (neg) *o++ = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            *o++ = '0';
            *o++ = '.';
            for (int i = 0; i < -exp10 - 1; i++) *o++ = '0';
            for (int i = 0; i < nd; i++) *o++ = digits[i];
        } else {
            for (int i = 0; i <= exp10; i++) *o++ = i < nd ? digits[i] : '0';
            *o++ = '.';
            if (nd > exp10 + 1)
                for (int i = exp10 + 1; i < nd; i++) *o++ = digits[i];
            else
                *o++ = '0';
        }
        *o = 0;
    } else {
        *o++ = digits[0];
        if (nd > 1) {
            *o++ = '.';
            for (int i = 1; i < nd; i++) *o++ = digits[i];
        }
        sprintf(o, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    }
}

int jpy_str_repr(jbuf *b, const char *s, size_t n) {
    int has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    if (jbuf_putc(b, q)) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        int r;
        if (c == (unsigned char)q || c == '\\') {
            char t[2] = {'\\', (char)c};
            r = jbuf_put(b, t, 2);
        } else if (c == '\n') r = jbuf_put(b, "\\n", 2);
        else if (c == '\r') r = jbuf_put(b, "\\r", 2);
        else if (c == '\t') r = jbuf_put(b, "\\t", 2);
        else if (c < 0x20 || c == 0x7F) r = jbuf_printf(b, "\\x%02x", c);
        else r = jbuf_putc(b, (char)c);
        if (r) return -1;
    }
    return jbuf_putc(b, q);
}

static int dump_json_string(jbuf *b, const char *s, size_t n, int ensure_ascii) {
    if (jbuf_putc(b, '"')) return -1;
    size_t run = 0; /* start of the pending run of bytes that need no escaping */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char tmp[16];
        size_t skip = 1;
        if (c == '"') esc = "\\\"";
        else if (c == '\\') esc = "\\\\";
        else if (c == '\n') esc = "\\n";
        else if (c == '\r') esc = "\\r";
        else if (c == '\t') esc = "\\t";
        else if (c == '\b') esc = "\\b";
        else if (c == '\f') esc = "\\f";
        else if (c < 0x20 || (ensure_ascii && c == 0x7F)) {
            snprintf(tmp, sizeof tmp, "\\u%04x", c);
            esc = tmp;
        } else if (ensure_ascii && c >= 0x80) {
            int32_t cp = ju8_decode(s + i, n - i, &skip);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(tmp, sizeof tmp, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                snprintf(tmp, sizeof tmp, "\\u%04x", (unsigned)cp);
            }
            esc = tmp;
        }
        if (esc) {
            if (jbuf_put(b, s + run, i - run) || jbuf_puts(b, esc)) return -1;
            i += skip - 1;
            run = i + 1;
        }
    }
    if (jbuf_put(b, s + run, n - run)) return -1;
    return jbuf_putc(b, '"');
}

static int dump_newline(jbuf *b, int indent, int depth) {
    if (jbuf_putc(b, '\n')) return -1;
    for (long i = 0; i < (long)indent * depth; i++)
        if (jbuf_putc(b, ' ')) return -1;
    return 0;
}

static int key_cmp(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

int jpy_dump_json(jbuf *b, const json_t *v, const jpy_json_opts *o, int depth) {
    char num[40];
    const char *isep = o->item_sep ? o->item_sep : o->indent >= 0 ? "," : ", ";
    const char *ksep = o->key_sep ? o->key_sep : ": ";
    if (depth > 10000) return -2;
    switch (json_typeof(v)) {
    case JSON_NULL: return jbuf_puts(b, "null");
    case JSON_TRUE: return jbuf_puts(b, "true");
    case JSON_FALSE: return jbuf_puts(b, "false");
    case JSON_INTEGER: return jbuf_printf(b, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    case JSON_REAL: {
        double d = json_real_value(v);
        if (isnan(d)) return jbuf_puts(b, "NaN");
        if (isinf(d)) return jbuf_puts(b, d < 0 ? "-Infinity" : "Infinity");
        jpy_float_repr(d, num);
        return jbuf_puts(b, num);
    }
    case JSON_STRING: return dump_json_string(b, json_string_value(v), json_string_length(v), o->ensure_ascii);
    case JSON_ARRAY: {
        size_t n = json_array_size(v);
        if (n == 0) return jbuf_puts(b, "[]");
        if (jbuf_putc(b, '[')) return -1;
        for (size_t i = 0; i < n; i++) {
            if (i && jbuf_puts(b, isep)) return -1;
            if (o->indent >= 0 && dump_newline(b, o->indent, depth + 1)) return -1;
            int r = jpy_dump_json(b, json_array_get(v, i), o, depth + 1);
            if (r) return r;
        }
        if (o->indent >= 0 && dump_newline(b, o->indent, depth)) return -1;
        return jbuf_putc(b, ']');
    }
    case JSON_OBJECT: {
        size_t n = json_object_size(v);
        if (n == 0) return jbuf_puts(b, "{}");
        const char **keys = malloc(n * sizeof *keys);
        if (!keys) return -1;
        size_t k = 0;
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)v, key, val) keys[k++] = key;
        if (o->sort_keys) qsort(keys, k, sizeof *keys, key_cmp);
        int r = jbuf_putc(b, '{');
        for (size_t i = 0; i < k && !r; i++) {
            if (i && jbuf_puts(b, isep)) r = -1;
            else if (o->indent >= 0 && dump_newline(b, o->indent, depth + 1)) r = -1;
            else if (dump_json_string(b, keys[i], strlen(keys[i]), o->ensure_ascii) || jbuf_puts(b, ksep)) r = -1;
            else r = jpy_dump_json(b, json_object_get(v, keys[i]), o, depth + 1);
        }
        free(keys);
        if (r) return r;
        if (o->indent >= 0 && dump_newline(b, o->indent, depth)) return -1;
        return jbuf_putc(b, '}');
    }
    }
    return -1;
}

df_status df_jinja_dump_json(const json_t *v, int indent, int sort_keys, char **out, size_t *out_len,
                             df_error *err) {
    jbuf b = {0};
    jpy_json_opts o = {.indent = indent, .sort_keys = sort_keys};
    *out = NULL;
    if (!v) return df_error_set(err, DF_ERR_INVALID_ARG, "JSON value is NULL");
    int r = jpy_dump_json(&b, v, &o, 0);
    if (r) {
        jbuf_free(&b);
        return r == -2 ? df_error_set(err, DF_ERR_RANGE, "JSON value nested too deeply")
                       : df_error_set(err, DF_ERR_NOMEM, "out of memory serialising JSON");
    }
    *out = jbuf_take(&b, out_len);
    if (!*out) return df_error_set(err, DF_ERR_NOMEM, "out of memory serialising JSON");
    return DF_OK;
}
