/* Jinja2 evaluator: statements, expressions and operators with Python/Jinja2 semantics,
 * plus df_jinja_parse / df_jinja_render / df_jinja_free.
 *
 * Scoping (as Jinja2): `for` bodies and macro bodies get a new scope per iteration / call;
 * `if` does not; `set` assigns in the innermost scope, so a set inside a loop is not seen
 * after it (templates use namespace() for that). Macros see the template's top-level scope
 * and the template variables. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/jinja_eval.h"

/* ---- values --------------------------------------------------------------------------- */

jv jv_json(json_t *owned) {
    jv v = {0};
    if (owned) {
        v.k = JV_JSON;
        v.j = owned;
    }
    return v;
}

jv jv_undef(const char *fmt, ...) {
    jv v = {0};
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    v.k = JV_UNDEF;
    v.j = json_string_nocheck(msg);
    return v;
}

jv jv_copy(const jv *v) {
    jv r = *v;
    if (r.j) json_incref(r.j);
    if (r.k == JV_NS) ((jns *)r.p)->refs++;
    return r;
}

void jv_release(jv *v) {
    if (v->j) json_decref(v->j);
    if (v->k == JV_NS) jns_release(v->p);
    memset(v, 0, sizeof *v);
}

json_t *jstr_new(const char *s, size_t n) { return json_stringn_nocheck(s ? s : "", n); }

int jv_is_str(const jv *v) { return v->k == JV_JSON && json_is_string(v->j); }

const char *jv_str(const jv *v, size_t *n) {
    *n = json_string_length(v->j);
    return json_string_value(v->j);
}

int jv_truthy(const jv *v) {
    switch (v->k) {
    case JV_UNDEF: return 0;
    case JV_JSON:
        switch (json_typeof(v->j)) {
        case JSON_NULL:
        case JSON_FALSE: return 0;
        case JSON_TRUE: return 1;
        case JSON_INTEGER: return json_integer_value(v->j) != 0;
        case JSON_REAL: return json_real_value(v->j) != 0;
        case JSON_STRING: return json_string_length(v->j) != 0;
        case JSON_ARRAY: return json_array_size(v->j) != 0;
        case JSON_OBJECT: return json_object_size(v->j) != 0;
        }
        return 0;
    default: return 1;
    }
}

const char *jv_type_name(const jv *v) {
    switch (v->k) {
    case JV_UNDEF: return "Undefined";
    case JV_MACRO: return "Macro";
    case JV_NS: return "Namespace";
    case JV_LOOP: return "LoopContext";
    case JV_FUNC: return "builtin_function_or_method";
    case JV_JSON: break;
    }
    switch (json_typeof(v->j)) {
    case JSON_NULL: return "NoneType";
    case JSON_TRUE:
    case JSON_FALSE: return "bool";
    case JSON_INTEGER: return "int";
    case JSON_REAL: return "float";
    case JSON_STRING: return "str";
    case JSON_ARRAY: return "list";
    case JSON_OBJECT: return "dict";
    }
    return "object";
}

/* Jinja2's object_type_repr: "list object", "None", "jinja2.utils.Namespace object". */
static void type_repr(const jv *v, char *buf, size_t cap) {
    if (v->k == JV_JSON && json_is_null(v->j)) snprintf(buf, cap, "None");
    else if (v->k == JV_NS) snprintf(buf, cap, "jinja2.utils.Namespace object");
    else if (v->k == JV_LOOP) snprintf(buf, cap, "jinja2.runtime.LoopContext object");
    else if (v->k == JV_MACRO) snprintf(buf, cap, "jinja2.runtime.Macro object");
    else snprintf(buf, cap, "%s object", jv_type_name(v));
}

static int repr_json(const json_t *j, jbuf *b, int depth);

static int str_json(const json_t *j, jbuf *b, int depth) {
    char num[40];
    if (depth > 10000) return -1;
    switch (json_typeof(j)) {
    case JSON_NULL: return jbuf_puts(b, "None");
    case JSON_TRUE: return jbuf_puts(b, "True");
    case JSON_FALSE: return jbuf_puts(b, "False");
    case JSON_INTEGER: return jbuf_printf(b, "%" JSON_INTEGER_FORMAT, json_integer_value(j));
    case JSON_REAL: jpy_float_repr(json_real_value(j), num); return jbuf_puts(b, num);
    case JSON_STRING: return jbuf_put(b, json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        if (jbuf_putc(b, '[')) return -1;
        for (size_t i = 0; i < json_array_size(j); i++)
            if ((i && jbuf_puts(b, ", ")) || repr_json(json_array_get(j, i), b, depth + 1)) return -1;
        return jbuf_putc(b, ']');
    }
    case JSON_OBJECT: {
        const char *k;
        json_t *val;
        int first = 1;
        if (jbuf_putc(b, '{')) return -1;
        json_object_foreach((json_t *)j, k, val) {
            if ((!first && jbuf_puts(b, ", ")) || jpy_str_repr(b, k, strlen(k)) || jbuf_puts(b, ": ") ||
                repr_json(val, b, depth + 1))
                return -1;
            first = 0;
        }
        return jbuf_putc(b, '}');
    }
    }
    return -1;
}

static int repr_json(const json_t *j, jbuf *b, int depth) {
    if (json_is_string(j)) return jpy_str_repr(b, json_string_value(j), json_string_length(j));
    return str_json(j, b, depth);
}

int jv_to_str(const jv *v, jbuf *b) {
    switch (v->k) {
    case JV_UNDEF: return 0;
    case JV_JSON: return str_json(v->j, b, 0);
    case JV_MACRO: return jbuf_printf(b, "<Macro '%s'>", ((const jnode *)v->p)->name);
    case JV_NS: {
        jns *ns = v->p;
        if (jbuf_puts(b, "<Namespace {")) return -1;
        for (int i = 0; i < ns->n; i++) {
            if ((i && jbuf_puts(b, ", ")) || jpy_str_repr(b, ns->names[i], strlen(ns->names[i])) ||
                jbuf_puts(b, ": "))
                return -1;
            if (ns->vals[i].k == JV_JSON ? repr_json(ns->vals[i].j, b, 1) : jv_to_str(&ns->vals[i], b)) return -1;
        }
        return jbuf_puts(b, "}>");
    }
    case JV_LOOP: {
        const jloop *l = v->p;
        return jbuf_printf(b, "<LoopContext %zu/%zu>", l->i + 1, l->n);
    }
    case JV_FUNC: return jbuf_puts(b, "<built-in function>");
    }
    return 0;
}

static json_t *loop_snapshot(const jloop *l) {
    json_t *o = json_object();
    if (!o) return NULL;
    json_object_set_new(o, "index", json_integer((json_int_t)l->i + 1));
    json_object_set_new(o, "index0", json_integer((json_int_t)l->i));
    json_object_set_new(o, "revindex", json_integer((json_int_t)(l->n - l->i)));
    json_object_set_new(o, "revindex0", json_integer((json_int_t)(l->n - l->i - 1)));
    json_object_set_new(o, "first", json_boolean(l->i == 0));
    json_object_set_new(o, "last", json_boolean(l->i + 1 == l->n));
    json_object_set_new(o, "length", json_integer((json_int_t)l->n));
    json_object_set_new(o, "depth", json_integer(1));
    json_object_set_new(o, "depth0", json_integer(0));
    if (l->i > 0) json_object_set(o, "previtem", json_array_get(l->items, l->i - 1));
    if (l->i + 1 < l->n) json_object_set(o, "nextitem", json_array_get(l->items, l->i + 1));
    return o;
}

