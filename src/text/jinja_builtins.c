/* Jinja2 built-ins: filters, tests, str/dict methods, loop.cycle and the globals
 * (range, namespace, dict, raise_exception, strftime_now). Semantics follow Jinja2 3.1's
 * filters.py / tests.py, Python's str methods, and transformers' tojson override. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <utf8proc.h>

#include "text/jinja_eval.h"

/* ---- arguments ------------------------------------------------------------------------ */

/* Matches a's arguments against the parameter names (in positional order). Fills got[i]
 * with the argument for names[i] or NULL. */
static df_status getargs(jctx *c, const jnode *n, const char *what, jargs *a, const char *const *names, int nnames,
                         const jv **got) {
    for (int i = 0; i < nnames; i++) got[i] = NULL;
    if (a->npos > nnames) return jerr(c, n, "%s takes at most %d argument(s) (%d given)", what, nnames, a->npos);
    for (int i = 0; i < a->npos; i++) got[i] = &a->pos[i];
    for (int k = 0; k < a->nkw; k++) {
        int found = -1;
        for (int i = 0; i < nnames; i++)
            if (!strcmp(a->kwn[k], names[i])) found = i;
        if (found < 0) return jerr(c, n, "%s got an unexpected keyword argument '%s'", what, a->kwn[k]);
        if (got[found]) return jerr(c, n, "%s got multiple values for argument '%s'", what, a->kwn[k]);
        got[found] = &a->kwv[k];
    }
    return DF_OK;
}

#define ARGS(what, ...)                                                                                                \
    static const char *const names_[] = {__VA_ARGS__};                                                                 \
    const jv *arg[sizeof names_ / sizeof names_[0]];                                                                   \
    df_status st_ = getargs(c, n, what, a, names_, (int)(sizeof names_ / sizeof names_[0]), arg);                      \
    if (st_) return st_

#define NOARGS(what)                                                                                                   \
    if (a->npos || a->nkw) return jerr(c, n, "%s takes no arguments", what)

static int given(const jv *v) { return v && v->k != JV_UNDEF && !(v->k == JV_JSON && json_is_null(v->j)); }

static df_status want_int(jctx *c, const jnode *n, const jv *v, const char *what, long long *out) {
    if (v->k == JV_JSON && json_is_integer(v->j)) {
        *out = json_integer_value(v->j);
        return DF_OK;
    }
    if (v->k == JV_JSON && json_is_boolean(v->j)) {
        *out = json_is_true(v->j);
        return DF_OK;
    }
    return jerr(c, n, "%s must be an integer, not '%s'", what, jv_type_name(v));
}

static df_status want_str(jctx *c, const jnode *n, const jv *v, const char *what, const char **s, size_t *len) {
    if (!jv_is_str(v)) return jerr(c, n, "%s must be a string, not '%s'", what, jv_type_name(v));
    *s = jv_str(v, len);
    return DF_OK;
}

/* str(v) into a fresh buffer */
static df_status to_str(jctx *c, const jnode *n, const jv *v, jbuf *b) {
    b->limit = c->max_output;
    if (jv_to_str(v, b)) {
        df_status st = jerr_build(c, n, b, 1);
        jbuf_free(b);
        return st;
    }
    return DF_OK;
}

static df_status ret_buf(jctx *c, jbuf *b, jv *out) {
    *out = jv_json(jstr_new(b->p, b->n));
    jbuf_free(b);
    return out->k == JV_JSON ? DF_OK : jerr_nomem(c);
}

static df_status ret_json(jctx *c, json_t *j, jv *out) {
    if (!j) return jerr_nomem(c);
    *out = jv_json(j);
    return DF_OK;
}

/* ---- string helpers ------------------------------------------------------------------- */

static int in_chars(int32_t cp, const char *chars, size_t nchars) {
    for (size_t i = 0; i < nchars;) {
        size_t adv;
        if (ju8_decode(chars + i, nchars - i, &adv) == cp) return 1;
        i += adv;
    }
    return 0;
}

