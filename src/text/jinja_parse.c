/* Jinja2 parser: tokens -> syntax tree (see jinja_ast.h). The grammar and operator
 * precedence follow Jinja2 3.1's parser (loosest first): conditional expression, or, and,
 * not, comparisons (chained; in, not in), + -, ~, * / // %, **, unary - +, then primaries
 * with postfix attribute/subscript/call and filter (|) / test (is) chains. */
#include <stdlib.h>
#include <string.h>

#include "text/jinja_ast.h"

#define MAX_NESTING 200

typedef struct parser {
    df_jinja_template *t;
    const jtok *tk;
    size_t n, i;
    df_error *err;
    int depth;
} parser;

/* A growable array of pointers, copied into the arena when done. */
typedef struct pvec {
    void **v;
    int n, cap;
} pvec;

static int pvec_push(pvec *p, void *x) {
    if (p->n == p->cap) {
        int cap = p->cap ? p->cap * 2 : 8;
        void **v = realloc(p->v, (size_t)cap * sizeof *v);
        if (!v) return -1;
        p->v = v;
        p->cap = cap;
    }
    p->v[p->n++] = x;
    return 0;
}

static void **pvec_finish(parser *P, pvec *p) {
    void **out = jarena_alloc(&P->t->arena, (size_t)(p->n ? p->n : 1) * sizeof *out);
    if (out && p->n) memcpy(out, p->v, (size_t)p->n * sizeof *out);
    free(p->v);
    p->v = NULL;
    p->cap = 0;
    return out;
}

static const jtok *cur(parser *P) { return &P->tk[P->i]; }
static const jtok *peek(parser *P, size_t k) { return &P->tk[P->i + k < P->n ? P->i + k : P->n - 1]; }
static void adv(parser *P) {
    if (P->i + 1 < P->n) P->i++;
}

static const char *op_text(jop op) {
    static const char *names[] = {"",  "+", "-", "*", "/", "//", "%", "**", "~", "[", "]", "(", ")", "{", "}",
                                  "==", "!=", "<", "<=", ">", ">=", "=", ".", ":", "|", ",", ";", "in", "not in"};
    return (size_t)op < sizeof names / sizeof names[0] ? names[op] : "?";
}

static df_status perr(parser *P, const jtok *t, const char *fmt, const char *arg) {
    char what[200];
    snprintf(what, sizeof what, fmt, arg ? arg : "");
    return df_error_set(P->err, DF_ERR_FORMAT, "template syntax error at line %d, column %d: %s", t->line, t->col,
                        what);
}

static const char *tok_desc(const jtok *t, char *buf, size_t cap) {
    switch (t->type) {
    case JT_EOF: return "end of template";
    case JT_DATA: return "template text";
    case JT_VAR_BEGIN: return "'{{'";
    case JT_VAR_END: return "'}}'";
    case JT_BLOCK_BEGIN: return "'{%'";
    case JT_BLOCK_END: return "'%}'";
    case JT_NAME: snprintf(buf, cap, "'%.60s'", t->s); return buf;
    case JT_STRING: return "string literal";
    case JT_INT:
    case JT_FLOAT: return "number";
    case JT_OP: snprintf(buf, cap, "'%s'", op_text(t->op)); return buf;
    }
    return "token";
}

static df_status unexpected(parser *P, const char *expected) {
    char buf[96], msg[200];
    const jtok *t = cur(P);
    snprintf(msg, sizeof msg, "unexpected %s%s%s", tok_desc(t, buf, sizeof buf), expected ? ", expected " : "",
             expected ? expected : "");
    return perr(P, t, "%s", msg);
}

#define NOMEM(P) df_error_set((P)->err, DF_ERR_NOMEM, "out of memory parsing template")

static jnode *node(parser *P, jnode_kind kind, const jtok *at) {
    jnode *n = jarena_alloc(&P->t->arena, sizeof *n);
    if (n) {
        n->kind = kind;
        n->line = at->line;
        n->col = at->col;
    }
    return n;
}

static int is_op(parser *P, jop op) { return cur(P)->type == JT_OP && cur(P)->op == op; }
static int is_name(const jtok *t, const char *name) { return t->type == JT_NAME && strcmp(t->s, name) == 0; }

static df_status expect_op(parser *P, jop op) {
    if (!is_op(P, op)) {
        char e[16];
        snprintf(e, sizeof e, "'%s'", op_text(op));
        return unexpected(P, e);
    }
    adv(P);
    return DF_OK;
}