json_t *jv_to_json(const jv *v, int undef_ok) {
    switch (v->k) {
    case JV_JSON: return json_incref(v->j);
    case JV_UNDEF: return undef_ok ? json_null() : NULL;
    case JV_LOOP: return loop_snapshot(v->p);
    default: return NULL;
    }
}

static int json_num(const json_t *j, double *d, long long *i, int *is_int) {
    switch (json_typeof(j)) {
    case JSON_INTEGER: *i = json_integer_value(j); *d = (double)*i; *is_int = 1; return 1;
    case JSON_TRUE: *i = 1; *d = 1; *is_int = 1; return 1;
    case JSON_FALSE: *i = 0; *d = 0; *is_int = 1; return 1;
    case JSON_REAL: *d = json_real_value(j); *i = 0; *is_int = 0; return 1;
    default: return 0;
    }
}

static int json_eq(const json_t *a, const json_t *b, int depth) {
    double da, db;
    long long ia, ib;
    int ta, tb;
    if (a == b) return 1;
    if (depth > 10000) return 0;
    if (json_num(a, &da, &ia, &ta) && json_num(b, &db, &ib, &tb)) return (ta && tb) ? ia == ib : da == db;
    if (json_typeof(a) != json_typeof(b)) return 0;
    switch (json_typeof(a)) {
    case JSON_NULL: return 1;
    case JSON_STRING:
        return json_string_length(a) == json_string_length(b) &&
               memcmp(json_string_value(a), json_string_value(b), json_string_length(a)) == 0;
    case JSON_ARRAY:
        if (json_array_size(a) != json_array_size(b)) return 0;
        for (size_t i = 0; i < json_array_size(a); i++)
            if (!json_eq(json_array_get(a, i), json_array_get(b, i), depth + 1)) return 0;
        return 1;
    case JSON_OBJECT: {
        if (json_object_size(a) != json_object_size(b)) return 0;
        const char *k;
        json_t *va;
        json_object_foreach((json_t *)a, k, va) {
            json_t *vb = json_object_get(b, k);
            if (!vb || !json_eq(va, vb, depth + 1)) return 0;
        }
        return 1;
    }
    default: return 0;
    }
}

int jv_equal(const jv *a, const jv *b) {
    if (a->k != b->k) return 0;
    switch (a->k) {
    case JV_UNDEF: return 1;
    case JV_JSON: return json_eq(a->j, b->j, 0);
    case JV_FUNC: return a->fn == b->fn && a->j == b->j;
    default: return a->p == b->p;
    }
}

/* ---- errors --------------------------------------------------------------------------- */

df_status jerr(jctx *c, const jnode *n, const char *fmt, ...) {
    char msg[DF_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n) return df_error_set(c->err, DF_ERR_INVALID_ARG, "%s (template line %d, column %d)", msg, n->line, n->col);
    return df_error_set(c->err, DF_ERR_INVALID_ARG, "%s", msg);
}

df_status jerr_undef(jctx *c, const jnode *n, const jv *v) {
    if (v->j) return jerr(c, n, "%s", json_string_value(v->j));
    return jerr(c, n, "value is undefined");
}

df_status jerr_nomem(jctx *c) { return df_error_set(c->err, DF_ERR_NOMEM, "out of memory rendering template"); }

df_status jerr_build(jctx *c, const jnode *n, const jbuf *b, size_t adding) {
    if (b->limit && (b->over_limit || b->n + adding > b->limit)) {
        if (n)
            return df_error_set(c->err, DF_ERR_RANGE,
                                "template output exceeds the limit of %zu bytes (template line %d, column %d)",
                                c->max_output, n->line, n->col);
        return df_error_set(c->err, DF_ERR_RANGE, "template output exceeds the limit of %zu bytes", c->max_output);
    }
    return jerr_nomem(c);
}

df_status jstep(jctx *c, const jnode *n, uint64_t k) {
    c->steps += k;
    if (c->steps > c->max_steps)
        return df_error_set(c->err, DF_ERR_RANGE,
                            "template evaluation exceeded %llu steps (template line %d, column %d)",
                            (unsigned long long)c->max_steps, n ? n->line : 0, n ? n->col : 0);
    return DF_OK;
}

/* ---- scopes --------------------------------------------------------------------------- */

static jv *scope_find(jscope *s, const char *name) {
    for (; s; s = s->parent)
        for (int i = s->n - 1; i >= 0; i--)
            if (!strcmp(s->names[i], name)) return &s->vals[i];
    return NULL;
}

/* Binds name in s, taking ownership of *v. */
static df_status scope_set(jctx *c, jscope *s, const char *name, jv *v) {
    for (int i = 0; i < s->n; i++) {
        if (!strcmp(s->names[i], name)) {
            jv_release(&s->vals[i]);
            s->vals[i] = *v;
            memset(v, 0, sizeof *v);
            return DF_OK;
        }
    }
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 8;
        const char **nn = realloc(s->names, (size_t)cap * sizeof *nn);
        if (!nn) goto oom;
        s->names = nn;
        jv *nv = realloc(s->vals, (size_t)cap * sizeof *nv);
        if (!nv) goto oom;
        s->vals = nv;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n++] = *v;
    memset(v, 0, sizeof *v);
    return DF_OK;
oom:
    jv_release(v);
    return jerr_nomem(c);
}

static void scope_clear(jscope *s) {
    for (int i = 0; i < s->n; i++) jv_release(&s->vals[i]);
    free(s->names);
    free(s->vals);
    memset(s, 0, sizeof *s);
}

/* ---- expressions ---------------------------------------------------------------------- */

static df_status eval(jctx *c, jscope *s, const jnode *n, jv *out);
static df_status exec_body(jctx *c, jscope *s, jnode *const *body, int nbody, jbuf *out);

static df_status lookup_name(jctx *c, jscope *s, const jnode *n, jv *out) {
    jv *v = scope_find(s, n->name);
    if (v) {
        *out = jv_copy(v);
        return DF_OK;
    }
    json_t *j = c->vars ? json_object_get(c->vars, n->name) : NULL;
    if (j) {
        *out = jv_json(json_incref(j));
        return DF_OK;
    }
    int fn = jglobal_lookup(n->name);
    if (fn) {
        memset(out, 0, sizeof *out);
        out->k = JV_FUNC;
        out->fn = fn;
        return DF_OK;
    }
    *out = jv_undef("'%s' is undefined", n->name);
    return DF_OK;
}

