/* Run-time values and context of the Jinja2 evaluator, shared by jinja_eval.c (statements,
 * expressions, operators) and jinja_builtins.c (filters, tests, methods, globals). Private. */
#ifndef DF_TEXT_JINJA_EVAL_H
#define DF_TEXT_JINJA_EVAL_H

#include "text/jinja_ast.h"

/* A value. JSON values (strings, numbers, booleans, None = JSON null, lists = arrays,
 * dicts = objects) are jansson values; the other kinds exist only while rendering. */
typedef enum jv_kind {
    JV_UNDEF, /* j: the message Jinja2's UndefinedError would give (a JSON string), or NULL */
    JV_JSON,  /* j: the value (owned reference) */
    JV_MACRO, /* p: the JN_MACRO node */
    JV_NS,    /* p: a jns (reference counted) */
    JV_LOOP,  /* p: the jloop of the enclosing for (lives on the C stack of that loop) */
    JV_FUNC   /* fn: a jfn; j: the bound object of a method (owned, may be NULL); p: jloop for cycle */
} jv_kind;

typedef struct jv {
    jv_kind k;
    int fn;
    json_t *j;
    void *p;
} jv;

typedef struct jns {
    int refs;
    int n, cap;
    char **names;
    jv *vals;
} jns;

typedef struct jloop {
    json_t *items; /* the iterated values (an array) */
    size_t i, n;
} jloop;

typedef struct jscope {
    struct jscope *parent;
    int n, cap;
    const char **names;
    jv *vals;
} jscope;

typedef struct jctx {
    const df_jinja_template *t;
    const json_t *vars;
    jscope *root;
    df_error *err;
    uint64_t steps, max_steps;
    size_t max_output;
    int depth, max_depth;
    int ctl; /* pending loop control: 0 none, 1 break, 2 continue */
} jctx;

/* Built-in callables. */
typedef enum jfn {
    JF_RANGE = 1, JF_NAMESPACE, JF_RAISE, JF_DICT, JF_STRFTIME,
    /* str methods */
    JF_STARTSWITH, JF_ENDSWITH, JF_SPLIT, JF_RSPLIT, JF_STRIP, JF_LSTRIP, JF_RSTRIP, JF_UPPER, JF_LOWER,
    JF_TITLE, JF_CAPITALIZE, JF_REPLACE, JF_JOIN, JF_FIND, JF_COUNT, JF_SPLITLINES, JF_ISDIGIT, JF_ISALPHA,
    JF_ISSPACE,
    /* dict methods */
    JF_ITEMS, JF_KEYS, JF_VALUES, JF_GET, JF_COPY,
    /* loop.cycle */
    JF_CYCLE
} jfn;

/* Arguments of a call, filter or test (values evaluated). */
typedef struct jargs {
    jv *pos;
    int npos;
    const char **kwn;
    jv *kwv;
    int nkw;
} jargs;

/* ---- values (jinja_eval.c) ---- */
jv jv_json(json_t *owned);       /* NULL (allocation failure) gives JV_UNDEF with no message */
jv jv_undef(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
jv jv_copy(const jv *v);
void jv_release(jv *v);
int jv_truthy(const jv *v);
int jv_is_str(const jv *v);
const char *jv_str(const jv *v, size_t *n); /* string contents of a JSON string value */
/* Python's type name ("str", "int", "NoneType", ...) and Jinja2's object_type_repr. */
const char *jv_type_name(const jv *v);
/* Appends Python's str(v) to b (undefined: nothing). -1 when b is full or memory ran out. */
int jv_to_str(const jv *v, jbuf *b);
/* A JSON copy of v for storing in a list/dict/namespace or serialising. Undefined becomes
 * null when undef_ok, else NULL; a loop becomes a snapshot object; other kinds give NULL. */
json_t *jv_to_json(const jv *v, int undef_ok);
int jv_equal(const jv *a, const jv *b);

/* ---- errors (jinja_eval.c) ---- */
/* A template run-time error at node n: "<msg> (template line L, column C)". */
df_status jerr(jctx *c, const jnode *n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The UndefinedError of using undefined value v at node n. */
df_status jerr_undef(jctx *c, const jnode *n, const jv *v);
df_status jerr_nomem(jctx *c);
/* A string being built (b, with limit = max output) could not grow: range or memory error. */
df_status jerr_build(jctx *c, const jnode *n, const jbuf *b, size_t adding);

/* ---- operations shared with builtins (jinja_eval.c) ---- */
df_status jop_getattr(jctx *c, const jnode *n, const jv *obj, const char *name, jv *out);
df_status jop_compare(jctx *c, const jnode *n, const jv *a, const jv *b, int *cmp);
/* Materialises an iterable as a JSON array (list: itself; dict: keys; str: characters;
 * undefined: empty). */
df_status jop_iterate(jctx *c, const jnode *n, const jv *v, json_t **items);
df_status jcall_macro(jctx *c, const jnode *call, const jnode *macro, jargs *a, jv *out);
df_status jstep(jctx *c, const jnode *n, uint64_t k);
json_t *jstr_new(const char *s, size_t n);

/* ---- builtins (jinja_builtins.c) ---- */
df_status jfilter(jctx *c, const jnode *n, const char *name, jv *val, jargs *a, jv *out);
df_status jtest(jctx *c, const jnode *n, const char *name, const jv *val, jargs *a, int *out);
df_status jcall_builtin(jctx *c, const jnode *n, const jv *fnv, jargs *a, jv *out);
/* The method `name` of a JSON value (string or dict), or 0. */
int jmethod_lookup(const json_t *self, const char *name);
/* A global function by name (range, namespace, ...), or 0. */
int jglobal_lookup(const char *name);
void jns_release(jns *ns);
/* ns.name = v (a copy; loops are stored as snapshots; namespaces cannot nest). */
df_status jns_set(jctx *c, const jnode *n, jns *ns, const char *name, const jv *v);

#endif
