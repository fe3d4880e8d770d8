/* Tokens and syntax tree of the Jinja2 engine (lexer -> parser -> evaluator). Private. */
#ifndef DF_TEXT_JINJA_AST_H
#define DF_TEXT_JINJA_AST_H

#include "text/jinja_internal.h"

/* ---- tokens --------------------------------------------------------------------------- */

typedef enum jtok_type {
    JT_EOF,
    JT_DATA,        /* template text between tags (whitespace control already applied) */
    JT_VAR_BEGIN,   /* {{ */
    JT_VAR_END,     /* }} */
    JT_BLOCK_BEGIN, /* {% */
    JT_BLOCK_END,   /* %} */
    JT_NAME,
    JT_STRING, /* decoded string literal */
    JT_INT,
    JT_FLOAT,
    JT_OP
} jtok_type;

typedef enum jop {
    JOP_NONE,
    JOP_ADD, JOP_SUB, JOP_MUL, JOP_DIV, JOP_FLOORDIV, JOP_MOD, JOP_POW, JOP_TILDE,
    JOP_LBRACKET, JOP_RBRACKET, JOP_LPAREN, JOP_RPAREN, JOP_LBRACE, JOP_RBRACE,
    JOP_EQ, JOP_NE, JOP_LT, JOP_LE, JOP_GT, JOP_GE, JOP_ASSIGN, JOP_DOT, JOP_COLON,
    JOP_PIPE, JOP_COMMA, JOP_SEMI,
    /* comparison operators that only appear in the tree */
    JOP_IN, JOP_NOTIN
} jop;

typedef struct jtok {
    jtok_type type;
    jop op;
    const char *s; /* DATA/NAME/STRING text (arena copy), NUL-terminated */
    size_t n;
    long long i;
    double d;
    int line, col;
} jtok;

/* Splits src into tokens (a malloc'd array ending with JT_EOF; the caller frees it; token
 * strings live in the arena). On error fills err
 * (DF_ERR_FORMAT with line/column) and returns its status. */
df_status jlex(jarena *a, const char *src, size_t len, jtok **out, size_t *n_out, df_error *err);

/* ---- syntax tree ---------------------------------------------------------------------- */

typedef enum jnode_kind {
    /* expressions */
    JN_LIT,     /* lit */
    JN_NAME,    /* name */
    JN_GETATTR, /* a.name */
    JN_GETITEM, /* a[b] */
    JN_SLICE,   /* a[b:c:d], each of b, c, d may be NULL */
    JN_CALL,    /* a(args, kw=...) */
    JN_FILTER,  /* a | name(args, kw=...) */
    JN_TEST,    /* a is [not] name(args); flag = negated */
    JN_NEG, JN_POS, JN_NOT,
    JN_BINOP,   /* a op b (arithmetic, ~) */
    JN_AND, JN_OR,
    JN_COMPARE, /* args[0] ops[0] args[1] ops[1] args[2] ... */
    JN_COND,    /* b if a else c (c may be NULL) */
    JN_LIST,    /* [args] or (args,) */
    JN_DICT,    /* {args[i]: kwvals[i]} */
    /* statements */
    JN_TEXT,    /* name (n bytes) */
    JN_OUTPUT,  /* {{ a }} */
    JN_IF,      /* if a: body else: else_body (elif = an IF alone in else_body) */
    JN_FOR,     /* for targets in a [if b]: body else: else_body */
    JN_SET,     /* targets = a; or name.attr = a (attr != NULL) */
    JN_SETBLOCK,/* {% set name %}body{% endset %} */
    JN_MACRO,   /* name(params = kwnames, defaults = kwvals) body */
    JN_BREAK, JN_CONTINUE,
    JN_BLOCK    /* body rendered as is ({% generation %}) */
} jnode_kind;

typedef struct jnode jnode;
struct jnode {
    jnode_kind kind;
    int line, col;
    jop op;
    int flag;
    const char *name;
    size_t name_len;
    const char *attr;
    json_t *lit;
    jnode *a, *b, *c, *d;
    jnode **args; /* positional arguments / list items / dict keys / compare operands */
    int nargs;
    jop *ops;     /* JN_COMPARE operators (nargs - 1) */
    const char **kwnames; /* keyword names / macro parameters / for and set targets */
    jnode **kwvals;       /* keyword values / macro defaults (entries may be NULL) / dict values */
    int nkw;
    jnode **body, **else_body;
    int nbody, nelse;
};

struct df_jinja_template {
    jarena arena;
    jnode **body;
    int nbody;
    json_t **lits; /* literal values owned by the template */
    size_t nlits, caplits;
};

/* Builds the tree of a token stream into t. */
df_status jparse(df_jinja_template *t, const jtok *toks, size_t ntok, df_error *err);

#endif