static df_status loop_attr(jctx *c, const jnode *n, const jv *obj, const char *name, jv *out) {
    const jloop *l = obj->p;
    json_t *j = NULL;
    if (!strcmp(name, "index")) j = json_integer((json_int_t)l->i + 1);
    else if (!strcmp(name, "index0")) j = json_integer((json_int_t)l->i);
    else if (!strcmp(name, "revindex")) j = json_integer((json_int_t)(l->n - l->i));
    else if (!strcmp(name, "revindex0")) j = json_integer((json_int_t)(l->n - l->i - 1));
    else if (!strcmp(name, "first")) j = json_boolean(l->i == 0);
    else if (!strcmp(name, "last")) j = json_boolean(l->i + 1 == l->n);
    else if (!strcmp(name, "length")) j = json_integer((json_int_t)l->n);
    else if (!strcmp(name, "depth")) j = json_integer(1);
    else if (!strcmp(name, "depth0")) j = json_integer(0);
    else if (!strcmp(name, "previtem")) {
        if (l->i == 0) {
            *out = jv_undef("there is no previous item");
            return DF_OK;
        }
        j = json_incref(json_array_get(l->items, l->i - 1));
    } else if (!strcmp(name, "nextitem")) {
        if (l->i + 1 >= l->n) {
            *out = jv_undef("there is no next item");
            return DF_OK;
        }
        j = json_incref(json_array_get(l->items, l->i + 1));
    } else if (!strcmp(name, "cycle")) {
        memset(out, 0, sizeof *out);
        out->k = JV_FUNC;
        out->fn = JF_CYCLE;
        out->p = obj->p;
        return DF_OK;
    } else {
        *out = jv_undef("'jinja2.runtime.LoopContext object' has no attribute '%s'", name);
        return DF_OK;
    }
    if (!j) return jerr_nomem(c);
    (void)n;
    *out = jv_json(j);
    return DF_OK;
}