static df_status keep_lit(parser *P, json_t *v) {
    df_jinja_template *t = P->t;
    if (!v) return NOMEM(P);
    if (t->nlits == t->caplits) {
        size_t cap = t->caplits ? t->caplits * 2 : 32;
        json_t **l = realloc(t->lits, cap * sizeof *l);
        if (!l) {
            json_decref(v);
            return NOMEM(P);
        }
        t->lits = l;
        t->caplits = cap;
    }
    t->lits[t->nlits++] = v;
    return DF_OK;
}

static df_status lit_node(parser *P, const jtok *at, json_t *v, jnode **out) {
    df_status st = keep_lit(P, v);
    if (st) return st;
    jnode *n = node(P, JN_LIT, at);
    if (!n) return NOMEM(P);
    n->lit = v;
    *out = n;
    return DF_OK;
}

static df_status parse_expr(parser *P, int with_cond, jnode **out);
static df_status parse_tuple(parser *P, int with_cond, int explicit_parens, jnode **out);
static df_status parse_unary(parser *P, int with_filter, jnode **out);
static df_status parse_or(parser *P, jnode **out);

/* (args, kw=value) after the '(' token */
static df_status parse_call_args(parser *P, jnode *n) {
    pvec args = {0}, kwn = {0}, kwv = {0};
    df_status st = DF_OK;
    adv(P); /* ( */
    while (!is_op(P, JOP_RPAREN)) {
        if (args.n + kwn.n > 0 && (st = expect_op(P, JOP_COMMA))) goto done;
        if (is_op(P, JOP_RPAREN)) break;
        if (is_op(P, JOP_MUL) || is_op(P, JOP_POW)) {
            st = perr(P, cur(P), "%s", "*args and **kwargs are not supported");
            goto done;
        }
        if (cur(P)->type == JT_NAME && peek(P, 1)->type == JT_OP && peek(P, 1)->op == JOP_ASSIGN) {
            const char *name = cur(P)->s;
            adv(P);
            adv(P);
            jnode *v;
            if ((st = parse_expr(P, 1, &v))) goto done;
            if (pvec_push(&kwn, (void *)name) || pvec_push(&kwv, v)) goto oom;
        } else {
            if (kwn.n) {
                st = perr(P, cur(P), "%s", "positional argument follows keyword argument");
                goto done;
            }
            jnode *v;
            if ((st = parse_expr(P, 1, &v))) goto done;
            if (pvec_push(&args, v)) goto oom;
        }
    }
    adv(P); /* ) */
    n->nargs = args.n;
    n->nkw = kwn.n;
    if (!(n->args = (jnode **)pvec_finish(P, &args)) || !(n->kwnames = (const char **)pvec_finish(P, &kwn)) ||
        !(n->kwvals = (jnode **)pvec_finish(P, &kwv)))
        goto oom;
    return DF_OK;
oom:
    st = NOMEM(P);
done:
    free(args.v);
    free(kwn.v);
    free(kwv.v);
    return st;
}

static df_status parse_primary(parser *P, jnode **out) {
    const jtok *t = cur(P);
    df_status st;
    if (++P->depth > MAX_NESTING) return perr(P, t, "%s", "expression nested too deeply");
    switch (t->type) {
    case JT_NAME: {
        adv(P);
        if (!strcmp(t->s, "true") || !strcmp(t->s, "True")) return lit_node(P, t, json_true(), out);
        if (!strcmp(t->s, "false") || !strcmp(t->s, "False")) return lit_node(P, t, json_false(), out);
        if (!strcmp(t->s, "none") || !strcmp(t->s, "None")) return lit_node(P, t, json_null(), out);
        jnode *n = node(P, JN_NAME, t);
        if (!n) return NOMEM(P);
        n->name = t->s;
        *out = n;
        return DF_OK;
    }
    case JT_STRING: {
        jbuf b = {0};
        while (cur(P)->type == JT_STRING) {
            if (jbuf_put(&b, cur(P)->s, cur(P)->n)) {
                jbuf_free(&b);
                return NOMEM(P);
            }
            adv(P);
        }
        json_t *v = json_stringn_nocheck(b.p ? b.p : "", b.n);
        jbuf_free(&b);
        return lit_node(P, t, v, out);
    }
    case JT_INT: adv(P); return lit_node(P, t, json_integer(t->i), out);
    case JT_FLOAT: adv(P); return lit_node(P, t, json_real(t->d), out);
    case JT_OP:
        if (t->op == JOP_LPAREN) {
            adv(P);
            if (is_op(P, JOP_RPAREN)) {
                adv(P);
                jnode *n = node(P, JN_LIST, t);
                if (!n || !(n->args = jarena_alloc(&P->t->arena, sizeof(jnode *)))) return NOMEM(P);
                n->flag = 1;
                *out = n;
                return DF_OK;
            }
            if ((st = parse_tuple(P, 1, 1, out))) return st;
            return expect_op(P, JOP_RPAREN);
        }
        if (t->op == JOP_LBRACKET || t->op == JOP_LBRACE) {
            int is_dict = t->op == JOP_LBRACE;
            jop close = is_dict ? JOP_RBRACE : JOP_RBRACKET;
            pvec items = {0}, vals = {0};
            adv(P);
            st = DF_OK;
            while (!is_op(P, close)) {
                if (items.n && (st = expect_op(P, JOP_COMMA))) break;
                if (is_op(P, close)) break;
                jnode *k, *v = NULL;
                if ((st = parse_expr(P, 1, &k))) break;
                if (is_dict) {
                    if ((st = expect_op(P, JOP_COLON)) || (st = parse_expr(P, 1, &v))) break;
                    if (pvec_push(&vals, v)) {
                        st = NOMEM(P);
                        break;
                    }
                }
                if (pvec_push(&items, k)) {
                    st = NOMEM(P);
                    break;
                }
            }
            if (st) {
                free(items.v);
                free(vals.v);
                return st;
            }
            adv(P);
            jnode *n = node(P, is_dict ? JN_DICT : JN_LIST, t);
            if (!n) {
                free(items.v);
                free(vals.v);
                return NOMEM(P);
            }
            n->nargs = items.n;
            n->nkw = vals.n;
            n->args = (jnode **)pvec_finish(P, &items);
            n->kwvals = (jnode **)pvec_finish(P, &vals);
            if (!n->args || !n->kwvals) return NOMEM(P);
            *out = n;
            return DF_OK;
        }
        break;
    default: break;
    }
    return unexpected(P, "an expression");
}

