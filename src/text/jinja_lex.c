/* Jinja2 lexer with transformers' settings (trim_blocks, lstrip_blocks).
 *
 * Whitespace control, as Jinja2 3.1's lexer applies it:
 *  - `{%-`, `{{-`, `{#-` strip all whitespace before the tag; `-%}`, `-}}`, `-#}` all after;
 *  - trim_blocks: a single "\n" right after `%}` or `#}` is removed (not after `}}`), unless
 *    the tag ends with `+%}`;
 *  - lstrip_blocks: spaces and tabs between the start of a line and `{%` or `{#` are removed
 *    (not before `{{`, nor when the tag opens with `{%+`). "Start of a line" means the text
 *    before the tag contains a newline, or the previous tag ended the line (or there is no
 *    previous tag).
 * Inside a tag, bracket nesting is tracked so `}}` closing a dict literal does not end the tag.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "text/jinja_ast.h"

typedef struct lexer {
    jarena *a;
    const char *src;
    size_t n;
    jtok *toks;
    size_t ntok, cap;
    /* position tracking (monotonic) */
    size_t lc_pos;
    int lc_line, lc_col;
    df_error *err;
} lexer;

static void lc(lexer *L, size_t pos, int *line, int *col) {
    if (pos < L->lc_pos) { /* never happens in order; restart */
        L->lc_pos = 0;
        L->lc_line = 1;
        L->lc_col = 1;
    }
    for (; L->lc_pos < pos && L->lc_pos < L->n; L->lc_pos++) {
        unsigned char c = (unsigned char)L->src[L->lc_pos];
        if (c == '\n') {
            L->lc_line++;
            L->lc_col = 1;
        } else if ((c & 0xC0) != 0x80) {
            L->lc_col++;
        }
    }
    *line = L->lc_line;
    *col = L->lc_col;
}

static df_status lex_error(lexer *L, size_t pos, const char *what, const char *arg) {
    int line, col;
    lc(L, pos, &line, &col);
    return df_error_set(L->err, DF_ERR_FORMAT, "template syntax error at line %d, column %d: %s%s", line, col,
                        what, arg ? arg : "");
}

static jtok *push(lexer *L, jtok_type type, size_t pos) {
    if (L->ntok == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        jtok *t = realloc(L->toks, cap * sizeof *t);
        if (!t) return NULL;
        L->toks = t;
        L->cap = cap;
    }
    jtok *t = &L->toks[L->ntok++];
    memset(t, 0, sizeof *t);
    t->type = type;
    lc(L, pos, &t->line, &t->col);
    return t;
}

#define NOMEM(L) df_error_set((L)->err, DF_ERR_NOMEM, "out of memory parsing template")

static df_status push_data(lexer *L, size_t b, size_t e) {
    if (e <= b) return DF_OK;
    jtok *t = push(L, JT_DATA, b);
    if (!t || !(t->s = jarena_strndup(L->a, L->src + b, e - b))) return NOMEM(L);
    t->n = e - b;
    return DF_OK;
}