df_status jop_getattr(jctx *c, const jnode *n, const jv *obj, const char *name, jv *out) {
    char tr[64];
    switch (obj->k) {
    case JV_UNDEF: return jerr_undef(c, n, obj);
    case JV_LOOP: return loop_attr(c, n, obj, name, out);
    case JV_NS: {
        jns *ns = obj->p;
        for (int i = 0; i < ns->n; i++)
            if (!strcmp(ns->names[i], name)) {
                *out = jv_copy(&ns->vals[i]);
                return DF_OK;
            }
        break;
    }
    case JV_JSON: {
        int m = jmethod_lookup(obj->j, name);
        if (m) {
            memset(out, 0, sizeof *out);
            out->k = JV_FUNC;
            out->fn = m;
            out->j = json_incref(obj->j);
            return DF_OK;
        }
        if (json_is_object(obj->j)) {
            static const char *unsafe[] = {"pop", "popitem", "setdefault", "update", "clear"};
            for (size_t i = 0; i < sizeof unsafe / sizeof unsafe[0]; i++)
                if (!strcmp(name, unsafe[i])) {
                    *out = jv_undef("access to attribute '%s' of 'dict' object is unsafe.", name);
                    return DF_OK;
                }
            json_t *v = json_object_get(obj->j, name);
            if (v) {
                *out = jv_json(json_incref(v));
                return DF_OK;
            }
        } else if (json_is_array(obj->j)) {
            static const char *unsafe[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear"};
            for (size_t i = 0; i < sizeof unsafe / sizeof unsafe[0]; i++)
                if (!strcmp(name, unsafe[i])) {
                    *out = jv_undef("access to attribute '%s' of 'list' object is unsafe.", name);
                    return DF_OK;
                }
        }
        break;
    }
    default: break;
    }
    type_repr(obj, tr, sizeof tr);
    *out = jv_undef("'%s' has no attribute '%s'", tr, name);
    return DF_OK;
}

static df_status getitem(jctx *c, const jnode *n, const jv *obj, const jv *key, jv *out) {
    char tr[64];
    if (obj->k == JV_UNDEF) return jerr_undef(c, n, obj);
    if (key->k == JV_UNDEF) { /* Jinja2: a failed lookup is undefined, not an error */
        type_repr(obj, tr, sizeof tr);
        *out = jv_undef("%s has no element Undefined", tr);
        return DF_OK;
    }
    if (obj->k == JV_JSON && key->k == JV_JSON) {
        json_t *o = obj->j, *k = key->j;
        if ((json_is_array(o) || json_is_string(o)) && (json_is_integer(k) || json_is_boolean(k))) {
            long long i = json_is_integer(k) ? json_integer_value(k) : json_is_true(k);
            size_t len = json_is_array(o) ? json_array_size(o) : ju8_len(json_string_value(o), json_string_length(o));
            long long idx = i < 0 ? i + (long long)len : i;
            if (idx >= 0 && (size_t)idx < len) {
                if (json_is_array(o)) {
                    *out = jv_json(json_incref(json_array_get(o, (size_t)idx)));
                } else {
                    const char *s = json_string_value(o);
                    size_t sl = json_string_length(o);
                    size_t b = ju8_offset(s, sl, (size_t)idx), e = ju8_offset(s, sl, (size_t)idx + 1);
                    *out = jv_json(jstr_new(s + b, e - b));
                    if (out->k != JV_JSON) return jerr_nomem(c);
                }
                return DF_OK;
            }
            type_repr(obj, tr, sizeof tr);
            *out = jv_undef("%s has no element %lld", tr, i);
            return DF_OK;
        }
        if (json_is_object(o) && json_is_string(k)) {
            json_t *v = json_object_getn(o, json_string_value(k), json_string_length(k));
            if (v) {
                *out = jv_json(json_incref(v));
                return DF_OK;
            }
        }
    }
    if (jv_is_str(key)) return jop_getattr(c, n, obj, json_string_value(key->j), out);
    type_repr(obj, tr, sizeof tr);
    jbuf b = {0};
    if (key->k == JV_JSON ? repr_json(key->j, &b, 0) : jv_to_str(key, &b)) {
        jbuf_free(&b);
        return jerr_nomem(c);
    }
    *out = jv_undef("%s has no element %s", tr, b.p ? b.p : "");
    jbuf_free(&b);
    return DF_OK;
}

static df_status slice_index(jctx *c, const jnode *n, const jv *v, long long *out, int *given) {
    *given = 0;
    if (v->k == JV_UNDEF || (v->k == JV_JSON && json_is_null(v->j))) return DF_OK;
    if (v->k == JV_JSON && json_is_integer(v->j)) {
        *out = json_integer_value(v->j);
        *given = 1;
        return DF_OK;
    }
    if (v->k == JV_JSON && json_is_boolean(v->j)) {
        *out = json_is_true(v->j);
        *given = 1;
        return DF_OK;
    }
    return jerr(c, n, "slice indices must be integers or None");
}

static df_status eval_slice(jctx *c, jscope *s, const jnode *n, jv *out) {
    jv obj = {0}, parts[3] = {{0}};
    long long v[3] = {0, 0, 1};
    int given[3] = {0, 0, 0};
    const jnode *pn[3] = {n->b, n->c, n->d};
    df_status st = eval(c, s, n->a, &obj);
    for (int i = 0; i < 3 && !st; i++)
        if (pn[i] && !(st = eval(c, s, pn[i], &parts[i]))) st = slice_index(c, n, &parts[i], &v[i], &given[i]);
    for (int i = 0; i < 3; i++) jv_release(&parts[i]);
    if (st) goto done;
    if (obj.k == JV_UNDEF) {
        st = jerr_undef(c, n, &obj);
        goto done;
    }
    long long step = given[2] ? v[2] : 1;
    if (step == 0) {
        st = jerr(c, n, "slice step cannot be zero");
        goto done;
    }
    int is_arr = obj.k == JV_JSON && json_is_array(obj.j);
    if (!is_arr && !jv_is_str(&obj)) {
        st = jerr(c, n, "'%s' object is not subscriptable", jv_type_name(&obj));
        goto done;
    }
    const char *str = NULL;
    size_t slen = 0;
    if (!is_arr) str = jv_str(&obj, &slen);
    long long len = is_arr ? (long long)json_array_size(obj.j) : (long long)ju8_len(str, slen);
    /* Python's slice.indices */
    long long start, stop;
    if (step > 0) {
        start = given[0] ? v[0] : 0;
        stop = given[1] ? v[1] : len;
        if (start < 0) start = start + len < 0 ? 0 : start + len;
        if (start > len) start = len;
        if (stop < 0) stop = stop + len < 0 ? 0 : stop + len;
        if (stop > len) stop = len;
    } else {
        start = given[0] ? v[0] : len - 1;
        stop = given[1] ? v[1] : -1 - len; /* "before the beginning" */
        if (start < 0) start = start + len < 0 ? -1 : start + len;
        if (start >= len) start = len - 1;
        if (given[1]) {
            if (stop < 0) stop = stop + len < 0 ? -1 : stop + len;
            if (stop >= len) stop = len - 1;
        } else {
            stop = -1;
        }
    }
    if (is_arr) {
        json_t *r = json_array();
        if (!r) {
            st = jerr_nomem(c);
            goto done;
        }
        for (long long i = start; step > 0 ? i < stop : i > stop; i += step)
            if (json_array_append(r, json_array_get(obj.j, (size_t)i))) {
                json_decref(r);
                st = jerr_nomem(c);
                goto done;
            }
        *out = jv_json(r);
    } else {
        /* code point offsets */
        size_t *offs = malloc(((size_t)len + 1) * sizeof *offs);
        if (!offs) {
            st = jerr_nomem(c);
            goto done;
        }
        size_t k = 0;
        for (size_t b = 0; b < slen; b++)
            if (((unsigned char)str[b] & 0xC0) != 0x80) offs[k++] = b;
        offs[k] = slen;
        jbuf b = {0};
        for (long long i = start; step > 0 ? i < stop : i > stop; i += step)
            if (jbuf_put(&b, str + offs[i], offs[i + 1] - offs[i])) {
                free(offs);
                jbuf_free(&b);
                st = jerr_nomem(c);
                goto done;
            }
        free(offs);
        *out = jv_json(jstr_new(b.p, b.n));
        jbuf_free(&b);
        if (out->k != JV_JSON) st = jerr_nomem(c);
    }
done:
    jv_release(&obj);
    return st;
}

static void args_free(jargs *a) {
    for (int i = 0; i < a->npos; i++) jv_release(&a->pos[i]);
    for (int i = 0; i < a->nkw; i++) jv_release(&a->kwv[i]);
    free(a->pos);
    free(a->kwv);
    memset(a, 0, sizeof *a);
}

static df_status eval_args(jctx *c, jscope *s, const jnode *n, jargs *a) {
    memset(a, 0, sizeof *a);
    a->pos = calloc((size_t)n->nargs + 1, sizeof *a->pos);
    a->kwv = calloc((size_t)n->nkw + 1, sizeof *a->kwv);
    a->kwn = n->kwnames;
    if (!a->pos || !a->kwv) {
        args_free(a);
        return jerr_nomem(c);
    }
    df_status st;
    for (int i = 0; i < n->nargs; i++) {
        if ((st = eval(c, s, n->args[i], &a->pos[i]))) goto fail;
        a->npos++;
    }
    for (int i = 0; i < n->nkw; i++) {
        if ((st = eval(c, s, n->kwvals[i], &a->kwv[i]))) goto fail;
        a->nkw++;
    }
    return DF_OK;
fail:
    args_free(a);
    return st;
}

df_status jcall_macro(jctx *c, const jnode *call, const jnode *m, jargs *a, jv *out) {
    if (c->depth >= c->max_depth)
        return df_error_set(c->err, DF_ERR_RANGE, "macro calls nested deeper than %d (template line %d, column %d)",
                            c->max_depth, call->line, call->col);
    if (a->npos > m->nkw)
        return jerr(c, call, "macro '%s' takes not more than %d argument(s)", m->name, m->nkw);
    for (int k = 0; k < a->nkw; k++) {
        int found = 0;
        for (int i = 0; i < m->nkw; i++)
            if (!strcmp(a->kwn[k], m->kwnames[i])) found = 1;
        if (!found) return jerr(c, call, "macro '%s' takes no keyword argument '%s'", m->name, a->kwn[k]);
    }
    jscope ms = {.parent = c->root};
    df_status st = DF_OK;
    c->depth++;
    for (int i = 0; i < m->nkw && !st; i++) {
        jv v = {0};
        int have = 0;
        if (i < a->npos) {
            v = jv_copy(&a->pos[i]);
            have = 1;
        }
        for (int k = 0; k < a->nkw && !have; k++)
            if (!strcmp(a->kwn[k], m->kwnames[i])) {
                v = jv_copy(&a->kwv[k]);
                have = 1;
            }
        if (!have) {
            if (m->kwvals[i]) st = eval(c, &ms, m->kwvals[i], &v);
            else v = jv_undef("parameter '%s' was not provided", m->kwnames[i]);
        }
        if (!st) st = scope_set(c, &ms, m->kwnames[i], &v);
    }
    jbuf b = {.limit = c->max_output};
    if (!st) st = exec_body(c, &ms, m->body, m->nbody, &b);
    c->ctl = 0;
    c->depth--;
    scope_clear(&ms);
    if (!st) {
        *out = jv_json(jstr_new(b.p, b.n));
        if (out->k != JV_JSON) st = jerr_nomem(c);
    }
    jbuf_free(&b);
    return st;
}

static df_status eval_call(jctx *c, jscope *s, const jnode *n, jv *out) {
    jv fn = {0};
    jargs a;
    df_status st = eval(c, s, n->a, &fn);
    if (st) return st;
    if (fn.k == JV_UNDEF) {
        st = jerr_undef(c, n, &fn);
        jv_release(&fn);
        return st;
    }
    if (fn.k != JV_MACRO && fn.k != JV_FUNC) {
        st = jerr(c, n, "'%s' object is not callable", jv_type_name(&fn));
        jv_release(&fn);
        return st;
    }
    if ((st = eval_args(c, s, n, &a))) {
        jv_release(&fn);
        return st;
    }
    if (fn.k == JV_MACRO) st = jcall_macro(c, n, fn.p, &a, out);
    else st = jcall_builtin(c, n, &fn, &a, out);
    args_free(&a);
    jv_release(&fn);
    return st;
}

static int is_num(const jv *v) {
    return v->k == JV_JSON && (json_is_number(v->j) || json_is_boolean(v->j));
}

static void num_of(const jv *v, double *d, long long *i, int *is_int) { json_num(v->j, d, i, is_int); }

df_status jop_compare(jctx *c, const jnode *n, const jv *a, const jv *b, int *cmp) {
    if (a->k == JV_UNDEF) return jerr_undef(c, n, a);
    if (b->k == JV_UNDEF) return jerr_undef(c, n, b);
    if (is_num(a) && is_num(b)) {
        double da = 0, db = 0;
        long long ia = 0, ib = 0;
        int ta = 0, tb = 0;
        num_of(a, &da, &ia, &ta);
        num_of(b, &db, &ib, &tb);
        if (ta && tb) *cmp = ia < ib ? -1 : ia > ib;
        else *cmp = da < db ? -1 : da > db;
        return DF_OK;
    }
    if (jv_is_str(a) && jv_is_str(b)) {
        size_t na, nb;
        const char *sa = jv_str(a, &na), *sb = jv_str(b, &nb);
        int r = memcmp(sa, sb, na < nb ? na : nb);
        *cmp = r ? (r < 0 ? -1 : 1) : (na < nb ? -1 : na > nb);
        return DF_OK;
    }
    if (a->k == JV_JSON && b->k == JV_JSON && json_is_array(a->j) && json_is_array(b->j)) {
        size_t na = json_array_size(a->j), nb = json_array_size(b->j);
        for (size_t i = 0; i < na && i < nb; i++) {
            jv x = jv_json(json_array_get(a->j, i)), y = jv_json(json_array_get(b->j, i));
            if (jv_equal(&x, &y)) continue;
            return jop_compare(c, n, &x, &y, cmp);
        }
        *cmp = na < nb ? -1 : na > nb;
        return DF_OK;
    }
    return jerr(c, n, "'<' not supported between instances of '%s' and '%s'", jv_type_name(a), jv_type_name(b));
}

static df_status op_in(jctx *c, const jnode *n, const jv *item, const jv *cont, int *res) {
    *res = 0;
    if (cont->k == JV_UNDEF) return DF_OK;
    if (cont->k == JV_JSON) {
        json_t *j = cont->j;
        if (json_is_string(j)) {
            if (!jv_is_str(item))
                return jerr(c, n, "'in <string>' requires string as left operand, not %s", jv_type_name(item));
            size_t ni, nc;
            const char *si = jv_str(item, &ni), *sc = jv_str(cont, &nc);
            *res = ni == 0 || (ni <= nc && memmem(sc, nc, si, ni) != NULL);
            return DF_OK;
        }
        if (json_is_array(j)) {
            for (size_t i = 0; i < json_array_size(j) && !*res; i++) {
                jv e = jv_json(json_array_get(j, i));
                *res = jv_equal(item, &e);
            }
            return DF_OK;
        }
        if (json_is_object(j)) {
            if (jv_is_str(item)) *res = json_object_getn(j, json_string_value(item->j), json_string_length(item->j)) != NULL;
            return DF_OK;
        }
    }
    if (cont->k == JV_NS) {
        jns *ns = cont->p;
        for (int i = 0; jv_is_str(item) && i < ns->n; i++)
            if (!strcmp(ns->names[i], json_string_value(item->j))) *res = 1;
        return DF_OK;
    }
    return jerr(c, n, "argument of type '%s' is not iterable", jv_type_name(cont));
}

static df_status eval_compare(jctx *c, jscope *s, const jnode *n, jv *out) {
    jv left = {0}, right = {0};
    df_status st = eval(c, s, n->args[0], &left);
    int ok = 1;
    for (int i = 1; i < n->nargs && !st && ok; i++) {
        if ((st = eval(c, s, n->args[i], &right))) break;
        jop op = n->ops[i - 1];
        int r = 0, cmp;
        switch (op) {
        case JOP_EQ: r = jv_equal(&left, &right); break;
        case JOP_NE: r = !jv_equal(&left, &right); break;
        case JOP_IN:
        case JOP_NOTIN:
            st = op_in(c, n, &left, &right, &r);
            if (op == JOP_NOTIN) r = !r;
            break;
        default:
            st = jop_compare(c, n, &left, &right, &cmp);
            r = op == JOP_LT ? cmp < 0 : op == JOP_LE ? cmp <= 0 : op == JOP_GT ? cmp > 0 : cmp >= 0;
        }
        ok = r;
        jv_release(&left);
        left = right;
        memset(&right, 0, sizeof right);
    }
    jv_release(&left);
    jv_release(&right);
    if (st) return st;
    *out = jv_json(json_boolean(ok));
    return DF_OK;
}

static json_t *make_num(double d, long long i, int is_int) { return is_int ? json_integer(i) : json_real(d); }

static df_status arith(jctx *c, const jnode *n, jop op, const jv *a, const jv *b, jv *out) {
    static const char *opname[] = {[JOP_ADD] = "+", [JOP_SUB] = "-", [JOP_MUL] = "*", [JOP_DIV] = "/",
                                   [JOP_FLOORDIV] = "//", [JOP_MOD] = "%", [JOP_POW] = "**"};
    if (op == JOP_TILDE) {
        jbuf buf = {.limit = c->max_output};
        if (jv_to_str(a, &buf) || jv_to_str(b, &buf)) {
            df_status st = jerr_build(c, n, &buf, 1);
            jbuf_free(&buf);
            return st;
        }
        *out = jv_json(jstr_new(buf.p, buf.n));
        jbuf_free(&buf);
        return out->k == JV_JSON ? DF_OK : jerr_nomem(c);
    }
    if (a->k == JV_UNDEF) return jerr_undef(c, n, a);
    if (b->k == JV_UNDEF) return jerr_undef(c, n, b);
    if (is_num(a) && is_num(b)) {
        double da = 0, db = 0;
        long long ia = 0, ib = 0, r = 0;
        int ta = 0, tb = 0;
        num_of(a, &da, &ia, &ta);
        num_of(b, &db, &ib, &tb);
        int ints = ta && tb;
        json_t *res = NULL;
        switch (op) {
        case JOP_ADD:
            if (ints && !__builtin_add_overflow(ia, ib, &r)) res = json_integer(r);
            else res = json_real(da + db);
            break;
        case JOP_SUB:
            if (ints && !__builtin_sub_overflow(ia, ib, &r)) res = json_integer(r);
            else res = json_real(da - db);
            break;
        case JOP_MUL:
            if (ints && !__builtin_mul_overflow(ia, ib, &r)) res = json_integer(r);
            else res = json_real(da * db);
            break;
        case JOP_DIV:
            if (db == 0) return jerr(c, n, "division by zero");
            res = json_real(da / db);
            break;
        case JOP_FLOORDIV:
        case JOP_MOD:
            if (db == 0) return jerr(c, n, ints ? "integer division or modulo by zero" : "float modulo");
            if (ints && !(ia == INT64_MIN && ib == -1)) {
                long long q = ia / ib, m = ia % ib;
                if (m != 0 && ((m < 0) != (ib < 0))) {
                    q--;
                    m += ib;
                }
                res = json_integer(op == JOP_FLOORDIV ? q : m);
            } else {
                double q = floor(da / db), m = fmod(da, db);
                if (m != 0 && ((m < 0) != (db < 0))) m += db;
                res = json_real(op == JOP_FLOORDIV ? q : m);
            }
            break;
        case JOP_POW:
            if (ints && ib >= 0) {
                long long acc = 1, base = ia, e = ib;
                int of = 0;
                while (e > 0 && !of) {
                    if (e & 1) of |= __builtin_mul_overflow(acc, base, &acc);
                    e >>= 1;
                    if (e) of |= __builtin_mul_overflow(base, base, &base);
                }
                res = of ? json_real(pow(da, db)) : json_integer(acc);
            } else {
                if (da == 0 && db < 0) return jerr(c, n, "0.0 cannot be raised to a negative power");
                res = json_real(pow(da, db));
            }
            break;
        default: break;
        }
        (void)make_num;
        if (!res) return jerr_nomem(c);
        *out = jv_json(res);
        return DF_OK;
    }
    if (a->k == JV_JSON && b->k == JV_JSON) {
        json_t *x = a->j, *y = b->j;
        if (op == JOP_ADD && json_is_string(x) && json_is_string(y)) {
            jbuf buf = {.limit = c->max_output};
            if (jbuf_put(&buf, json_string_value(x), json_string_length(x)) ||
                jbuf_put(&buf, json_string_value(y), json_string_length(y))) {
                df_status st = jerr_build(c, n, &buf, json_string_length(x) + json_string_length(y));
                jbuf_free(&buf);
                return st;
            }
            *out = jv_json(jstr_new(buf.p, buf.n));
            jbuf_free(&buf);
            return out->k == JV_JSON ? DF_OK : jerr_nomem(c);
        }
        if (op == JOP_ADD && json_is_array(x) && json_is_array(y)) {
            json_t *r = json_copy(x);
            if (!r || json_array_extend(r, y)) {
                json_decref(r);
                return jerr_nomem(c);
            }
            *out = jv_json(r);
            return jstep(c, n, json_array_size(r));
        }
        int x_seq = json_is_string(x) || json_is_array(x), y_seq = json_is_string(y) || json_is_array(y);
        int x_int = json_is_integer(x) || json_is_boolean(x), y_int = json_is_integer(y) || json_is_boolean(y);
        if (op == JOP_MUL && ((x_seq && y_int) || (y_seq && x_int))) {
            const json_t *seq = json_is_integer(y) || json_is_boolean(y) ? x : y;
            const json_t *cnt = seq == x ? y : x;
            long long k = json_is_integer(cnt) ? json_integer_value(cnt) : json_is_true(cnt);
            if (k < 0) k = 0;
            if (json_is_string(seq)) {
                size_t sl = json_string_length(seq);
                if (sl && (unsigned long long)k > c->max_output / sl)
                    return df_error_set(c->err, DF_ERR_RANGE,
                                        "template output exceeds the limit of %zu bytes (template line %d, column %d)",
                                        c->max_output, n->line, n->col);
                jbuf buf = {0};
                for (long long i = 0; i < k; i++)
                    if (jbuf_put(&buf, json_string_value(seq), sl)) {
                        jbuf_free(&buf);
                        return jerr_nomem(c);
                    }
                *out = jv_json(jstr_new(buf.p, buf.n));
                jbuf_free(&buf);
                return out->k == JV_JSON ? DF_OK : jerr_nomem(c);
            }
            size_t sl = json_array_size(seq);
            df_status st = jstep(c, n, (uint64_t)k * (sl ? sl : 1));
            if (st) return st;
            json_t *r = json_array();
            for (long long i = 0; r && i < k; i++)
                if (json_array_extend(r, (json_t *)seq)) {
                    json_decref(r);
                    r = NULL;
                }
            if (!r) return jerr_nomem(c);
            *out = jv_json(r);
            return DF_OK;
        }
        if (op == JOP_ADD && (json_is_string(x) || json_is_array(x)))
            return jerr(c, n, "can only concatenate %s (not \"%s\") to %s", jv_type_name(a), jv_type_name(b),
                        jv_type_name(a));
    }
    return jerr(c, n, "unsupported operand type(s) for %s: '%s' and '%s'", opname[op] ? opname[op] : "?",
                jv_type_name(a), jv_type_name(b));
}

/* value | filter(args) or value is [not] test(args) */
static df_status eval_filter_or_test(jctx *c, jscope *s, const jnode *n, jv *out) {
    jv val = {0};
    jargs a;
    df_status st = eval(c, s, n->a, &val);
    if (st) return st;
    if ((st = eval_args(c, s, n, &a))) {
        jv_release(&val);
        return st;
    }
    if (n->kind == JN_FILTER) {
        st = jfilter(c, n, n->name, &val, &a, out);
    } else {
        int r = 0;
        st = jtest(c, n, n->name, &val, &a, &r);
        if (!st) *out = jv_json(json_boolean(n->flag ? !r : r));
    }
    args_free(&a);
    jv_release(&val);
    return st;
}

static df_status eval_container(jctx *c, jscope *s, const jnode *n, jv *out) {
    int is_dict = n->kind == JN_DICT;
    json_t *r = is_dict ? json_object() : json_array();
    if (!r) return jerr_nomem(c);
    df_status st = DF_OK;
    for (int i = 0; i < n->nargs && !st; i++) {
        jv k = {0}, v = {0};
        if ((st = eval(c, s, n->args[i], &k))) break;
        if (is_dict && (st = eval(c, s, n->kwvals[i], &v))) {
            jv_release(&k);
            break;
        }
        jv *item = is_dict ? &v : &k;
        json_t *j = jv_to_json(item, 1);
        if (!j) {
            st = jerr(c, n->args[i], "a %s cannot be stored in a %s", jv_type_name(item), is_dict ? "dict" : "list");
        } else if (is_dict) {
            if (!jv_is_str(&k)) {
                st = jerr(c, n->args[i], "dict keys must be strings, not %s", jv_type_name(&k));
                json_decref(j);
            } else if (json_object_set_new_nocheck(r, json_string_value(k.j), j)) {
                st = jerr_nomem(c);
            }
        } else if (json_array_append_new(r, j)) {
            st = jerr_nomem(c);
        }
        jv_release(&k);
        jv_release(&v);
    }
    if (st) {
        json_decref(r);
        return st;
    }
    *out = jv_json(r);
    return DF_OK;
}

static df_status eval(jctx *c, jscope *s, const jnode *n, jv *out) {
    df_status st = jstep(c, n, 1);
    if (st) return st;
    memset(out, 0, sizeof *out);
    switch (n->kind) {
    case JN_LIT: *out = jv_json(json_incref(n->lit)); return DF_OK;
    case JN_NAME: return lookup_name(c, s, n, out);
    case JN_GETATTR: {
        jv obj;
        if ((st = eval(c, s, n->a, &obj))) return st;
        st = jop_getattr(c, n, &obj, n->name, out);
        jv_release(&obj);
        return st;
    }
    case JN_GETITEM: {
        jv obj, key = {0};
        if ((st = eval(c, s, n->a, &obj))) return st;
        if (!(st = eval(c, s, n->b, &key))) st = getitem(c, n, &obj, &key, out);
        jv_release(&obj);
        jv_release(&key);
        return st;
    }
    case JN_SLICE: return eval_slice(c, s, n, out);
    case JN_CALL: return eval_call(c, s, n, out);
    case JN_FILTER:
    case JN_TEST: return eval_filter_or_test(c, s, n, out);
    case JN_NEG:
    case JN_POS: {
        jv v;
        if ((st = eval(c, s, n->a, &v))) return st;
        if (!is_num(&v)) {
            st = v.k == JV_UNDEF ? jerr_undef(c, n, &v)
                                 : jerr(c, n, "bad operand type for unary %s: '%s'", n->kind == JN_NEG ? "-" : "+",
                                        jv_type_name(&v));
        } else {
            double d;
            long long i;
            int is_int;
            num_of(&v, &d, &i, &is_int);
            if (n->kind == JN_POS) *out = jv_json(is_int ? json_integer(i) : json_real(d));
            else if (is_int && i != INT64_MIN) *out = jv_json(json_integer(-i));
            else *out = jv_json(json_real(-d));
            if (out->k != JV_JSON) st = jerr_nomem(c);
        }
        jv_release(&v);
        return st;
    }
    case JN_NOT: {
        jv v;
        if ((st = eval(c, s, n->a, &v))) return st;
        *out = jv_json(json_boolean(!jv_truthy(&v)));
        jv_release(&v);
        return DF_OK;
    }
    case JN_AND:
    case JN_OR: {
        jv v;
        if ((st = eval(c, s, n->a, &v))) return st;
        int t = jv_truthy(&v);
        if ((n->kind == JN_AND) ? !t : t) {
            *out = v;
            return DF_OK;
        }
        jv_release(&v);
        return eval(c, s, n->b, out);
    }
    case JN_BINOP: {
        jv a, b = {0};
        if ((st = eval(c, s, n->a, &a))) return st;
        if (!(st = eval(c, s, n->b, &b))) st = arith(c, n, n->op, &a, &b, out);
        jv_release(&a);
        jv_release(&b);
        return st;
    }
    case JN_COMPARE: return eval_compare(c, s, n, out);
    case JN_COND: {
        jv v;
        if ((st = eval(c, s, n->a, &v))) return st;
        int t = jv_truthy(&v);
        jv_release(&v);
        if (t) return eval(c, s, n->b, out);
        if (n->c) return eval(c, s, n->c, out);
        *out = jv_undef("the inline if-expression on line %d evaluated to false and no else section was defined.",
                        n->line);
        return DF_OK;
    }
    case JN_LIST:
    case JN_DICT: return eval_container(c, s, n, out);
    default: return jerr(c, n, "internal error: statement used as an expression");
    }
}

/* ---- statements ----------------------------------------------------------------------- */

static df_status out_put(jctx *c, const jnode *n, jbuf *out, const char *p, size_t len) {
    if (jbuf_put(out, p, len)) return jerr_build(c, n, out, len);
    return DF_OK;
}

df_status jop_iterate(jctx *c, const jnode *n, const jv *v, json_t **items) {
    *items = NULL;
    if (v->k == JV_UNDEF) {
        *items = json_array();
    } else if (v->k == JV_JSON && json_is_array(v->j)) {
        *items = json_incref(v->j);
    } else if (v->k == JV_JSON && json_is_object(v->j)) {
        *items = json_array();
        const char *k;
        json_t *val;
        json_object_foreach(v->j, k, val) {
            if (!*items || json_array_append_new(*items, json_string_nocheck(k))) {
                json_decref(*items);
                *items = NULL;
                break;
            }
        }
    } else if (jv_is_str(v)) {
        size_t len;
        const char *str = jv_str(v, &len);
        *items = json_array();
        for (size_t i = 0; i < len && *items;) {
            size_t adv;
            ju8_decode(str + i, len - i, &adv);
            if (json_array_append_new(*items, jstr_new(str + i, adv))) {
                json_decref(*items);
                *items = NULL;
            }
            i += adv;
        }
    } else if (v->k == JV_NS) {
        return jerr(c, n, "'Namespace' object is not iterable");
    } else {
        return jerr(c, n, "'%s' object is not iterable", jv_type_name(v));
    }
    if (!*items) return jerr_nomem(c);
    return jstep(c, n, json_array_size(*items));
}

/* Binds the loop targets in s to item (unpacking when there are several). */
static df_status bind_targets(jctx *c, jscope *s, const jnode *n, const jv *item) {
    if (n->nkw == 1) {
        jv v = jv_copy(item);
        return scope_set(c, s, n->kwnames[0], &v);
    }
    json_t *seq = NULL;
    if (item->k == JV_JSON && json_is_array(item->j)) seq = json_incref(item->j);
    else if (jv_is_str(item) || (item->k == JV_JSON && json_is_object(item->j))) {
        df_status st = jop_iterate(c, n, item, &seq);
        if (st) return st;
    } else {
        return jerr(c, n, "cannot unpack non-iterable %s object", jv_type_name(item));
    }
    size_t len = json_array_size(seq);
    if (len != (size_t)n->nkw) {
        json_decref(seq);
        if (len > (size_t)n->nkw) return jerr(c, n, "too many values to unpack (expected %d)", n->nkw);
        return jerr(c, n, "not enough values to unpack (expected %d, got %zu)", n->nkw, len);
    }
    df_status st = DF_OK;
    for (int i = 0; i < n->nkw && !st; i++) {
        jv v = jv_json(json_incref(json_array_get(seq, (size_t)i)));
        st = scope_set(c, s, n->kwnames[i], &v);
    }
    json_decref(seq);
    return st;
}

static df_status exec_for(jctx *c, jscope *s, const jnode *n, jbuf *out) {
    jv it;
    json_t *items = NULL;
    df_status st = eval(c, s, n->a, &it);
    if (st) return st;
    st = jop_iterate(c, n->a, &it, &items);
    jv_release(&it);
    if (st) return st;
    if (n->b) { /* {% for x in xs if cond %}: filter first, so loop.length counts the kept items */
        json_t *kept = json_array();
        if (!kept) st = jerr_nomem(c);
        for (size_t i = 0; !st && i < json_array_size(items); i++) {
            jscope fs = {.parent = s};
            jv item = jv_json(json_incref(json_array_get(items, i))), cond = {0};
            if (!(st = bind_targets(c, &fs, n, &item)) && !(st = eval(c, &fs, n->b, &cond)) && jv_truthy(&cond) &&
                json_array_append(kept, item.j))
                st = jerr_nomem(c);
            jv_release(&item);
            jv_release(&cond);
            scope_clear(&fs);
        }
        json_decref(items);
        if (st) {
            json_decref(kept);
            return st;
        }
        items = kept;
    }
    jloop loop = {.items = items, .n = json_array_size(items)};
    for (loop.i = 0; loop.i < loop.n && !st; loop.i++) {
        jscope is = {.parent = s};
        jv item = jv_json(json_incref(json_array_get(items, loop.i)));
        jv lv = {.k = JV_LOOP, .p = &loop};
        if (!(st = jstep(c, n, 1)) && !(st = bind_targets(c, &is, n, &item)) && !(st = scope_set(c, &is, "loop", &lv)))
            st = exec_body(c, &is, n->body, n->nbody, out);
        jv_release(&item);
        scope_clear(&is);
        if (c->ctl == 1) {
            c->ctl = 0;
            break;
        }
        c->ctl = 0;
    }
    if (!st && loop.n == 0 && n->nelse) {
        jscope es = {.parent = s};
        st = exec_body(c, &es, n->else_body, n->nelse, out);
        scope_clear(&es);
    }
    json_decref(items);
    return st;
}

static df_status exec_set(jctx *c, jscope *s, const jnode *n) {
    jv v;
    df_status st = eval(c, s, n->a, &v);
    if (st) return st;
    if (n->attr) {
        jv *target = scope_find(s, n->kwnames[0]);
        if (!target || target->k != JV_NS) {
            jv_release(&v);
            return jerr(c, n, "cannot assign attribute on non-namespace object");
        }
        st = jns_set(c, n, target->p, n->attr, &v);
        jv_release(&v);
        return st;
    }
    if (n->nkw == 1) return scope_set(c, s, n->kwnames[0], &v);
    st = bind_targets(c, s, n, &v);
    jv_release(&v);
    return st;
}

static df_status exec_stmt(jctx *c, jscope *s, const jnode *n, jbuf *out) {
    df_status st = jstep(c, n, 1);
    if (st) return st;
    switch (n->kind) {
    case JN_TEXT: return out_put(c, n, out, n->name, n->name_len);
    case JN_OUTPUT: {
        jv v;
        if ((st = eval(c, s, n->a, &v))) return st;
        size_t before = out->n;
        if (jv_to_str(&v, out)) st = jerr_build(c, n, out, 1);
        (void)before;
        jv_release(&v);
        return st;
    }
    case JN_IF: {
        jv v;
        if ((st = eval(c, s, n->a, &v))) return st;
        int t = jv_truthy(&v);
        jv_release(&v);
        return t ? exec_body(c, s, n->body, n->nbody, out) : exec_body(c, s, n->else_body, n->nelse, out);
    }
    case JN_FOR: return exec_for(c, s, n, out);
    case JN_SET: return exec_set(c, s, n);
    case JN_SETBLOCK: {
        jbuf b = {.limit = c->max_output};
        jscope bs = {.parent = s};
        st = exec_body(c, &bs, n->body, n->nbody, &b);
        scope_clear(&bs);
        if (!st) {
            jv v = jv_json(jstr_new(b.p, b.n));
            st = v.k == JV_JSON ? scope_set(c, s, n->name, &v) : jerr_nomem(c);
        }
        jbuf_free(&b);
        return st;
    }
    case JN_MACRO: {
        jv v = {.k = JV_MACRO, .p = (void *)n};
        return scope_set(c, s, n->name, &v);
    }
    case JN_BREAK: c->ctl = 1; return DF_OK;
    case JN_CONTINUE: c->ctl = 2; return DF_OK;
    case JN_BLOCK: return exec_body(c, s, n->body, n->nbody, out);
    default: return jerr(c, n, "internal error: expression used as a statement");
    }
}

static df_status exec_body(jctx *c, jscope *s, jnode *const *body, int nbody, jbuf *out) {
    for (int i = 0; i < nbody; i++) {
        df_status st = exec_stmt(c, s, body[i], out);
        if (st) return st;
        if (c->ctl) return DF_OK;
    }
    return DF_OK;
}

/* ---- public API ----------------------------------------------------------------------- */

void df_jinja_free(df_jinja_template *t) {
    if (!t) return;
    for (size_t i = 0; i < t->nlits; i++) json_decref(t->lits[i]);
    free(t->lits);
    jarena_free(&t->arena);
    free(t);
}

df_status df_jinja_parse(const char *src, size_t len, df_jinja_template **out, df_error *err) {
    *out = NULL;
    if (!src && len) return df_error_set(err, DF_ERR_INVALID_ARG, "template text is NULL");
    size_t bad = ju8_invalid_at(src ? src : "", len);
    if (bad < len) return df_error_set(err, DF_ERR_FORMAT, "template is not valid UTF-8 (byte %zu)", bad);
    df_jinja_template *t = calloc(1, sizeof *t);
    if (!t) return df_error_set(err, DF_ERR_NOMEM, "out of memory parsing template");
    /* Jinja2 normalises \r\n and \r to \n and drops one trailing newline. */
    char *norm = jarena_alloc(&t->arena, len + 1);
    if (!norm) {
        df_jinja_free(t);
        return df_error_set(err, DF_ERR_NOMEM, "out of memory parsing template");
    }
    size_t k = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[k++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            norm[k++] = src[i];
        }
    }
    if (k && norm[k - 1] == '\n') k--;
    norm[k] = 0;
    jtok *toks = NULL;
    size_t ntok = 0;
    df_status st = jlex(&t->arena, norm, k, &toks, &ntok, err);
    if (!st) st = jparse(t, toks, ntok, err);
    free(toks);
    if (st) {
        df_jinja_free(t);
        return st;
    }
    *out = t;
    return DF_OK;
}