static df_status parse_subscript(parser *P, jnode *obj, jnode **out) {
    const jtok *t = cur(P);
    df_status st;
    adv(P); /* [ */
    jnode *a = NULL, *b = NULL, *c = NULL;
    int is_slice = 0;
    if (!is_op(P, JOP_COLON) && (st = parse_expr(P, 1, &a))) return st;
    if (is_op(P, JOP_COLON)) {
        is_slice = 1;
        adv(P);
        if (!is_op(P, JOP_COLON) && !is_op(P, JOP_RBRACKET) && (st = parse_expr(P, 1, &b))) return st;
        if (is_op(P, JOP_COLON)) {
            adv(P);
            if (!is_op(P, JOP_RBRACKET) && (st = parse_expr(P, 1, &c))) return st;
        }
    }
    if ((st = expect_op(P, JOP_RBRACKET))) return st;
    jnode *n = node(P, is_slice ? JN_SLICE : JN_GETITEM, t);
    if (!n) return NOMEM(P);
    n->a = obj;
    if (is_slice) {
        n->b = a;
        n->c = b;
        n->d = c;
    } else {
        n->b = a;
    }
    *out = n;
    return DF_OK;
}

/* *io ( args ) */
static df_status parse_call(parser *P, const jtok *t, jnode **io) {
    jnode *n = node(P, JN_CALL, t);
    if (!n) return NOMEM(P);
    n->a = *io;
    df_status st = parse_call_args(P, n);
    if (!st) *io = n;
    return st;
}

static df_status parse_postfix(parser *P, jnode **io) {
    df_status st;
    for (;;) {
        const jtok *t = cur(P);
        if (is_op(P, JOP_DOT)) {
            adv(P);
            const jtok *nt = cur(P);
            if (nt->type == JT_NAME) {
                jnode *n = node(P, JN_GETATTR, t);
                if (!n) return NOMEM(P);
                n->a = *io;
                n->name = nt->s;
                adv(P);
                *io = n;
            } else if (nt->type == JT_INT) {
                jnode *n = node(P, JN_GETITEM, t), *k;
                if (!n) return NOMEM(P);
                adv(P);
                if ((st = lit_node(P, nt, json_integer(nt->i), &k))) return st;
                n->a = *io;
                n->b = k;
                *io = n;
            } else {
                return unexpected(P, "an attribute name");
            }
        } else if (is_op(P, JOP_LBRACKET)) {
            if ((st = parse_subscript(P, *io, io))) return st;
        } else if (is_op(P, JOP_LPAREN)) {
            if ((st = parse_call(P, t, io))) return st;
        } else {
            return DF_OK;
        }
    }
}