static int py_isspace(int32_t cp) {
    return ju_isspace(cp) || (cp >= 0x1C && cp <= 0x1F) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

/* Python's str.strip/lstrip/rstrip: which = 1 left, 2 right, 3 both. */
static void strip_range(const char *s, size_t n, const char *chars, size_t nchars, int use_chars, int which,
                        size_t *b_out, size_t *e_out) {
    size_t b = 0, e = n;
    if (which & 1) {
        while (b < e) {
            size_t adv;
            int32_t cp = ju8_decode(s + b, e - b, &adv);
            if (use_chars ? !in_chars(cp, chars, nchars) : !py_isspace(cp)) break;
            b += adv;
        }
    }
    if (which & 2) {
        while (e > b) {
            size_t k = e - 1;
            while (k > b && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
            size_t adv;
            int32_t cp = ju8_decode(s + k, e - k, &adv);
            if (use_chars ? !in_chars(cp, chars, nchars) : !py_isspace(cp)) break;
            e = k;
        }
    }
    *b_out = b;
    *e_out = e;
}

/* mode: 0 lower, 1 upper, 2 capitalize, 3 title */
static int case_map(jbuf *b, const char *s, size_t n, int mode) {
    int word_start = 1;
    for (size_t i = 0; i < n;) {
        size_t adv;
        int32_t cp = ju8_decode(s + i, n - i, &adv);
        int32_t r;
        if (mode == 0) r = utf8proc_tolower(cp);
        else if (mode == 1) r = utf8proc_toupper(cp);
        else if (mode == 2) r = i == 0 ? utf8proc_toupper(cp) : utf8proc_tolower(cp);
        else {
            /* Jinja2's title: words start after whitespace, '-', '(', '{', '[', '<' */
            r = word_start ? utf8proc_toupper(cp) : utf8proc_tolower(cp);
            word_start = py_isspace(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
        }
        if (adv == 1 && (unsigned char)s[i] >= 0x80) r = (unsigned char)s[i]; /* invalid byte: keep */
        if (adv == 1 && (unsigned char)s[i] >= 0x80 ? jbuf_putc(b, s[i]) : ju8_put(b, r)) return -1;
        i += adv;
    }
    return 0;
}

static df_status str_replace(jctx *c, const jnode *n, const char *s, size_t sl, const char *old, size_t ol,
                             const char *nw, size_t nl, long long count, jv *out) {
    jbuf b = {.limit = c->max_output};
    long long done = 0;
    size_t i = 0;
    int r = 0;
    if (ol == 0) { /* Python inserts `new` before every character and at the end */
        while (!r && i <= sl) {
            if (count < 0 || done < count) {
                r = jbuf_put(&b, nw, nl);
                done++;
            }
            if (i == sl) break;
            size_t adv;
            ju8_decode(s + i, sl - i, &adv);
            r = r || jbuf_put(&b, s + i, adv);
            i += adv;
        }
        if (!r && i < sl) r = jbuf_put(&b, s + i, sl - i);
    } else {
        while (!r && i < sl) {
            const char *hit = (count < 0 || done < count) ? memmem(s + i, sl - i, old, ol) : NULL;
            if (!hit) {
                r = jbuf_put(&b, s + i, sl - i);
                break;
            }
            size_t at = (size_t)(hit - s);
            r = jbuf_put(&b, s + i, at - i) || jbuf_put(&b, nw, nl);
            i = at + ol;
            done++;
        }
    }
    if (r) {
        df_status st = jerr_build(c, n, &b, nl + 1);
        jbuf_free(&b);
        return st;
    }
    return ret_buf(c, &b, out);
}

/* Python's str.split / rsplit (sep NULL: runs of whitespace). */
static df_status str_split(jctx *c, const jnode *n, const char *s, size_t sl, const char *sep, size_t sepl,
                           long long maxsplit, int from_right, jv *out) {
    json_t *arr = json_array();
    if (!arr) return jerr_nomem(c);
    if (sep && sepl == 0) {
        json_decref(arr);
        return jerr(c, n, "empty separator");
    }
    int r = 0;
    long long splits = 0;
    if (!from_right || maxsplit < 0) {
        size_t i = 0;
        if (!sep) {
            for (;;) {
                while (i < sl && ju_isspace((unsigned char)s[i])) i++;
                if (i >= sl) break;
                size_t j = i;
                if (maxsplit >= 0 && splits >= maxsplit) {
                    size_t e = sl;
                    while (e > i && ju_isspace((unsigned char)s[e - 1])) e--;
                    r = json_array_append_new(arr, jstr_new(s + i, e - i));
                    break;
                }
                while (j < sl && !ju_isspace((unsigned char)s[j])) j++;
                r = json_array_append_new(arr, jstr_new(s + i, j - i));
                if (r) break;
                splits++;
                i = j;
            }
        } else {
            for (;;) {
                const char *hit = (maxsplit < 0 || splits < maxsplit) ? memmem(s + i, sl - i, sep, sepl) : NULL;
                size_t e = hit ? (size_t)(hit - s) : sl;
                r = json_array_append_new(arr, jstr_new(s + i, e - i));
                if (r || !hit) break;
                splits++;
                i = e + sepl;
            }
        }
    } else {
        /* rsplit with a limit: collect from the right, then reverse */
        size_t e = sl;
        if (!sep) {
            for (;;) {
                while (e > 0 && ju_isspace((unsigned char)s[e - 1])) e--;
                if (e == 0) break;
                if (splits >= maxsplit) {
                    size_t b = 0;
                    while (b < e && ju_isspace((unsigned char)s[b])) b++;
                    r = json_array_append_new(arr, jstr_new(s + b, e - b));
                    break;
                }
                size_t b = e;
                while (b > 0 && !ju_isspace((unsigned char)s[b - 1])) b--;
                r = json_array_append_new(arr, jstr_new(s + b, e - b));
                if (r) break;
                splits++;
                e = b;
            }
        } else {
            for (;;) {
                const char *hit = NULL;
                if (splits < maxsplit && e >= sepl)
                    for (size_t k = e - sepl + 1; k-- > 0;)
                        if (!memcmp(s + k, sep, sepl)) {
                            hit = s + k;
                            break;
                        }
                size_t b = hit ? (size_t)(hit - s) + sepl : 0;
                r = json_array_append_new(arr, jstr_new(s + b, e - b));
                if (r || !hit) break;
                splits++;
                e = (size_t)(hit - s);
            }
        }
        size_t k = json_array_size(arr);
        for (size_t i = 0; !r && i < k / 2; i++) {
            json_t *x = json_incref(json_array_get(arr, i)), *y = json_incref(json_array_get(arr, k - 1 - i));
            json_array_set_new(arr, i, y);
            json_array_set_new(arr, k - 1 - i, x);
        }
    }
    if (r) {
        json_decref(arr);
        return jerr_nomem(c);
    }
    *out = jv_json(arr);
    return jstep(c, n, json_array_size(arr));
}

/* s.replace(old, new[, count]) and s|replace(old, new[, count]) */
static df_status replace_call(jctx *c, const jnode *n, jargs *a, const char *s, size_t sl, jv *out) {
    ARGS("replace", "old", "new", "count");
    const char *o = NULL, *w = NULL;
    size_t ol = 0, wl = 0;
    long long count = -1;
    df_status st;
    if (!arg[0] || !arg[1]) return jerr(c, n, "replace expected at least 2 arguments");
    if ((st = want_str(c, n, arg[0], "replace old", &o, &ol)) || (st = want_str(c, n, arg[1], "replace new", &w, &wl)))
        return st;
    if (given(arg[2]) && (st = want_int(c, n, arg[2], "replace count", &count))) return st;
    return str_replace(c, n, s, sl, o, ol, w, wl, count, out);
}

static df_status join_items(jctx *c, const jnode *n, json_t *items, const char *sep, size_t sepl, const char *attr,
                            int strict_str, jv *out) {
    jbuf b = {.limit = c->max_output};
    df_status st = DF_OK;
    for (size_t i = 0; i < json_array_size(items) && !st; i++) {
        jv item = jv_json(json_incref(json_array_get(items, i))), v = {0};
        if (attr) st = jop_getattr(c, n, &item, attr, &v);
        else v = jv_copy(&item);
        if (!st && strict_str && !jv_is_str(&v))
            st = jerr(c, n, "sequence item %zu: expected str instance, %s found", i, jv_type_name(&v));
        if (!st && ((i && jbuf_put(&b, sep, sepl)) || jv_to_str(&v, &b))) st = jerr_build(c, n, &b, sepl + 1);
        jv_release(&item);
        jv_release(&v);
    }
    if (st) {
        jbuf_free(&b);
        return st;
    }
    return ret_buf(c, &b, out);
}

/* ---- sorting -------------------------------------------------------------------------- */

typedef struct sort_ctx {
    jctx *c;
    const jnode *n;
    df_status st;
} sort_ctx;

static int cmp_keys(sort_ctx *sc, json_t *a, json_t *b) {
    if (sc->st) return 0;
    jv x = jv_json(a), y = jv_json(b);
    int r = 0;
    sc->st = jop_compare(sc->c, sc->n, &x, &y, &r);
    return r;
}

/* Stable merge sort of idx[0..k) by keys[idx]. */
static void merge_sort(sort_ctx *sc, json_t **keys, size_t *idx, size_t *tmp, size_t k) {
    if (k < 2) return;
    size_t h = k / 2;
    merge_sort(sc, keys, idx, tmp, h);
    merge_sort(sc, keys, idx + h, tmp, k - h);
    size_t i = 0, j = h, o = 0;
    while (i < h && j < k) tmp[o++] = cmp_keys(sc, keys[idx[j]], keys[idx[i]]) < 0 ? idx[j++] : idx[i++];
    while (i < h) tmp[o++] = idx[i++];
    while (j < k) tmp[o++] = idx[j++];
    memcpy(idx, tmp, k * sizeof *idx);
}

/* The sort key of an item: item[attribute] (when attr), lower-cased when a string and not
 * case_sensitive. Returns a new reference. */
static df_status sort_key(jctx *c, const jnode *n, json_t *item, const char *attr, int case_sensitive, json_t **key) {
    jv v = jv_json(json_incref(item));
    if (attr) {
        jv w;
        df_status st = jop_getattr(c, n, &v, attr, &w);
        jv_release(&v);
        if (st) return st;
        v = w;
    }
    if (v.k != JV_JSON) {
        df_status st = v.k == JV_UNDEF ? jerr_undef(c, n, &v) : jerr(c, n, "cannot sort %s values", jv_type_name(&v));
        jv_release(&v);
        return st;
    }
    if (!case_sensitive && json_is_string(v.j)) {
        jbuf b = {0};
        if (case_map(&b, json_string_value(v.j), json_string_length(v.j), 0)) {
            jbuf_free(&b);
            jv_release(&v);
            return jerr_nomem(c);
        }
        jv_release(&v);
        *key = jstr_new(b.p, b.n);
        jbuf_free(&b);
        return *key ? DF_OK : jerr_nomem(c);
    }
    *key = v.j;
    return DF_OK;
}

/* Sorts items (by item[pair_index] when pair_index >= 0); returns a new array. */
static df_status sort_items(jctx *c, const jnode *n, json_t *items, const char *attr, int pair_index,
                            int case_sensitive, int reverse, json_t **out) {
    size_t k = json_array_size(items);
    json_t **keys = calloc(k + 1, sizeof *keys);
    size_t *idx = malloc((k + 1) * sizeof *idx), *tmp = malloc((k + 1) * sizeof *tmp);
    df_status st = (keys && idx && tmp) ? jstep(c, n, k * 8) : jerr_nomem(c);
    for (size_t i = 0; i < k && !st; i++) {
        idx[i] = i;
        json_t *item = json_array_get(items, i);
        if (pair_index >= 0) item = json_array_get(item, (size_t)pair_index);
        st = sort_key(c, n, item, attr, case_sensitive, &keys[i]);
    }
    if (!st) {
        sort_ctx sc = {c, n, DF_OK};
        merge_sort(&sc, keys, idx, tmp, k);
        st = sc.st;
    }
    json_t *r = st ? NULL : json_array();
    if (!st && !r) st = jerr_nomem(c);
    for (size_t i = 0; i < k && !st; i++)
        if (json_array_append(r, json_array_get(items, reverse ? idx[k - 1 - i] : idx[i]))) st = jerr_nomem(c);
    if (keys)
        for (size_t i = 0; i < k; i++) json_decref(keys[i]);
    free(keys);
    free(idx);
    free(tmp);
    if (st) {
        json_decref(r);
        return st;
    }
    *out = r;
    return DF_OK;
}

/* ---- filters -------------------------------------------------------------------------- */

static df_status f_tojson(jctx *c, const jnode *n, jv *val, jargs *a, jv *out) {
    ARGS("tojson", "ensure_ascii", "indent", "separators", "sort_keys");
    jpy_json_opts o = {.indent = -1};
    long long ind = 0;
    if (given(arg[0])) o.ensure_ascii = jv_truthy(arg[0]);
    if (given(arg[1])) {
        df_status st = want_int(c, n, arg[1], "tojson indent", &ind);
        if (st) return st;
        o.indent = ind < 0 ? 0 : ind > 64 ? 64 : (int)ind;
    }
    if (given(arg[2])) {
        const jv *sp = arg[2];
        if (!(sp->k == JV_JSON && json_is_array(sp->j) && json_array_size(sp->j) == 2 &&
              json_is_string(json_array_get(sp->j, 0)) && json_is_string(json_array_get(sp->j, 1))))
            return jerr(c, n, "tojson separators must be a pair of strings");
        o.item_sep = json_string_value(json_array_get(sp->j, 0));
        o.key_sep = json_string_value(json_array_get(sp->j, 1));
    }
    if (given(arg[3])) o.sort_keys = jv_truthy(arg[3]);
    json_t *j = jv_to_json(val, 0);
    if (!j) return jerr(c, n, "Object of type %s is not JSON serializable", jv_type_name(val));
    jbuf b = {.limit = c->max_output};
    int r = jpy_dump_json(&b, j, &o, 0);
    json_decref(j);
    if (r) {
        df_status st = r == -2 ? jerr(c, n, "value nested too deeply for tojson") : jerr_build(c, n, &b, 1);
        jbuf_free(&b);
        return st;
    }
    return ret_buf(c, &b, out);
}

static df_status f_length(jctx *c, const jnode *n, const jv *val, long long *len) {
    if (val->k == JV_UNDEF) *len = 0;
    else if (jv_is_str(val)) *len = (long long)ju8_len(json_string_value(val->j), json_string_length(val->j));
    else if (val->k == JV_JSON && json_is_array(val->j)) *len = (long long)json_array_size(val->j);
    else if (val->k == JV_JSON && json_is_object(val->j)) *len = (long long)json_object_size(val->j);
    else if (val->k == JV_NS) *len = ((jns *)val->p)->n;
    else return jerr(c, n, "object of type '%s' has no len()", jv_type_name(val));
    return DF_OK;
}

static df_status items_of(jctx *c, const jnode *n, const jv *val, json_t **out) {
    if (val->k == JV_UNDEF) {
        *out = json_array();
        return *out ? DF_OK : jerr_nomem(c);
    }
    if (!(val->k == JV_JSON && json_is_object(val->j))) return jerr(c, n, "Can only get item pairs from a mapping.");
    json_t *arr = json_array();
    const char *k;
    json_t *v;
    json_object_foreach(val->j, k, v) {
        if (!arr || json_array_append_new(arr, json_pack("[sO]", k, v))) {
            json_decref(arr);
            return jerr_nomem(c);
        }
    }
    if (!arr) return jerr_nomem(c);
    *out = arr;
    return jstep(c, n, json_array_size(arr));
}

static df_status f_first_last(jctx *c, const jnode *n, const jv *val, int last, jv *out) {
    json_t *items;
    df_status st = jop_iterate(c, n, val, &items);
    if (st) return st;
    size_t k = json_array_size(items);
    if (k == 0) *out = jv_undef(last ? "No last item, sequence was empty." : "No first item, sequence was empty.");
    else *out = jv_json(json_incref(json_array_get(items, last ? k - 1 : 0)));
    json_decref(items);
    return DF_OK;
}

static df_status f_int_float(jctx *c, const jnode *n, const jv *val, jargs *a, int to_float, jv *out) {
    ARGS(to_float ? "float" : "int", "default", "base");
    double d = 0;
    long long i = 0;
    int ok = 0;
    if (val->k == JV_JSON) {
        json_t *j = val->j;
        if (json_is_integer(j)) i = json_integer_value(j), d = (double)i, ok = 1;
        else if (json_is_boolean(j)) i = json_is_true(j), d = (double)i, ok = 1;
        else if (json_is_real(j)) {
            d = json_real_value(j);
            ok = isfinite(d) || to_float;
            if (ok && !to_float) i = d >= 9.2e18 ? INT64_MAX : d <= -9.2e18 ? INT64_MIN : (long long)d;
        } else if (json_is_string(j)) {
            char buf[128];
            size_t sl = json_string_length(j);
            if (sl < sizeof buf) {
                memcpy(buf, json_string_value(j), sl);
                buf[sl] = 0;
                char *p = buf;
                while (ju_isspace((unsigned char)*p)) p++;
                char *end;
                if (!to_float) {
                    long long base = 10;
                    if (given(arg[1]) && want_int(c, n, arg[1], "int base", &base)) return c->err->code;
                    if (base < 2 || base > 36) base = 10;
                    i = strtoll(p, &end, (int)base);
                    while (ju_isspace((unsigned char)*end)) end++;
                    if (end != p && !*end) ok = 1, d = (double)i;
                    else { /* Jinja2 falls back to int(float(value)) */
                        d = strtod(p, &end);
                        while (ju_isspace((unsigned char)*end)) end++;
                        if (end != p && !*end && isfinite(d)) ok = 1, i = (long long)d;
                    }
                } else {
                    d = strtod(p, &end);
                    while (ju_isspace((unsigned char)*end)) end++;
                    if (end != p && !*end) ok = 1;
                }
            }
        }
    }
    if (!ok) {
        if (arg[0]) {
            *out = jv_copy(arg[0]);
            return DF_OK;
        }
        return ret_json(c, to_float ? json_real(0.0) : json_integer(0), out);
    }
    return ret_json(c, to_float ? json_real(d) : json_integer(i), out);
}

/* map / select / reject / selectattr / rejectattr */
static df_status f_select(jctx *c, const jnode *n, const char *name, const jv *val, jargs *a, jv *out) {
    int by_attr = !strcmp(name, "selectattr") || !strcmp(name, "rejectattr");
    int reject = name[0] == 'r';
    int is_map = !strcmp(name, "map");
    const char *attr = NULL, *test = NULL;
    int first_extra = 0;
    const jv *default_v = NULL;
    if (is_map) {
        for (int k = 0; k < a->nkw; k++) {
            if (!strcmp(a->kwn[k], "attribute")) {
                if (!jv_is_str(&a->kwv[k])) return jerr(c, n, "map attribute must be a string");
                attr = json_string_value(a->kwv[k].j);
            } else if (!strcmp(a->kwn[k], "default")) {
                default_v = &a->kwv[k];
            } else if (!attr) {
                return jerr(c, n, "map got an unexpected keyword argument '%s'", a->kwn[k]);
            }
        }
        if (!attr) {
            if (a->npos < 1 || !jv_is_str(&a->pos[0])) return jerr(c, n, "map needs a filter name or attribute=");
            test = json_string_value(a->pos[0].j);
            first_extra = 1;
        }
    } else {
        if (by_attr) {
            if (a->npos < 1 || !jv_is_str(&a->pos[0])) return jerr(c, n, "%s needs an attribute name", name);
            attr = json_string_value(a->pos[0].j);
        }
        int ti = by_attr ? 1 : 0;
        if (a->npos > ti) {
            if (!jv_is_str(&a->pos[ti])) return jerr(c, n, "%s test name must be a string", name);
            test = json_string_value(a->pos[ti].j);
        }
        first_extra = ti + 1;
        if (a->nkw) return jerr(c, n, "%s got an unexpected keyword argument '%s'", name, a->kwn[0]);
    }
    json_t *items;
    df_status st = jop_iterate(c, n, val, &items);
    if (st) return st;
    json_t *res = json_array();
    if (!res) st = jerr_nomem(c);
    jargs extra = {0};
    if (first_extra < a->npos) {
        extra.pos = a->pos + first_extra;
        extra.npos = a->npos - first_extra;
    }
    if (is_map && test) {
        extra.kwn = a->kwn;
        extra.kwv = a->kwv;
        extra.nkw = a->nkw;
    }
    for (size_t i = 0; i < json_array_size(items) && !st; i++) {
        jv item = jv_json(json_incref(json_array_get(items, i))), sub = {0}, r = {0};
        if (attr) st = jop_getattr(c, n, &item, attr, &sub);
        else sub = jv_copy(&item);
        if (!st && is_map) {
            if (attr) {
                if (sub.k == JV_UNDEF && default_v) {
                    jv_release(&sub);
                    sub = jv_copy(default_v);
                }
                r = sub;
                memset(&sub, 0, sizeof sub);
            } else {
                st = jfilter(c, n, test, &sub, &extra, &r);
            }
            if (!st) {
                json_t *j = jv_to_json(&r, 1);
                if (!j) st = jerr(c, n, "map produced a %s", jv_type_name(&r));
                else if (json_array_append_new(res, j)) st = jerr_nomem(c);
            }
        } else if (!st) {
            int keep;
            if (test) st = jtest(c, n, test, &sub, &extra, &keep);
            else keep = jv_truthy(&sub);
            if (!st && keep != reject && json_array_append(res, item.j)) st = jerr_nomem(c);
        }
        jv_release(&item);
        jv_release(&sub);
        jv_release(&r);
    }
    json_decref(items);
    if (st) {
        json_decref(res);
        return st;
    }
    *out = jv_json(res);
    return DF_OK;
}

static int filter_index(const char *name);

df_status jfilter(jctx *c, const jnode *n, const char *name, jv *val, jargs *a, jv *out) {
    df_status st;
    jbuf b = {0};
    switch (filter_index(name)) {
    case 0: /* tojson */ return f_tojson(c, n, val, a, out);
    case 1: { /* trim */
        ARGS("trim", "chars");
        if ((st = to_str(c, n, val, &b))) return st;
        const char *chars = NULL;
        size_t nchars = 0, s, e;
        if (given(arg[0]) && (st = want_str(c, n, arg[0], "trim chars", &chars, &nchars))) {
            jbuf_free(&b);
            return st;
        }
        strip_range(b.p ? b.p : "", b.n, chars, nchars, chars != NULL, 3, &s, &e);
        *out = jv_json(jstr_new(b.p ? b.p + s : "", e - s));
        jbuf_free(&b);
        return out->k == JV_JSON ? DF_OK : jerr_nomem(c);
    }
    case 2: { /* items */
        NOARGS("items");
        json_t *arr;
        if ((st = items_of(c, n, val, &arr))) return st;
        *out = jv_json(arr);
        return DF_OK;
    }
    case 3:
    case 4: { /* length, count */
        NOARGS(name);
        long long len = 0;
        if ((st = f_length(c, n, val, &len))) return st;
        return ret_json(c, json_integer(len), out);
    }
    case 5: /* string */
        NOARGS("string");
        if (jv_is_str(val)) {
            *out = jv_copy(val);
            return DF_OK;
        }
        if ((st = to_str(c, n, val, &b))) return st;
        return ret_buf(c, &b, out);
    case 6: /* safe */
        NOARGS("safe");
        *out = jv_copy(val);
        return DF_OK;
    case 7:
    case 8:
    case 9:
    case 10: { /* lower, upper, capitalize, title */
        NOARGS(name);
        jbuf s = {0};
        if ((st = to_str(c, n, val, &s))) return st;
        int mode = name[0] == 'l' ? 0 : name[0] == 'u' ? 1 : name[0] == 'c' ? 2 : 3;
        b.limit = c->max_output * 2;
        int r = case_map(&b, s.p ? s.p : "", s.n, mode);
        jbuf_free(&s);
        if (r) {
            st = jerr_build(c, n, &b, 1);
            jbuf_free(&b);
            return st;
        }
        return ret_buf(c, &b, out);
    }
    case 11: /* replace */
        if ((st = to_str(c, n, val, &b))) return st;
        st = replace_call(c, n, a, b.p ? b.p : "", b.n, out);
        jbuf_free(&b);
        return st;
    case 12: { /* join */
        ARGS("join", "d", "attribute");
        const char *sep = "", *attr = NULL;
        size_t sepl = 0, al;
        if (given(arg[0]) && (st = want_str(c, n, arg[0], "join separator", &sep, &sepl))) return st;
        if (given(arg[1]) && (st = want_str(c, n, arg[1], "join attribute", &attr, &al))) return st;
        json_t *items;
        if ((st = jop_iterate(c, n, val, &items))) return st;
        st = join_items(c, n, items, sep, sepl, attr, 0, out);
        json_decref(items);
        return st;
    }
    case 13:
    case 14: /* first, last */
        NOARGS(name);
        return f_first_last(c, n, val, name[0] == 'l', out);
    case 15:
    case 16: { /* default, d */
        ARGS("default", "default_value", "boolean");
        int use_default = val->k == JV_UNDEF || (given(arg[1]) && jv_truthy(arg[1]) && !jv_truthy(val));
        if (use_default) {
            if (arg[0]) *out = jv_copy(arg[0]);
            else *out = jv_json(jstr_new("", 0));
        } else {
            *out = jv_copy(val);
        }
        return DF_OK;
    }
    case 17: return f_int_float(c, n, val, a, 0, out);
    case 18: return f_int_float(c, n, val, a, 1, out);
    case 19: { /* abs */
        NOARGS("abs");
        if (val->k == JV_JSON && json_is_integer(val->j)) {
            long long i = json_integer_value(val->j);
            return ret_json(c, i == INT64_MIN ? json_real(-(double)i) : json_integer(i < 0 ? -i : i), out);
        }
        if (val->k == JV_JSON && json_is_real(val->j)) return ret_json(c, json_real(fabs(json_real_value(val->j))), out);
        if (val->k == JV_JSON && json_is_boolean(val->j)) return ret_json(c, json_integer(json_is_true(val->j)), out);
        return jerr(c, n, "bad operand type for abs(): '%s'", jv_type_name(val));
    }
    case 20: { /* list */
        NOARGS("list");
        json_t *items;
        if ((st = jop_iterate(c, n, val, &items))) return st;
        json_t *copy = json_copy(items);
        json_decref(items);
        return ret_json(c, copy, out);
    }
    case 21: { /* reverse */
        NOARGS("reverse");
        if (jv_is_str(val)) {
            size_t sl;
            const char *s = jv_str(val, &sl);
            size_t e = sl;
            while (e > 0) {
                size_t k = e - 1;
                while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
                if (jbuf_put(&b, s + k, e - k)) {
                    const df_status bst = jerr_build(c, n, &b, e - k);
                    jbuf_free(&b);
                    return bst;
                }
                e = k;
            }
            return ret_buf(c, &b, out);
        }
        json_t *items;
        if ((st = jop_iterate(c, n, val, &items))) return st;
        json_t *r = json_array();
        for (size_t i = json_array_size(items); r && i-- > 0;)
            if (json_array_append(r, json_array_get(items, i))) {
                json_decref(r);
                r = NULL;
            }
        json_decref(items);
        return ret_json(c, r, out);
    }
    case 22:
    case 23: { /* unique, sort */
        int is_sort = name[0] == 's';
        const char *attr = NULL;
        size_t al;
        int cs = 0, rev = 0;
        if (is_sort) {
            ARGS("sort", "reverse", "case_sensitive", "attribute");
            rev = given(arg[0]) && jv_truthy(arg[0]);
            cs = given(arg[1]) && jv_truthy(arg[1]);
            if (given(arg[2]) && (st = want_str(c, n, arg[2], "sort attribute", &attr, &al))) return st;
        } else {
            ARGS("unique", "case_sensitive", "attribute");
            cs = given(arg[0]) && jv_truthy(arg[0]);
            if (given(arg[1]) && (st = want_str(c, n, arg[1], "unique attribute", &attr, &al))) return st;
        }
        json_t *items, *r = NULL;
        if ((st = jop_iterate(c, n, val, &items))) return st;
        if (is_sort) {
            st = sort_items(c, n, items, attr, -1, cs, rev, &r);
        } else {
            json_t *seen = json_array();
            r = json_array();
            if (!seen || !r) st = jerr_nomem(c);
            for (size_t i = 0; i < json_array_size(items) && !st; i++) {
                json_t *key;
                if ((st = sort_key(c, n, json_array_get(items, i), attr, cs, &key))) break;
                jv kv = jv_json(key);
                int dup = 0;
                for (size_t k = 0; k < json_array_size(seen) && !dup; k++) {
                    jv sv = jv_json(json_array_get(seen, k));
                    dup = jv_equal(&kv, &sv);
                }
                if ((st = jstep(c, n, json_array_size(seen)))) {
                    json_decref(key);
                    break;
                }
                if (!dup && (json_array_append_new(seen, key) || json_array_append(r, json_array_get(items, i))))
                    st = jerr_nomem(c);
                else if (dup)
                    json_decref(key);
            }
            json_decref(seen);
            if (st) {
                json_decref(r);
                r = NULL;
            }
        }
        json_decref(items);
        if (st) return st;
        *out = jv_json(r);
        return DF_OK;
    }
    case 24:
    case 25:
    case 26:
    case 27:
    case 28: return f_select(c, n, name, val, a, out);
    case 29: { /* dictsort */
        ARGS("dictsort", "case_sensitive", "by", "reverse");
        int by_value = 0;
        if (given(arg[1])) {
            const char *by = NULL;
            size_t bl = 0;
            if ((st = want_str(c, n, arg[1], "dictsort by", &by, &bl))) return st;
            if (!strcmp(by, "value")) by_value = 1;
            else if (strcmp(by, "key")) return jerr(c, n, "You can only sort by either \"key\" or \"value\"");
        }
        json_t *pairs, *r = NULL;
        if ((st = items_of(c, n, val, &pairs))) return st;
        st = sort_items(c, n, pairs, NULL, by_value, given(arg[0]) && jv_truthy(arg[0]),
                        given(arg[2]) && jv_truthy(arg[2]), &r);
        json_decref(pairs);
        if (st) return st;
        *out = jv_json(r);
        return DF_OK;
    }
    case 30:
    case 31: { /* min, max */
        ARGS(name, "case_sensitive", "attribute");
        const char *attr = NULL;
        size_t al;
        if (given(arg[1]) && (st = want_str(c, n, arg[1], "attribute", &attr, &al))) return st;
        json_t *items, *sorted;
        if ((st = jop_iterate(c, n, val, &items))) return st;
        st = sort_items(c, n, items, attr, -1, given(arg[0]) && jv_truthy(arg[0]), 0, &sorted);
        json_decref(items);
        if (st) return st;
        size_t k = json_array_size(sorted);
        if (!k) *out = jv_undef("No aggregated item, sequence was empty.");
        else *out = jv_json(json_incref(json_array_get(sorted, name[1] == 'i' ? 0 : k - 1)));
        json_decref(sorted);
        return DF_OK;
    }
    case 32: { /* sum */
        ARGS("sum", "attribute", "start");
        const char *attr = NULL;
        size_t al;
        if (given(arg[0]) && (st = want_str(c, n, arg[0], "sum attribute", &attr, &al))) return st;
        jv acc = arg[1] ? jv_copy(arg[1]) : jv_json(json_integer(0));
        json_t *items;
        if ((st = jop_iterate(c, n, val, &items))) {
            jv_release(&acc);
            return st;
        }
        for (size_t i = 0; i < json_array_size(items) && !st; i++) {
            jv item = jv_json(json_incref(json_array_get(items, i))), x = {0};
            if (attr) st = jop_getattr(c, n, &item, attr, &x);
            else x = jv_copy(&item);
            if (!st) {
                double da, dx;
                long long ia, ix;
                int ta, tx;
                if (acc.k != JV_JSON || x.k != JV_JSON || !(json_is_number(acc.j) || json_is_boolean(acc.j)) ||
                    !(json_is_number(x.j) || json_is_boolean(x.j))) {
                    st = jerr(c, n, "unsupported operand type(s) for +: '%s' and '%s'", jv_type_name(&acc),
                              jv_type_name(&x));
                } else {
                    ta = json_is_integer(acc.j) || json_is_boolean(acc.j);
                    tx = json_is_integer(x.j) || json_is_boolean(x.j);
                    ia = json_is_integer(acc.j) ? json_integer_value(acc.j) : json_is_true(acc.j);
                    ix = json_is_integer(x.j) ? json_integer_value(x.j) : json_is_true(x.j);
                    da = json_is_real(acc.j) ? json_real_value(acc.j) : (double)ia;
                    dx = json_is_real(x.j) ? json_real_value(x.j) : (double)ix;
                    long long r;
                    json_t *nv = (ta && tx && !__builtin_add_overflow(ia, ix, &r)) ? json_integer(r) : json_real(da + dx);
                    jv_release(&acc);
                    acc = jv_json(nv);
                    if (acc.k != JV_JSON) st = jerr_nomem(c);
                }
            }
            jv_release(&item);
            jv_release(&x);
        }
        json_decref(items);
        if (st) {
            jv_release(&acc);
            return st;
        }
        *out = acc;
        return DF_OK;
    }
    case 33: { /* round */
        ARGS("round", "precision", "method");
        long long prec = 0;
        if (given(arg[0]) && (st = want_int(c, n, arg[0], "round precision", &prec))) return st;
        const char *method = "common";
        size_t ml;
        if (given(arg[1]) && (st = want_str(c, n, arg[1], "round method", &method, &ml))) return st;
        if (!(val->k == JV_JSON && (json_is_number(val->j) || json_is_boolean(val->j))))
            return jerr(c, n, "round needs a number, not '%s'", jv_type_name(val));
        double d = json_is_real(val->j) ? json_real_value(val->j)
                   : json_is_integer(val->j) ? (double)json_integer_value(val->j)
                                             : json_is_true(val->j);
        if (prec > 15) prec = 15;
        if (prec < -15) prec = -15;
        double m = pow(10, (double)prec), x = d * m;
        if (!strcmp(method, "common")) x = rint(x);
        else if (!strcmp(method, "ceil")) x = ceil(x);
        else if (!strcmp(method, "floor")) x = floor(x);
        else return jerr(c, n, "method must be common, ceil or floor");
        return ret_json(c, json_real(x / m), out);
    }
    case 34: { /* wordcount */
        NOARGS("wordcount");
        if ((st = to_str(c, n, val, &b))) return st;
        long long words = 0;
        for (size_t i = 0; i < b.n;) {
            while (i < b.n && ju_isspace((unsigned char)b.p[i])) i++;
            if (i < b.n) words++;
            while (i < b.n && !ju_isspace((unsigned char)b.p[i])) i++;
        }
        jbuf_free(&b);
        return ret_json(c, json_integer(words), out);
    }
    case 35: { /* indent */
        ARGS("indent", "width", "first", "blank");
        long long width = 4;
        const char *ws = NULL;
        size_t wsl = 0;
        if (given(arg[0])) {
            if (jv_is_str(arg[0])) ws = jv_str(arg[0], &wsl);
            else if ((st = want_int(c, n, arg[0], "indent width", &width))) return st;
        }
        if (!ws) {
            if (width < 0) width = 0;
            if (width > 256) width = 256;
        }
        int first = given(arg[1]) && jv_truthy(arg[1]), blank = given(arg[2]) && jv_truthy(arg[2]);
        jbuf s = {0};
        if ((st = to_str(c, n, val, &s))) return st;
        b.limit = c->max_output;
        int r = 0;
        size_t i = 0, line = 0;
        while (!r && i <= s.n) {
            size_t e = i;
            while (e < s.n && s.p[e] != '\n') e++;
            int is_blank = 1;
            for (size_t k = i; k < e; k++)
                if (!ju_isspace((unsigned char)s.p[k])) is_blank = 0;
            if ((line > 0 || first) && (blank || !is_blank)) {
                if (ws) r = jbuf_put(&b, ws, wsl);
                else
                    for (long long k = 0; k < width && !r; k++) r = jbuf_putc(&b, ' ');
            }
            if (!r) r = jbuf_put(&b, s.p ? s.p + i : "", e - i);
            if (!r && e < s.n) r = jbuf_putc(&b, '\n');
            line++;
            if (e >= s.n) break;
            i = e + 1;
        }
        jbuf_free(&s);
        if (r) {
            st = jerr_build(c, n, &b, 1);
            jbuf_free(&b);
            return st;
        }
        return ret_buf(c, &b, out);
    }
    case 36:
    case 37: { /* escape, e */
        NOARGS(name);
        jbuf s = {0};
        if ((st = to_str(c, n, val, &s))) return st;
        b.limit = c->max_output;
        int r = 0;
        for (size_t i = 0; i < s.n && !r; i++) {
            switch (s.p[i]) {
            case '&': r = jbuf_puts(&b, "&amp;"); break;
            case '<': r = jbuf_puts(&b, "&lt;"); break;
            case '>': r = jbuf_puts(&b, "&gt;"); break;
            case '"': r = jbuf_puts(&b, "&#34;"); break;
            case '\'': r = jbuf_puts(&b, "&#39;"); break;
            default: r = jbuf_putc(&b, s.p[i]);
            }
        }
        jbuf_free(&s);
        if (r) {
            st = jerr_build(c, n, &b, 1);
            jbuf_free(&b);
            return st;
        }
        return ret_buf(c, &b, out);
    }
    default: return jerr(c, n, "No filter named '%s'.", name);
    }
}

static const char *const filter_names[] = {
    "tojson", "trim", "items", "length", "count", "string", "safe", "lower", "upper", "capitalize", "title",
    "replace", "join", "first", "last", "default", "d", "int", "float", "abs", "list", "reverse", "unique",
    "sort", "map", "select", "reject", "selectattr", "rejectattr", "dictsort", "min", "max", "sum", "round",
    "wordcount", "indent", "escape", "e"};

static int filter_index(const char *name) {
    for (size_t i = 0; i < sizeof filter_names / sizeof filter_names[0]; i++)
        if (!strcmp(name, filter_names[i])) return (int)i;
    return -1;
}


/* ---- tests ---------------------------------------------------------------------------- */

static const char *const test_names[] = {
    "string", "mapping", "iterable", "sequence", "number", "integer", "float", "boolean", "defined", "undefined",
    "none", "true", "false", "callable", "even", "odd", "divisibleby", "eq", "equalto", "==", "ne", "!=", "lt",
    "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge", ">=", "in", "sameas", "lower", "upper"};

static int test_index(const char *name) {
    for (size_t i = 0; i < sizeof test_names / sizeof test_names[0]; i++)
        if (!strcmp(name, test_names[i])) return (int)i;
    return -1;
}


static int all_cased(const char *s, size_t n, int upper) {
    int cased = 0;
    for (size_t i = 0; i < n;) {
        size_t adv;
        int32_t cp = ju8_decode(s + i, n - i, &adv);
        int32_t lo = utf8proc_tolower(cp), up = utf8proc_toupper(cp);
        if (lo != up) {
            cased = 1;
            if (upper ? cp != up : cp != lo) return 0;
        }
        i += adv;
    }
    return cased;
}

df_status jtest(jctx *c, const jnode *n, const char *name, const jv *v, jargs *a, int *out) {
    int js = v->k == JV_JSON;
    json_t *j = v->j;
    int idx = test_index(name);
    df_status st;
    if (idx >= 0) {
        int needs_arg = idx >= 16 && idx <= 33, na = a->npos + a->nkw;
        if (needs_arg ? na != 1 : na != 0)
            return jerr(c, n, needs_arg ? "test '%s' takes one argument" : "test '%s' takes no arguments", name);
    }
    const jv *x = a->npos ? &a->pos[0] : a->nkw ? &a->kwv[0] : NULL;
    int cmp;
    switch (idx) {
    case 0: *out = jv_is_str(v); return DF_OK;
    case 1: *out = js && json_is_object(j); return DF_OK;
    case 2: *out = v->k == JV_UNDEF || (js && (json_is_string(j) || json_is_array(j) || json_is_object(j))); return DF_OK;
    case 3: *out = v->k == JV_UNDEF || (js && (json_is_string(j) || json_is_array(j) || json_is_object(j))); return DF_OK;
    case 4: *out = js && (json_is_number(j) || json_is_boolean(j)); return DF_OK;
    case 5: *out = js && json_is_integer(j); return DF_OK;
    case 6: *out = js && json_is_real(j); return DF_OK;
    case 7: *out = js && json_is_boolean(j); return DF_OK;
    case 8: *out = v->k != JV_UNDEF; return DF_OK;
    case 9: *out = v->k == JV_UNDEF; return DF_OK;
    case 10: *out = js && json_is_null(j); return DF_OK;
    case 11: *out = js && json_is_true(j); return DF_OK;
    case 12: *out = js && json_is_false(j); return DF_OK;
    case 13: *out = v->k == JV_MACRO || v->k == JV_FUNC; return DF_OK;
    case 14:
    case 15: {
        long long i;
        if (v->k == JV_UNDEF) return jerr_undef(c, n, v);
        if (!js || !(json_is_integer(j) || json_is_boolean(j)))
            return jerr(c, n, "test '%s' needs an integer, not '%s'", name, jv_type_name(v));
        i = json_is_integer(j) ? json_integer_value(j) : json_is_true(j);
        *out = (i % 2 == 0) == (idx == 14);
        return DF_OK;
    }
    case 16: {
        long long i = 0, d = 0;
        if (v->k == JV_UNDEF) return jerr_undef(c, n, v);
        if ((st = want_int(c, n, v, "divisibleby value", &i)) || (st = want_int(c, n, x, "divisibleby argument", &d)))
            return st;
        if (d == 0) return jerr(c, n, "integer division or modulo by zero");
        *out = d == -1 || i % d == 0;
        return DF_OK;
    }
    case 17: case 18: case 19: *out = jv_equal(v, x); return DF_OK;
    case 20: case 21: *out = !jv_equal(v, x); return DF_OK;
    case 22: case 23: case 24: case 25: case 26: case 27: case 28: case 29: case 30: case 31:
        if ((st = jop_compare(c, n, v, x, &cmp))) return st;
        *out = idx <= 24 ? cmp < 0 : idx <= 26 ? cmp <= 0 : idx <= 29 ? cmp > 0 : cmp >= 0;
        return DF_OK;
    case 32: {
        /* value in seq */
        json_t *items = NULL;
        if (x->k == JV_JSON && json_is_string(x->j)) {
            if (!jv_is_str(v))
                return jerr(c, n, "'in <string>' requires string as left operand, not %s", jv_type_name(v));
            *out = memmem(json_string_value(x->j), json_string_length(x->j), json_string_value(j),
                          json_string_length(j)) != NULL ||
                   json_string_length(j) == 0;
            return DF_OK;
        }
        if (x->k == JV_JSON && json_is_object(x->j)) {
            *out = jv_is_str(v) && json_object_get(x->j, json_string_value(j)) != NULL;
            return DF_OK;
        }
        if ((st = jop_iterate(c, n, x, &items))) return st;
        *out = 0;
        for (size_t i = 0; i < json_array_size(items) && !*out; i++) {
            jv e = jv_json(json_array_get(items, i));
            *out = jv_equal(v, &e);
        }
        json_decref(items);
        return DF_OK;
    }
    case 33: /* sameas: identity; singletons compare by value */
        if (v->k != x->k) *out = 0;
        else if (v->k == JV_JSON && (json_is_null(j) || json_is_boolean(j)))
            *out = json_typeof(j) == json_typeof(x->j);
        else if (v->k == JV_JSON) *out = j == x->j;
        else *out = jv_equal(v, x);
        return DF_OK;
    case 34:
    case 35:
        *out = jv_is_str(v) && all_cased(json_string_value(j), json_string_length(j), idx == 35);
        return DF_OK;
    default: return jerr(c, n, "No test named '%s'.", name);
    }
}

/* ---- methods and globals -------------------------------------------------------------- */

static const struct {
    const char *name;
    int fn;
} str_methods[] = {{"startswith", JF_STARTSWITH}, {"endswith", JF_ENDSWITH}, {"split", JF_SPLIT},
                   {"rsplit", JF_RSPLIT},         {"strip", JF_STRIP},       {"lstrip", JF_LSTRIP},
                   {"rstrip", JF_RSTRIP},         {"upper", JF_UPPER},       {"lower", JF_LOWER},
                   {"title", JF_TITLE},           {"capitalize", JF_CAPITALIZE}, {"replace", JF_REPLACE},
                   {"join", JF_JOIN},             {"find", JF_FIND},         {"count", JF_COUNT},
                   {"splitlines", JF_SPLITLINES}, {"isdigit", JF_ISDIGIT},   {"isalpha", JF_ISALPHA},
                   {"isspace", JF_ISSPACE}},
  dict_methods[] = {{"items", JF_ITEMS}, {"keys", JF_KEYS}, {"values", JF_VALUES}, {"get", JF_GET}, {"copy", JF_COPY}},
  globals[] = {{"range", JF_RANGE},       {"namespace", JF_NAMESPACE}, {"raise_exception", JF_RAISE},
               {"dict", JF_DICT},         {"strftime_now", JF_STRFTIME}};

int jmethod_lookup(const json_t *self, const char *name) {
    if (json_is_string(self)) {
        for (size_t i = 0; i < sizeof str_methods / sizeof str_methods[0]; i++)
            if (!strcmp(name, str_methods[i].name)) return str_methods[i].fn;
    } else if (json_is_object(self)) {
        for (size_t i = 0; i < sizeof dict_methods / sizeof dict_methods[0]; i++)
            if (!strcmp(name, dict_methods[i].name)) return dict_methods[i].fn;
    }
    return 0;
}

int jglobal_lookup(const char *name) {
    for (size_t i = 0; i < sizeof globals / sizeof globals[0]; i++)
        if (!strcmp(name, globals[i].name)) return globals[i].fn;
    return 0;
}

void jns_release(jns *ns) {
    if (!ns || --ns->refs > 0) return;
    for (int i = 0; i < ns->n; i++) {
        free(ns->names[i]);
        jv_release(&ns->vals[i]);
    }
    free(ns->names);
    free(ns->vals);
    free(ns);
}

static df_status ns_put(jctx *c, const jnode *n, jns *ns, const char *name, const jv *v) {
    if (v->k == JV_NS) return jerr(c, n, "a namespace cannot be stored in a namespace");
    if (v->k == JV_FUNC && v->fn == JF_CYCLE) return jerr(c, n, "loop.cycle cannot be stored in a namespace");
    jv val;
    if (v->k == JV_LOOP) {
        json_t *snap = jv_to_json(v, 0);
        if (!snap) return jerr_nomem(c);
        val = jv_json(snap);
    } else {
        val = jv_copy(v);
    }
    for (int i = 0; i < ns->n; i++)
        if (!strcmp(ns->names[i], name)) {
            jv_release(&ns->vals[i]);
            ns->vals[i] = val;
            return DF_OK;
        }
    if (ns->n == ns->cap) {
        int cap = ns->cap ? ns->cap * 2 : 4;
        char **nn = realloc(ns->names, (size_t)cap * sizeof *nn);
        if (nn) ns->names = nn;
        jv *nv = nn ? realloc(ns->vals, (size_t)cap * sizeof *nv) : NULL;
        if (nv) ns->vals = nv;
        if (!nn || !nv) {
            jv_release(&val);
            return jerr_nomem(c);
        }
        ns->cap = cap;
    }
    if (!(ns->names[ns->n] = strdup(name))) {
        jv_release(&val);
        return jerr_nomem(c);
    }
    ns->vals[ns->n++] = val;
    return DF_OK;
}

df_status jns_set(jctx *c, const jnode *n, jns *ns, const char *name, const jv *v) { return ns_put(c, n, ns, name, v); }

static df_status g_range(jctx *c, const jnode *n, jargs *a, jv *out) {
    long long v[3] = {0, 0, 1};
    df_status st;
    if (a->nkw) return jerr(c, n, "range() takes no keyword arguments");
    if (a->npos < 1 || a->npos > 3) return jerr(c, n, "range expected 1 to 3 arguments, got %d", a->npos);
    for (int i = 0; i < a->npos; i++)
        if ((st = want_int(c, n, &a->pos[i], "range() argument", &v[i]))) return st;
    long long start = a->npos == 1 ? 0 : v[0], stop = a->npos == 1 ? v[0] : v[1], step = a->npos == 3 ? v[2] : 1;
    if (step == 0) return jerr(c, n, "range() arg 3 must not be zero");
    long double cnt = step > 0 ? ((long double)stop - start + step - 1) / step : ((long double)start - stop - step - 1) / -step;
    if (cnt < 0) cnt = 0;
    if (cnt > 1000000) return df_error_set(c->err, DF_ERR_RANGE, "range() of %.0Lf items is too large (template line %d, column %d)", cnt, n->line, n->col);
    if ((st = jstep(c, n, (uint64_t)cnt))) return st;
    json_t *arr = json_array();
    for (long long i = 0, x = start; arr && i < (long long)cnt; i++, x += step)
        if (json_array_append_new(arr, json_integer(x))) {
            json_decref(arr);
            arr = NULL;
        }
    return ret_json(c, arr, out);
}

static df_status str_method(jctx *c, const jnode *n, int fn, const json_t *self, jargs *a, jv *out) {
    const char *s = json_string_value(self);
    size_t sl = json_string_length(self);
    df_status st;
    jbuf b = {0};
    switch (fn) {
    case JF_STARTSWITH:
    case JF_ENDSWITH: {
        ARGS(fn == JF_STARTSWITH ? "startswith" : "endswith", "prefix", "start", "end");
        if (!arg[0]) return jerr(c, n, "%s takes at least 1 argument", fn == JF_STARTSWITH ? "startswith" : "endswith");
        long long b0 = 0, e0 = (long long)ju8_len(s, sl);
        if (given(arg[1]) && (st = want_int(c, n, arg[1], "start", &b0))) return st;
        if (given(arg[2]) && (st = want_int(c, n, arg[2], "end", &e0))) return st;
        long long len = (long long)ju8_len(s, sl);
        if (b0 < 0) b0 = b0 + len < 0 ? 0 : b0 + len;
        if (e0 < 0) e0 = e0 + len < 0 ? 0 : e0 + len;
        if (b0 > len) b0 = len + 1;
        if (e0 > len) e0 = len;
        size_t bs = b0 > len ? sl + 1 : ju8_offset(s, sl, (size_t)b0), es = ju8_offset(s, sl, (size_t)e0);
        const jv *p = arg[0];
        json_t *cands = NULL;
        if (jv_is_str(p)) cands = json_pack("[O]", p->j);
        else if (p->k == JV_JSON && json_is_array(p->j)) cands = json_incref(p->j);
        else return jerr(c, n, "%s first arg must be str or a tuple of str, not %s",
                         fn == JF_STARTSWITH ? "startswith" : "endswith", jv_type_name(p));
        if (!cands) return jerr_nomem(c);
        int r = 0;
        for (size_t i = 0; i < json_array_size(cands) && !r; i++) {
            json_t *q = json_array_get(cands, i);
            if (!json_is_string(q)) {
                json_decref(cands);
                return jerr(c, n, "tuple for %s must only contain str", fn == JF_STARTSWITH ? "startswith" : "endswith");
            }
            size_t ql = json_string_length(q);
            if (bs > sl || es < bs || es - bs < ql) continue;
            r = fn == JF_STARTSWITH ? !memcmp(s + bs, json_string_value(q), ql)
                                    : !memcmp(s + es - ql, json_string_value(q), ql);
        }
        json_decref(cands);
        return ret_json(c, json_boolean(r), out);
    }
    case JF_SPLIT:
    case JF_RSPLIT: {
        ARGS(fn == JF_SPLIT ? "split" : "rsplit", "sep", "maxsplit");
        const char *sep = NULL;
        size_t sepl = 0;
        long long maxsplit = -1;
        if (given(arg[0]) && (st = want_str(c, n, arg[0], "separator", &sep, &sepl))) return st;
        if (given(arg[1]) && (st = want_int(c, n, arg[1], "maxsplit", &maxsplit))) return st;
        return str_split(c, n, s, sl, sep, sepl, maxsplit, fn == JF_RSPLIT, out);
    }
    case JF_STRIP:
    case JF_LSTRIP:
    case JF_RSTRIP: {
        ARGS("strip", "chars");
        const char *chars = NULL;
        size_t nchars = 0, bb, ee;
        if (given(arg[0]) && (st = want_str(c, n, arg[0], "strip arg", &chars, &nchars))) return st;
        strip_range(s, sl, chars, nchars, chars != NULL, fn == JF_STRIP ? 3 : fn == JF_LSTRIP ? 1 : 2, &bb, &ee);
        return ret_json(c, jstr_new(s + bb, ee - bb), out);
    }
    case JF_UPPER:
    case JF_LOWER:
    case JF_TITLE:
    case JF_CAPITALIZE:
        NOARGS("this method");
        if (case_map(&b, s, sl, fn == JF_LOWER ? 0 : fn == JF_UPPER ? 1 : fn == JF_CAPITALIZE ? 2 : 3)) {
            jbuf_free(&b);
            return jerr_nomem(c);
        }
        return ret_buf(c, &b, out);
    case JF_REPLACE: return replace_call(c, n, a, s, sl, out);
    case JF_JOIN: {
        ARGS("join", "iterable");
        if (!arg[0]) return jerr(c, n, "join takes exactly one argument");
        json_t *items;
        if ((st = jop_iterate(c, n, arg[0], &items))) return st;
        st = join_items(c, n, items, s, sl, NULL, 1, out);
        json_decref(items);
        return st;
    }
    case JF_FIND:
    case JF_COUNT: {
        ARGS(fn == JF_FIND ? "find" : "count", "sub");
        const char *sub = NULL;
        size_t subl = 0;
        if (!arg[0]) return jerr(c, n, "%s takes at least 1 argument", fn == JF_FIND ? "find" : "count");
        if ((st = want_str(c, n, arg[0], "substring", &sub, &subl))) return st;
        if (fn == JF_FIND) {
            const char *hit = subl ? memmem(s, sl, sub, subl) : s;
            return ret_json(c, json_integer(hit ? (json_int_t)ju8_len(s, (size_t)(hit - s)) : -1), out);
        }
        long long k = 0;
        if (!subl) k = (long long)ju8_len(s, sl) + 1;
        else
            for (const char *p = s; (p = memmem(p, sl - (size_t)(p - s), sub, subl)); p += subl) k++;
        return ret_json(c, json_integer(k), out);
    }
    case JF_SPLITLINES: {
        NOARGS("splitlines");
        json_t *arr = json_array();
        size_t i = 0;
        while (arr && i < sl) {
            size_t e = i;
            while (e < sl && s[e] != '\n' && s[e] != '\r') e++;
            if (json_array_append_new(arr, jstr_new(s + i, e - i))) {
                json_decref(arr);
                arr = NULL;
                break;
            }
            if (e < sl && s[e] == '\r' && e + 1 < sl && s[e + 1] == '\n') e++;
            i = e + 1;
        }
        return ret_json(c, arr, out);
    }
    case JF_ISDIGIT:
    case JF_ISALPHA:
    case JF_ISSPACE: {
        NOARGS("this method");
        int r = sl > 0;
        for (size_t i = 0; i < sl && r;) {
            size_t adv;
            int32_t cp = ju8_decode(s + i, sl - i, &adv);
            utf8proc_category_t cat = utf8proc_category(cp);
            if (fn == JF_ISDIGIT) r = cat == UTF8PROC_CATEGORY_ND;
            else if (fn == JF_ISALPHA)
                r = cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT ||
                    cat == UTF8PROC_CATEGORY_LM || cat == UTF8PROC_CATEGORY_LO;
            else r = py_isspace(cp);
            i += adv;
        }
        return ret_json(c, json_boolean(r), out);
    }
    }
    return jerr(c, n, "internal error: unknown string method");
}

df_status jcall_builtin(jctx *c, const jnode *n, const jv *fnv, jargs *a, jv *out) {
    df_status st;
    int fn = fnv->fn;
    if (fn >= JF_STARTSWITH && fn <= JF_ISSPACE) return str_method(c, n, fn, fnv->j, a, out);
    switch (fn) {
    case JF_RANGE: return g_range(c, n, a, out);
    case JF_NAMESPACE:
    case JF_DICT: {
        if (a->npos > 1) return jerr(c, n, "%s expected at most 1 positional argument", fn == JF_DICT ? "dict" : "namespace");
        if (a->npos && !(a->pos[0].k == JV_JSON && json_is_object(a->pos[0].j)))
            return jerr(c, n, "%s positional argument must be a dict", fn == JF_DICT ? "dict" : "namespace");
        if (fn == JF_DICT) {
            json_t *o = a->npos ? json_copy(a->pos[0].j) : json_object();
            for (int k = 0; o && k < a->nkw; k++) {
                json_t *j = jv_to_json(&a->kwv[k], 1);
                if (!j) {
                    json_decref(o);
                    return jerr(c, n, "a %s cannot be stored in a dict", jv_type_name(&a->kwv[k]));
                }
                json_object_set_new(o, a->kwn[k], j);
            }
            return ret_json(c, o, out);
        }
        jns *ns = calloc(1, sizeof *ns);
        if (!ns) return jerr_nomem(c);
        ns->refs = 1;
        st = DF_OK;
        if (a->npos) {
            const char *k;
            json_t *v;
            json_object_foreach(a->pos[0].j, k, v) {
                jv jvv = jv_json(v);
                if ((st = ns_put(c, n, ns, k, &jvv))) break;
            }
        }
        for (int k = 0; k < a->nkw && !st; k++) st = ns_put(c, n, ns, a->kwn[k], &a->kwv[k]);
        if (st) {
            jns_release(ns);
            return st;
        }
        memset(out, 0, sizeof *out);
        out->k = JV_NS;
        out->p = ns;
        return DF_OK;
    }
    case JF_RAISE: {
        jbuf b = {0};
        if (a->npos >= 1 && jv_to_str(&a->pos[0], &b)) {
            jbuf_free(&b);
            return jerr_nomem(c);
        }
        st = df_error_set(c->err, DF_ERR_INVALID_ARG, "%s", b.p ? b.p : "");
        jbuf_free(&b);
        return st;
    }
    case JF_STRFTIME: {
        const char *fmt = NULL;
        size_t fl = 0;
        if (a->npos != 1 || a->nkw) return jerr(c, n, "strftime_now takes exactly one argument");
        if ((st = want_str(c, n, &a->pos[0], "strftime_now format", &fmt, &fl))) return st;
        char buf[512];
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        size_t k = fl < 200 ? strftime(buf, sizeof buf, fmt, &tm) : 0;
        return ret_json(c, jstr_new(buf, k), out);
    }
    case JF_ITEMS:
    case JF_KEYS:
    case JF_VALUES:
    case JF_COPY: {
        NOARGS("this method");
        jv self = jv_json(fnv->j);
        if (fn == JF_ITEMS) {
            json_t *arr;
            if ((st = items_of(c, n, &self, &arr))) return st;
            return ret_json(c, arr, out);
        }
        if (fn == JF_COPY) return ret_json(c, json_incref(fnv->j), out);
        json_t *arr = json_array();
        const char *k;
        json_t *v;
        json_object_foreach(fnv->j, k, v) {
            if (!arr) break;
            if (json_array_append_new(arr, fn == JF_KEYS ? json_string_nocheck(k) : json_incref(v))) {
                json_decref(arr);
                arr = NULL;
            }
        }
        return ret_json(c, arr, out);
    }
    case JF_GET: {
        ARGS("get", "key", "default");
        if (!arg[0]) return jerr(c, n, "get expected at least 1 argument");
        json_t *v = jv_is_str(arg[0]) ? json_object_getn(fnv->j, json_string_value(arg[0]->j),
                                                         json_string_length(arg[0]->j))
                                      : NULL;
        if (v) return ret_json(c, json_incref(v), out);
        if (arg[1]) *out = jv_copy(arg[1]);
        else *out = jv_json(json_null());
        return DF_OK;
    }
    case JF_CYCLE: {
        const jloop *l = fnv->p;
        if (a->npos == 0) return jerr(c, n, "no items for cycling given");
        *out = jv_copy(&a->pos[l->i % (size_t)a->npos]);
        return DF_OK;
    }
    }
    return jerr(c, n, "internal error: unknown function");
}