df_status df_jinja_render(const df_jinja_template *t, const json_t *vars, const df_jinja_limits *limits,
                          char **out, size_t *out_len, df_error *err) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (!t) return df_error_set(err, DF_ERR_INVALID_ARG, "template is NULL");
    if (vars && !json_is_object(vars)) return df_error_set(err, DF_ERR_INVALID_ARG, "template variables must be a JSON object");
    jscope root = {0};
    jctx c = {.t = t, .vars = vars, .root = &root, .err = err};
    c.max_output = limits && limits->max_output ? limits->max_output : DF_JINJA_DEFAULT_MAX_OUTPUT;
    c.max_steps = limits && limits->max_steps ? limits->max_steps : DF_JINJA_DEFAULT_MAX_STEPS;
    c.max_depth = limits && limits->max_depth > 0 ? limits->max_depth : DF_JINJA_DEFAULT_MAX_DEPTH;
    jbuf b = {.limit = c.max_output};
    df_status st = exec_body(&c, &root, t->body, t->nbody, &b);
    scope_clear(&root);
    if (st) {
        jbuf_free(&b);
        return st;
    }
    *out = jbuf_take(&b, out_len);
    if (!*out) return df_error_set(err, DF_ERR_NOMEM, "out of memory rendering template");
    return DF_OK;
}