static int starts_test_arg(parser *P) {
    const jtok *t = cur(P);
    if (t->type == JT_STRING || t->type == JT_INT || t->type == JT_FLOAT) return 1;
    if (t->type == JT_OP) return t->op == JOP_LBRACKET || t->op == JOP_LBRACE;
    if (t->type == JT_NAME) {
        static const char *kw[] = {"else", "or", "and", "if", "in", "not", "is"};
        for (size_t i = 0; i < sizeof kw / sizeof kw[0]; i++)
            if (!strcmp(t->s, kw[i])) return 0;
        return 1;
    }
    return 0;
}

static df_status parse_filter_expr(parser *P, jnode **io) {
    df_status st;
    for (;;) {
        const jtok *t = cur(P);
        if (is_op(P, JOP_PIPE)) {
            adv(P);
            if (cur(P)->type != JT_NAME) return unexpected(P, "a filter name");
            jnode *n = node(P, JN_FILTER, cur(P));
            if (!n) return NOMEM(P);
            n->name = cur(P)->s;
            n->a = *io;
            adv(P);
            /* dotted filter names (Jinja2 accepts them; none exists here, so they fail when run) */
            while (is_op(P, JOP_DOT) && peek(P, 1)->type == JT_NAME) {
                size_t a = strlen(n->name), b = peek(P, 1)->n;
                char *nm = jarena_alloc(&P->t->arena, a + b + 2);
                if (!nm) return NOMEM(P);
                memcpy(nm, n->name, a);
                nm[a] = '.';
                memcpy(nm + a + 1, peek(P, 1)->s, b + 1);
                n->name = nm;
                adv(P);
                adv(P);
            }
            if (is_op(P, JOP_LPAREN) && (st = parse_call_args(P, n))) return st;
            if (!n->args && !(n->args = jarena_alloc(&P->t->arena, sizeof(jnode *)))) return NOMEM(P);
            *io = n;
        } else if (is_name(t, "is")) {
            adv(P);
            int neg = 0;
            if (is_name(cur(P), "not")) {
                neg = 1;
                adv(P);
            }
            const jtok *nt = cur(P);
            const char *name;
            if (nt->type == JT_NAME) name = nt->s;
            else if (nt->type == JT_OP && (nt->op == JOP_EQ || nt->op == JOP_NE || nt->op == JOP_LT ||
                                           nt->op == JOP_LE || nt->op == JOP_GT || nt->op == JOP_GE))
                name = op_text(nt->op);
            else return unexpected(P, "a test name");
            jnode *n = node(P, JN_TEST, nt);
            if (!n) return NOMEM(P);
            n->name = name;
            n->flag = neg;
            n->a = *io;
            adv(P);
            if (is_op(P, JOP_LPAREN)) {
                if ((st = parse_call_args(P, n))) return st;
            } else if (starts_test_arg(P)) {
                jnode *arg;
                if ((st = parse_primary(P, &arg))) return st;
                P->depth--;
                if ((st = parse_postfix(P, &arg))) return st;
                if (!(n->args = jarena_alloc(&P->t->arena, sizeof(jnode *)))) return NOMEM(P);
                n->args[0] = arg;
                n->nargs = 1;
            }
            if (!n->args && !(n->args = jarena_alloc(&P->t->arena, sizeof(jnode *)))) return NOMEM(P);
            *io = n;
        } else if (is_op(P, JOP_LPAREN)) {
            if ((st = parse_call(P, t, io))) return st;
        } else {
            return DF_OK;
        }
    }
}

static df_status parse_unary(parser *P, int with_filter, jnode **out) {
    const jtok *t = cur(P);
    df_status st;
    if (++P->depth > MAX_NESTING) return perr(P, t, "%s", "expression nested too deeply");
    if (is_op(P, JOP_SUB) || is_op(P, JOP_ADD)) {
        adv(P);
        jnode *n = node(P, t->op == JOP_SUB ? JN_NEG : JN_POS, t);
        if (!n) return NOMEM(P);
        if ((st = parse_unary(P, 0, &n->a))) return st;
        *out = n;
    } else {
        if ((st = parse_primary(P, out))) return st;
        P->depth--;
        if ((st = parse_postfix(P, out))) return st;
    }
    if (with_filter && (st = parse_filter_expr(P, out))) return st;
    P->depth--;
    return DF_OK;
}

static df_status binop(parser *P, const jtok *t, jnode_kind kind, jop op, jnode *a, jnode *b, jnode **out) {
    jnode *n = node(P, kind, t);
    if (!n) return NOMEM(P);
    n->op = op;
    n->a = a;
    n->b = b;
    *out = n;
    return DF_OK;
}

typedef df_status (*parse_fn)(parser *P, jnode **out);

/* A left-associative level: operand { op operand }, op one of ops (JOP_NONE-terminated) or
 * the keyword word. */