static int is_name_start(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_digit(int c) { return c >= '0' && c <= '9'; }
static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decodes a string literal starting at the quote at *pos (Python unicode-escape rules). */
static df_status lex_string(lexer *L, size_t *pos) {
    size_t start = *pos, i = start + 1;
    char q = L->src[start];
    jbuf b = {0};
    df_status st = DF_OK;
    for (;;) {
        if (i >= L->n) {
            st = lex_error(L, start, "unterminated string literal", NULL);
            break;
        }
        char c = L->src[i];
        if (c == q) {
            i++;
            break;
        }
        if (c != '\\') {
            if (jbuf_putc(&b, c)) goto oom;
            i++;
            continue;
        }
        if (i + 1 >= L->n) {
            st = lex_error(L, start, "unterminated string literal", NULL);
            break;
        }
        char e = L->src[i + 1];
        i += 2;
        int r = 0;
        switch (e) {
        case '\n': break;
        case '\\': r = jbuf_putc(&b, '\\'); break;
        case '\'': r = jbuf_putc(&b, '\''); break;
        case '"': r = jbuf_putc(&b, '"'); break;
        case 'a': r = jbuf_putc(&b, '\a'); break;
        case 'b': r = jbuf_putc(&b, '\b'); break;
        case 'f': r = jbuf_putc(&b, '\f'); break;
        case 'n': r = jbuf_putc(&b, '\n'); break;
        case 'r': r = jbuf_putc(&b, '\r'); break;
        case 't': r = jbuf_putc(&b, '\t'); break;
        case 'v': r = jbuf_putc(&b, '\v'); break;
        case 'x': case 'u': case 'U': {
            int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            int32_t cp = 0;
            for (int k = 0; k < nd; k++) {
                int h = i + (size_t)k < L->n ? hexval((unsigned char)L->src[i + (size_t)k]) : -1;
                if (h < 0) {
                    st = lex_error(L, i - 2, "truncated escape in string literal", NULL);
                    goto done;
                }
                cp = cp * 16 + h;
            }
            i += (size_t)nd;
            if (cp > 0x10FFFF) {
                st = lex_error(L, i - 2 - (size_t)nd, "illegal Unicode character in string literal", NULL);
                goto done;
            }
            r = ju8_put(&b, cp);
            break;
        }
        default:
            if (e >= '0' && e <= '7') {
                int32_t cp = e - '0';
                for (int k = 0; k < 2 && i < L->n && L->src[i] >= '0' && L->src[i] <= '7'; k++, i++)
                    cp = cp * 8 + (L->src[i] - '0');
                r = ju8_put(&b, cp);
            } else {
                char t[2] = {'\\', e};
                r = jbuf_put(&b, t, 2);
            }
        }
        if (r) goto oom;
    }
done:
    if (st == DF_OK) {
        jtok *t = push(L, JT_STRING, start);
        if (!t || !(t->s = jarena_strndup(L->a, b.p ? b.p : "", b.n))) goto oom;
        t->n = b.n;
        *pos = i;
    }
    jbuf_free(&b);
    return st;
oom:
    jbuf_free(&b);
    return NOMEM(L);
}

static df_status lex_number(lexer *L, size_t *pos) {
    size_t start = *pos, i = start;
    char buf[128];
    size_t k = 0;
    int is_float = 0;
    while (i < L->n && (is_digit(L->src[i]) || (L->src[i] == '_' && i + 1 < L->n && is_digit(L->src[i + 1])))) {
        if (L->src[i] != '_' && k < sizeof buf - 1) buf[k++] = L->src[i];
        i++;
    }
    if (i + 1 < L->n && L->src[i] == '.' && is_digit(L->src[i + 1])) {
        is_float = 1;
        if (k < sizeof buf - 1) buf[k++] = '.';
        i++;
        while (i < L->n && (is_digit(L->src[i]) || (L->src[i] == '_' && i + 1 < L->n && is_digit(L->src[i + 1])))) {
            if (L->src[i] != '_' && k < sizeof buf - 1) buf[k++] = L->src[i];
            i++;
        }
    }
    if (i < L->n && (L->src[i] == 'e' || L->src[i] == 'E')) {
        size_t j = i + 1;
        if (j < L->n && (L->src[j] == '+' || L->src[j] == '-')) j++;
        if (j < L->n && is_digit(L->src[j])) {
            is_float = 1;
            for (; i < j; i++)
                if (k < sizeof buf - 1) buf[k++] = L->src[i];
            while (i < L->n && is_digit(L->src[i])) {
                if (k < sizeof buf - 1) buf[k++] = L->src[i];
                i++;
            }
        }
    }
    buf[k] = 0;
    jtok *t = push(L, is_float ? JT_FLOAT : JT_INT, start);
    if (!t) return NOMEM(L);
    if (is_float) {
        t->d = strtod(buf, NULL);
    } else {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(buf, &end, 10);
        if (errno || k >= sizeof buf - 1 || v > (unsigned long long)INT64_MAX)
            return lex_error(L, start, "integer literal too large", NULL);
        t->i = (long long)v;
    }
    *pos = i;
    return DF_OK;
}

static jop two_char_op(const char *s) {
    static const struct {
        const char *s;
        jop op;
    } ops[] = {{"//", JOP_FLOORDIV}, {"**", JOP_POW}, {"==", JOP_EQ}, {"!=", JOP_NE}, {"<=", JOP_LE}, {">=", JOP_GE}};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
        if (s[0] == ops[i].s[0] && s[1] == ops[i].s[1]) return ops[i].op;
    return JOP_NONE;
}

static jop one_char_op(char c) {
    switch (c) {
    case '+': return JOP_ADD;
    case '-': return JOP_SUB;
    case '*': return JOP_MUL;
    case '/': return JOP_DIV;
    case '%': return JOP_MOD;
    case '~': return JOP_TILDE;
    case '[': return JOP_LBRACKET;
    case ']': return JOP_RBRACKET;
    case '(': return JOP_LPAREN;
    case ')': return JOP_RPAREN;
    case '{': return JOP_LBRACE;
    case '}': return JOP_RBRACE;
    case '<': return JOP_LT;
    case '>': return JOP_GT;
    case '=': return JOP_ASSIGN;
    case '.': return JOP_DOT;
    case ':': return JOP_COLON;
    case '|': return JOP_PIPE;
    case ',': return JOP_COMMA;
    case ';': return JOP_SEMI;
    default: return JOP_NONE;
    }
}

/* After a tag closer at pos (just past it): applies `-` / trim_blocks, returns the new pos
 * and whether the consumed text ended a line. */
static size_t after_closer(lexer *L, size_t pos, char marker, int trim, int *line_starting) {
    if (marker == '-') {
        size_t s = pos;
        while (pos < L->n && ju_isspace((unsigned char)L->src[pos])) pos++;
        *line_starting = pos > s && L->src[pos - 1] == '\n';
    } else if (marker != '+' && trim && pos < L->n && L->src[pos] == '\n') {
        pos++;
        *line_starting = 1;
    } else {
        *line_starting = 0;
    }
    return pos;
}

/* Lexes the inside of a {{ }} or {% %} tag starting at pos; returns the position after the
 * closer and its strip marker. */
static df_status lex_tag(lexer *L, size_t open, size_t *pos_io, int is_block, char *marker_out) {
    size_t i = *pos_io;
    char stack[256];
    int depth = 0;
    for (;;) {
        while (i < L->n && ju_isspace((unsigned char)L->src[i])) i++;
        if (i >= L->n)
            return lex_error(L, open, is_block ? "unexpected end of template, expected '%}'"
                                               : "unexpected end of template, expected '}}'",
                             NULL);
        const char *s = L->src + i;
        size_t left = L->n - i;
        if (depth == 0) {
            char close = is_block ? '%' : '}';
            if ((s[0] == '-' || (s[0] == '+' && is_block)) && left >= 3 && s[1] == close && s[2] == '}') {
                *marker_out = s[0];
                *pos_io = i + 3;
                return push(L, is_block ? JT_BLOCK_END : JT_VAR_END, i) ? DF_OK : NOMEM(L);
            }
            if (left >= 2 && s[0] == close && s[1] == '}') {
                *marker_out = 0;
                *pos_io = i + 2;
                return push(L, is_block ? JT_BLOCK_END : JT_VAR_END, i) ? DF_OK : NOMEM(L);
            }
        }
        unsigned char c = (unsigned char)s[0];
        if (is_name_start(c)) {
            size_t j = i;
            while (j < L->n && (is_name_start((unsigned char)L->src[j]) || is_digit(L->src[j]))) j++;
            jtok *t = push(L, JT_NAME, i);
            if (!t || !(t->s = jarena_strndup(L->a, s, j - i))) return NOMEM(L);
            t->n = j - i;
            i = j;
        } else if (is_digit(c)) {
            df_status st = lex_number(L, &i);
            if (st) return st;
        } else if (c == '\'' || c == '"') {
            df_status st = lex_string(L, &i);
            if (st) return st;
        } else {
            jop op = left >= 2 ? two_char_op(s) : JOP_NONE;
            size_t w = 2;
            if (op == JOP_NONE) {
                op = one_char_op((char)c);
                w = 1;
            }
            if (op == JOP_NONE) {
                char what[8] = {0};
                size_t adv;
                ju8_decode(s, left, &adv);
                memcpy(what, s, adv < 5 ? adv : 4);
                return lex_error(L, i, "unexpected character ", what);
            }
            if (op == JOP_LPAREN || op == JOP_LBRACKET || op == JOP_LBRACE) {
                if (depth >= (int)sizeof stack) return lex_error(L, i, "brackets nested too deeply", NULL);
                stack[depth++] = op == JOP_LPAREN ? ')' : op == JOP_LBRACKET ? ']' : '}';
            } else if (op == JOP_RPAREN || op == JOP_RBRACKET || op == JOP_RBRACE) {
                char t[2] = {(char)c, 0};
                if (depth == 0) return lex_error(L, i, "unexpected ", t);
                if (stack[depth - 1] != (char)c) return lex_error(L, i, "unbalanced bracket ", t);
                depth--;
            }
            jtok *t = push(L, JT_OP, i);
            if (!t) return NOMEM(L);
            t->op = op;
            i += w;
        }
    }
}

/* {% raw %}: if the block tag at `open` (after the opener and marker, at i) is `raw`,
 * returns 1 and the end of its closer. */
static int is_raw_tag(lexer *L, size_t i, size_t *closer_end, char *marker) {
    while (i < L->n && ju_isspace((unsigned char)L->src[i])) i++;
    if (L->n - i < 3 || memcmp(L->src + i, "raw", 3) != 0) return 0;
    i += 3;
    if (i < L->n && (is_name_start((unsigned char)L->src[i]) || is_digit(L->src[i]))) return 0;
    while (i < L->n && ju_isspace((unsigned char)L->src[i])) i++;
    *marker = 0;
    if (i < L->n && (L->src[i] == '-' || L->src[i] == '+')) *marker = L->src[i++];
    if (L->n - i < 2 || L->src[i] != '%' || L->src[i + 1] != '}') return 0;
    *closer_end = i + 2;
    return 1;
}

/* Finds `{%[-+]? endraw [-+]?%}` from i; sets its start, end, and strip markers. */
static int find_endraw(lexer *L, size_t i, size_t *b, size_t *e, char *m_open, char *m_close) {
    for (; i + 1 < L->n; i++) {
        if (L->src[i] != '{' || L->src[i + 1] != '%') continue;
        size_t j = i + 2;
        *m_open = 0;
        if (j < L->n && (L->src[j] == '-' || L->src[j] == '+')) *m_open = L->src[j++];
        while (j < L->n && ju_isspace((unsigned char)L->src[j])) j++;
        if (L->n - j < 6 || memcmp(L->src + j, "endraw", 6) != 0) continue;
        j += 6;
        while (j < L->n && ju_isspace((unsigned char)L->src[j])) j++;
        *m_close = 0;
        if (j < L->n && (L->src[j] == '-' || L->src[j] == '+')) *m_close = L->src[j++];
        if (L->n - j < 2 || L->src[j] != '%' || L->src[j + 1] != '}') continue;
        *b = i;
        *e = j + 2;
        return 1;
    }
    return 0;
}

static size_t rstrip_ws(const char *s, size_t b, size_t e) {
    while (e > b && ju_isspace((unsigned char)s[e - 1])) e--;
    return e;
}

df_status jlex(jarena *a, const char *src, size_t len, jtok **out, size_t *n_out, df_error *err) {
    lexer L = {.a = a, .src = src, .n = len, .lc_line = 1, .lc_col = 1, .err = err};
    size_t pos = 0;
    int line_starting = 1;
    df_status st = DF_OK;
    for (;;) {
        size_t i = pos;
        for (; i + 1 < len; i++)
            if (src[i] == '{' && (src[i + 1] == '{' || src[i + 1] == '%' || src[i + 1] == '#')) break;
        int found = i + 1 < len;
        size_t data_end = found ? i : len;
        if (found) {
            char kind = src[i + 1];
            char marker = i + 2 < len ? src[i + 2] : 0;
            if (marker == '-') {
                data_end = rstrip_ws(src, pos, data_end);
            } else if (marker != '+' && kind != '{') {
                /* lstrip_blocks */
                size_t l = data_end;
                while (l > pos && src[l - 1] != '\n') l--;
                int has_nl = l > pos;
                if (has_nl || line_starting) {
                    size_t k = l;
                    while (k < data_end && (src[k] == ' ' || src[k] == '\t')) k++;
                    if (k == data_end) data_end = l;
                }
            }
        }
        if ((st = push_data(&L, pos, data_end))) goto fail;
        if (!found) break;
        char kind = src[i + 1];
        size_t body = i + 2;
        if (body < len && (src[body] == '-' || src[body] == '+')) body++;
        if (kind == '#') {
            size_t j = body;
            while (j + 1 < len && !(src[j] == '#' && src[j + 1] == '}')) j++;
            if (j + 1 >= len) {
                st = lex_error(&L, i, "unterminated comment", NULL);
                goto fail;
            }
            char m = (j > body && (src[j - 1] == '-' || src[j - 1] == '+')) ? src[j - 1] : 0;
            pos = after_closer(&L, j + 2, m, 1, &line_starting);
            continue;
        }
        if (kind == '%') {
            size_t ce;
            char m;
            if (is_raw_tag(&L, body, &ce, &m)) {
                size_t rb, re;
                char mo, mc;
                if (!find_endraw(&L, ce, &rb, &re, &mo, &mc)) {
                    st = lex_error(&L, i, "missing endraw for raw block", NULL);
                    goto fail;
                }
                size_t cb = after_closer(&L, ce, m, 1, &line_starting);
                size_t cend = rb;
                if (mo == '-') cend = rstrip_ws(src, cb, cend);
                if (cb < cend && (st = push_data(&L, cb, cend))) goto fail;
                pos = after_closer(&L, re, mc, 1, &line_starting);
                continue;
            }
        }
        int is_block = kind == '%';
        if (!push(&L, is_block ? JT_BLOCK_BEGIN : JT_VAR_BEGIN, i)) {
            st = NOMEM(&L);
            goto fail;
        }
        char m = 0;
        size_t p = body;
        if ((st = lex_tag(&L, i, &p, is_block, &m))) goto fail;
        pos = after_closer(&L, p, m, is_block, &line_starting);
    }
    if (!push(&L, JT_EOF, len)) {
        st = NOMEM(&L);
        goto fail;
    }
    *out = L.toks;
    *n_out = L.ntok;
    return DF_OK;
fail:
    free(L.toks);
    return st;
}