/* ---- content-list detection ----------------------------------------------------------- */

static int names_content(const jnode *e) {
    if (!e) return 0;
    if (e->kind == JN_NAME || e->kind == JN_GETATTR) return !strcmp(e->name, "content");
    if (e->kind == JN_GETITEM && e->b && e->b->kind == JN_LIT && json_is_string(e->b->lit))
        return !strcmp(json_string_value(e->b->lit), "content");
    return 0;
}

static int walk_content(const jnode *n, int depth) {
    if (!n || depth > 400) return 0;
    if (n->kind == JN_FOR && names_content(n->a)) return 1;
    if (n->kind == JN_TEST && names_content(n->a)) {
        static const char *tests[] = {"string", "iterable", "sequence", "mapping"};
        for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
            if (!strcmp(n->name, tests[i])) return 1;
    }
    const jnode *kids[] = {n->a, n->b, n->c, n->d};
    for (size_t i = 0; i < 4; i++)
        if (walk_content(kids[i], depth + 1)) return 1;
    for (int i = 0; n->args && i < n->nargs; i++)
        if (walk_content(n->args[i], depth + 1)) return 1;
    for (int i = 0; n->kwvals && i < n->nkw; i++)
        if (walk_content(n->kwvals[i], depth + 1)) return 1;
    for (int i = 0; i < n->nbody; i++)
        if (walk_content(n->body[i], depth + 1)) return 1;
    for (int i = 0; i < n->nelse; i++)
        if (walk_content(n->else_body[i], depth + 1)) return 1;
    return 0;
}

int df_jinja_handles_content_lists(const df_jinja_template *t) {
    if (!t) return 0;
    for (int i = 0; i < t->nbody; i++)
        if (walk_content(t->body[i], 0)) return 1;
    return 0;
}