static df_status parse_left_assoc(parser *P, jnode **out, parse_fn operand, jnode_kind kind, const jop *ops,
                                  const char *word) {
    df_status st = operand(P, out);
    for (;;) {
        if (st) return st;
        const jtok *t = cur(P);
        int match = word ? is_name(t, word) : 0;
        for (int i = 0; !word && ops[i] != JOP_NONE; i++) match |= is_op(P, ops[i]);
        if (!match) return DF_OK;
        adv(P);
        jnode *r;
        if ((st = operand(P, &r))) return st;
        st = binop(P, t, kind, word ? JOP_NONE : t->op, *out, r, out);
    }
}

static df_status parse_unary_filtered(parser *P, jnode **out) { return parse_unary(P, 1, out); }

static df_status parse_pow(parser *P, jnode **out) {
    static const jop ops[] = {JOP_POW, JOP_NONE};
    return parse_left_assoc(P, out, parse_unary_filtered, JN_BINOP, ops, NULL);
}

static df_status parse_math2(parser *P, jnode **out) {
    static const jop ops[] = {JOP_MUL, JOP_DIV, JOP_FLOORDIV, JOP_MOD, JOP_NONE};
    return parse_left_assoc(P, out, parse_pow, JN_BINOP, ops, NULL);
}

static df_status parse_concat(parser *P, jnode **out) {
    static const jop ops[] = {JOP_TILDE, JOP_NONE};
    return parse_left_assoc(P, out, parse_math2, JN_BINOP, ops, NULL);
}

static df_status parse_math1(parser *P, jnode **out) {
    static const jop ops[] = {JOP_ADD, JOP_SUB, JOP_NONE};
    return parse_left_assoc(P, out, parse_concat, JN_BINOP, ops, NULL);
}

static df_status parse_compare(parser *P, jnode **out) {
    jnode *first;
    df_status st = parse_math1(P, &first);
    if (st) return st;
    pvec operands = {0};
    jop ops[64];
    int nops = 0;
    const jtok *t0 = cur(P);
    for (;;) {
        const jtok *t = cur(P);
        jop op = JOP_NONE;
        if (t->type == JT_OP && (t->op == JOP_EQ || t->op == JOP_NE || t->op == JOP_LT || t->op == JOP_LE ||
                                 t->op == JOP_GT || t->op == JOP_GE)) {
            op = t->op;
            adv(P);
        } else if (is_name(t, "in")) {
            op = JOP_IN;
            adv(P);
        } else if (is_name(t, "not") && is_name(peek(P, 1), "in")) {
            op = JOP_NOTIN;
            adv(P);
            adv(P);
        } else {
            break;
        }
        if (nops == 64) {
            free(operands.v);
            return perr(P, t, "%s", "comparison chain too long");
        }
        if (!operands.n && pvec_push(&operands, first)) goto oom;
        jnode *r;
        if ((st = parse_math1(P, &r))) {
            free(operands.v);
            return st;
        }
        if (pvec_push(&operands, r)) goto oom;
        ops[nops++] = op;
    }
    if (!nops) {
        *out = first;
        return DF_OK;
    }
    jnode *n = node(P, JN_COMPARE, t0);
    if (!n) goto oom;
    n->line = first->line;
    n->col = first->col;
    n->nargs = operands.n;
    if (!(n->args = (jnode **)pvec_finish(P, &operands))) return NOMEM(P);
    if (!(n->ops = jarena_alloc(&P->t->arena, (size_t)nops * sizeof *n->ops))) return NOMEM(P);
    memcpy(n->ops, ops, (size_t)nops * sizeof *ops);
    *out = n;
    return DF_OK;
oom:
    free(operands.v);
    return NOMEM(P);
}

static df_status parse_not(parser *P, jnode **out) {
    const jtok *t = cur(P);
    if (is_name(t, "not")) {
        if (++P->depth > MAX_NESTING) return perr(P, t, "%s", "expression nested too deeply");
        adv(P);
        jnode *n = node(P, JN_NOT, t);
        if (!n) return NOMEM(P);
        df_status st = parse_not(P, &n->a);
        P->depth--;
        *out = n;
        return st;
    }
    return parse_compare(P, out);
}

static df_status parse_and(parser *P, jnode **out) { return parse_left_assoc(P, out, parse_not, JN_AND, NULL, "and"); }

static df_status parse_or(parser *P, jnode **out) { return parse_left_assoc(P, out, parse_and, JN_OR, NULL, "or"); }

static df_status parse_expr(parser *P, int with_cond, jnode **out) {
    df_status st;
    if (++P->depth > MAX_NESTING) return perr(P, cur(P), "%s", "expression nested too deeply");
    if ((st = parse_or(P, out))) return st;
    while (with_cond && is_name(cur(P), "if")) {
        const jtok *t = cur(P);
        adv(P);
        jnode *n = node(P, JN_COND, t);
        if (!n) return NOMEM(P);
        n->b = *out;
        if ((st = parse_or(P, &n->a))) return st;
        if (is_name(cur(P), "else")) {
            adv(P);
            if ((st = parse_expr(P, 1, &n->c))) return st;
        }
        *out = n;
    }
    P->depth--;
    return DF_OK;
}

static int ends_tuple(parser *P) {
    const jtok *t = cur(P);
    if (t->type == JT_VAR_END || t->type == JT_BLOCK_END || t->type == JT_EOF) return 1;
    if (t->type == JT_OP && t->op == JOP_RPAREN) return 1;
    return 0;
}

/* expr {, expr}: several make a tuple (a JSON array at run time). */
static df_status parse_tuple(parser *P, int with_cond, int explicit_parens, jnode **out) {
    const jtok *t = cur(P);
    jnode *first;
    df_status st = parse_expr(P, with_cond, &first);
    if (st) return st;
    if (!is_op(P, JOP_COMMA)) {
        *out = first;
        return DF_OK;
    }
    pvec items = {0};
    if (pvec_push(&items, first)) return NOMEM(P);
    while (is_op(P, JOP_COMMA)) {
        adv(P);
        if (ends_tuple(P)) break;
        if (!explicit_parens && is_name(cur(P), "if")) break;
        jnode *e;
        if ((st = parse_expr(P, with_cond, &e))) {
            free(items.v);
            return st;
        }
        if (pvec_push(&items, e)) {
            free(items.v);
            return NOMEM(P);
        }
    }
    jnode *n = node(P, JN_LIST, t);
    if (!n) {
        free(items.v);
        return NOMEM(P);
    }
    n->flag = 1;
    n->nargs = items.n;
    if (!(n->args = (jnode **)pvec_finish(P, &items))) return NOMEM(P);
    *out = n;
    return DF_OK;
}

/* ---- statements ----------------------------------------------------------------------- */

static df_status expect_block_end(parser *P) {
    if (cur(P)->type != JT_BLOCK_END) return unexpected(P, "'%}'");
    adv(P);
    return DF_OK;
}

/* Parses statements until a {% name %} with name in `ends` (NULL-terminated; NULL list =
 * until the end of the template). On return *which is the index of the end tag found and
 * the parser stands after its name. */
static df_status parse_body(parser *P, const jtok *open, const char *const *ends, jnode ***body, int *nbody, int *which);

static df_status parse_targets(parser *P, pvec *names) {
    int paren = 0;
    if (is_op(P, JOP_LPAREN)) {
        paren = 1;
        adv(P);
    }
    for (;;) {
        if (cur(P)->type != JT_NAME) return unexpected(P, "a variable name");
        if (pvec_push(names, (void *)cur(P)->s)) return NOMEM(P);
        adv(P);
        if (!is_op(P, JOP_COMMA)) break;
        adv(P);
        if (paren && is_op(P, JOP_RPAREN)) break;
    }
    if (paren) return expect_op(P, JOP_RPAREN);
    return DF_OK;
}

static df_status parse_for(parser *P, const jtok *at, jnode **out) {
    jnode *n = node(P, JN_FOR, at);
    if (!n) return NOMEM(P);
    pvec names = {0};
    df_status st = parse_targets(P, &names);
    if (st) {
        free(names.v);
        return st;
    }
    n->nkw = names.n;
    if (!(n->kwnames = (const char **)pvec_finish(P, &names))) return NOMEM(P);
    if (!is_name(cur(P), "in")) return unexpected(P, "'in'");
    adv(P);
    if ((st = parse_tuple(P, 0, 0, &n->a))) return st;
    if (is_name(cur(P), "if")) {
        adv(P);
        if ((st = parse_expr(P, 1, &n->b))) return st;
    }
    if (is_name(cur(P), "recursive")) return perr(P, cur(P), "%s", "recursive loops are not supported");
    if ((st = expect_block_end(P))) return st;
    static const char *const ends[] = {"endfor", "else", NULL};
    int which;
    if ((st = parse_body(P, at, ends, &n->body, &n->nbody, &which))) return st;
    if (which == 1) {
        static const char *const ends2[] = {"endfor", NULL};
        if ((st = expect_block_end(P)) || (st = parse_body(P, at, ends2, &n->else_body, &n->nelse, &which))) return st;
    }
    *out = n;
    return expect_block_end(P);
}

static df_status parse_if(parser *P, const jtok *at, jnode **out) {
    jnode *n = node(P, JN_IF, at);
    if (!n) return NOMEM(P);
    df_status st;
    if ((st = parse_tuple(P, 1, 0, &n->a)) || (st = expect_block_end(P))) return st;
    static const char *const ends[] = {"endif", "elif", "else", NULL};
    int which;
    if ((st = parse_body(P, at, ends, &n->body, &n->nbody, &which))) return st;
    *out = n;
    if (which == 1) { /* elif: a nested if as the whole else branch */
        const jtok *t = &P->tk[P->i - 1];
        jnode *e;
        if ((st = parse_if(P, t, &e))) return st;
        if (!(n->else_body = jarena_alloc(&P->t->arena, sizeof(jnode *)))) return NOMEM(P);
        n->else_body[0] = e;
        n->nelse = 1;
        return DF_OK; /* the nested if consumed endif */
    }
    if (which == 2) {
        static const char *const ends2[] = {"endif", NULL};
        if ((st = expect_block_end(P)) || (st = parse_body(P, at, ends2, &n->else_body, &n->nelse, &which))) return st;
    }
    return expect_block_end(P);
}

static df_status parse_set(parser *P, const jtok *at, jnode **out) {
    df_status st;
    if (cur(P)->type != JT_NAME) return unexpected(P, "a variable name");
    /* namespace attribute: set ns.attr = value */
    if (peek(P, 1)->type == JT_OP && peek(P, 1)->op == JOP_DOT) {
        jnode *n = node(P, JN_SET, at);
        if (!n || !(n->kwnames = jarena_alloc(&P->t->arena, sizeof(char *)))) return NOMEM(P);
        n->kwnames[0] = cur(P)->s;
        n->nkw = 1;
        adv(P);
        adv(P);
        if (cur(P)->type != JT_NAME) return unexpected(P, "an attribute name");
        n->attr = cur(P)->s;
        adv(P);
        if ((st = expect_op(P, JOP_ASSIGN)) || (st = parse_tuple(P, 1, 0, &n->a))) return st;
        *out = n;
        return expect_block_end(P);
    }
    if (peek(P, 1)->type == JT_BLOCK_END) { /* block set */
        jnode *n = node(P, JN_SETBLOCK, at);
        if (!n) return NOMEM(P);
        n->name = cur(P)->s;
        adv(P);
        adv(P);
        static const char *const ends[] = {"endset", NULL};
        int which;
        if ((st = parse_body(P, at, ends, &n->body, &n->nbody, &which))) return st;
        *out = n;
        return expect_block_end(P);
    }
    jnode *n = node(P, JN_SET, at);
    if (!n) return NOMEM(P);
    pvec names = {0};
    if ((st = parse_targets(P, &names))) {
        free(names.v);
        return st;
    }
    n->nkw = names.n;
    if (!(n->kwnames = (const char **)pvec_finish(P, &names))) return NOMEM(P);
    if ((st = expect_op(P, JOP_ASSIGN)) || (st = parse_tuple(P, 1, 0, &n->a))) return st;
    *out = n;
    return expect_block_end(P);
}

static df_status parse_macro(parser *P, const jtok *at, jnode **out) {
    df_status st;
    if (cur(P)->type != JT_NAME) return unexpected(P, "a macro name");
    jnode *n = node(P, JN_MACRO, at);
    if (!n) return NOMEM(P);
    n->name = cur(P)->s;
    adv(P);
    if ((st = expect_op(P, JOP_LPAREN))) return st;
    pvec names = {0}, defs = {0};
    while (!is_op(P, JOP_RPAREN)) {
        if (names.n && (st = expect_op(P, JOP_COMMA))) goto fail;
        if (is_op(P, JOP_RPAREN)) break;
        if (cur(P)->type != JT_NAME) {
            st = unexpected(P, "a parameter name");
            goto fail;
        }
        const char *pname = cur(P)->s;
        adv(P);
        jnode *def = NULL;
        if (is_op(P, JOP_ASSIGN)) {
            adv(P);
            if ((st = parse_expr(P, 1, &def))) goto fail;
        } else if (defs.n && defs.v[defs.n - 1]) {
            st = perr(P, cur(P), "%s", "non-default argument follows default argument");
            goto fail;
        }
        if (pvec_push(&names, (void *)pname) || pvec_push(&defs, def)) {
            st = NOMEM(P);
            goto fail;
        }
    }
    adv(P);
    n->nkw = names.n;
    n->kwnames = (const char **)pvec_finish(P, &names);
    n->kwvals = (jnode **)pvec_finish(P, &defs);
    if (!n->kwnames || !n->kwvals) return NOMEM(P);
    if ((st = expect_block_end(P))) return st;
    static const char *const ends[] = {"endmacro", NULL};
    int which;
    if ((st = parse_body(P, at, ends, &n->body, &n->nbody, &which))) return st;
    if (cur(P)->type == JT_NAME) adv(P); /* {% endmacro name %} */
    *out = n;
    return expect_block_end(P);
fail:
    free(names.v);
    free(defs.v);
    return st;
}

static df_status parse_statement(parser *P, const jtok *name, jnode **out) {
    const char *s = name->s;
    df_status st;
    if (!strcmp(s, "if")) return parse_if(P, name, out);
    if (!strcmp(s, "for")) return parse_for(P, name, out);
    if (!strcmp(s, "set")) return parse_set(P, name, out);
    if (!strcmp(s, "macro")) return parse_macro(P, name, out);
    if (!strcmp(s, "break") || !strcmp(s, "continue")) {
        jnode *n = node(P, s[0] == 'b' ? JN_BREAK : JN_CONTINUE, name);
        if (!n) return NOMEM(P);
        *out = n;
        return expect_block_end(P);
    }
    if (!strcmp(s, "generation")) {
        jnode *n = node(P, JN_BLOCK, name);
        if (!n) return NOMEM(P);
        if ((st = expect_block_end(P))) return st;
        static const char *const ends[] = {"endgeneration", NULL};
        int which;
        if ((st = parse_body(P, name, ends, &n->body, &n->nbody, &which))) return st;
        *out = n;
        return expect_block_end(P);
    }
    static const char *const unsupported[] = {"extends", "block", "include", "import", "from",
                                              "call", "filter", "with", "autoescape", "do"};
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++)
        if (!strcmp(s, unsupported[i])) return perr(P, name, "the '%s' tag is not supported", s);
    return perr(P, name, "unknown tag '%s'", s);
}

static df_status parse_body(parser *P, const jtok *open, const char *const *ends, jnode ***body, int *nbody, int *which) {
    pvec stmts = {0};
    df_status st = DF_OK;
    if (++P->depth > MAX_NESTING) return perr(P, cur(P), "%s", "blocks nested too deeply");
    for (;;) {
        const jtok *t = cur(P);
        if (t->type == JT_EOF) {
            if (ends) {
                char what[120];
                snprintf(what, sizeof what, "unexpected end of template, expected '{%% %s %%}'", ends[0]);
                st = perr(P, open, "%s (for the tag opened here)", what);
                goto fail;
            }
            *which = -1;
            break;
        }
        if (t->type == JT_DATA) {
            jnode *n = node(P, JN_TEXT, t);
            if (!n) goto oom;
            n->name = t->s;
            n->name_len = t->n;
            if (pvec_push(&stmts, n)) goto oom;
            adv(P);
            continue;
        }
        if (t->type == JT_VAR_BEGIN) {
            adv(P);
            jnode *n = node(P, JN_OUTPUT, t);
            if (!n) goto oom;
            if ((st = parse_tuple(P, 1, 0, &n->a))) goto fail;
            if (cur(P)->type != JT_VAR_END) {
                st = unexpected(P, "'}}'");
                goto fail;
            }
            adv(P);
            if (pvec_push(&stmts, n)) goto oom;
            continue;
        }
        if (t->type != JT_BLOCK_BEGIN) {
            st = unexpected(P, NULL);
            goto fail;
        }
        adv(P);
        const jtok *name = cur(P);
        if (name->type != JT_NAME) {
            st = unexpected(P, "a tag name");
            goto fail;
        }
        int found = -1;
        for (int k = 0; ends && ends[k]; k++)
            if (!strcmp(name->s, ends[k])) found = k;
        if (found >= 0) {
            adv(P);
            *which = found;
            break;
        }
        if (!strncmp(name->s, "end", 3) || !strcmp(name->s, "else") || !strcmp(name->s, "elif")) {
            st = perr(P, name, "unexpected '%s'", name->s);
            goto fail;
        }
        adv(P);
        jnode *n = NULL;
        if ((st = parse_statement(P, name, &n))) goto fail;
        if (pvec_push(&stmts, n)) goto oom;
    }
    P->depth--;
    *nbody = stmts.n;
    if (!(*body = (jnode **)pvec_finish(P, &stmts))) return NOMEM(P);
    return DF_OK;
oom:
    st = NOMEM(P);
fail:
    free(stmts.v);
    return st;
}

df_status jparse(df_jinja_template *t, const jtok *toks, size_t ntok, df_error *err) {
    parser P = {.t = t, .tk = toks, .n = ntok, .err = err};
    int which;
    return parse_body(&P, P.tk, NULL, &t->body, &t->nbody, &which);
}
