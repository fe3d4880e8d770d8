/* Chat output parsing: reasoning, content and tool calls, incrementally (see dflash/chat.h).
 *
 * The parser is a small state machine over the unprocessed text `pend`:
 *   START     (only when the output does not start inside <think>): leading whitespace, then
 *             `<think>` opens REASONING; anything else is CONTENT.
 *   REASONING until `</think>`, then CONTENT.
 *   CONTENT   until `<tool_call>` (when tool calls are parsed), then TOOL.
 *   TOOL      until `</tool_call>`: the body is parsed; a valid call is emitted whole, an
 *             invalid one (or one cut off by the end of the output) goes to the content as
 *             the exact text it was.
 * Only text that can no longer change meaning is emitted: a suffix that may start a tag, an
 * unfinished UTF-8 character, and whitespace (which is dropped at the start and end of a
 * channel and next to tool calls) wait for the next piece. So every way of cutting the text
 * into pieces yields the same deltas' concatenation, which is also the non-streamed result.
 */
#include "dflash/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/jinja_internal.h"

enum { S_START, S_REASONING, S_CONTENT, S_TOOL, S_DONE };
enum { CH_REASONING, CH_CONTENT };

static const char THINK_OPEN[] = "<think>", THINK_CLOSE[] = "</think>";
static const char TOOL_OPEN[] = "<tool_call>", TOOL_CLOSE[] = "</tool_call>";

struct df_chat_parser {
    df_chat_parse_options opt;
    int state;
    jbuf pend;           /* unprocessed input */
    size_t tool_scan;    /* TOOL: bytes of pend already searched for </tool_call> */
    jbuf held[2];        /* whitespace held back per channel */
    int emitted[2];      /* the channel has emitted text */
    int n_tools;
};

#define NOMEM(err) df_error_set(err, DF_ERR_NOMEM, "out of memory parsing model output")

/* ---- deltas --------------------------------------------------------------------------- */

static void delta_free(df_chat_delta *d) {
    free(d->text);
    free(d->id);
    free(d->name);
}

void df_chat_deltas_reset(df_chat_deltas *d) {
    for (size_t i = 0; i < d->n; i++) delta_free(&d->items[i]);
    d->n = 0;
}

void df_chat_deltas_free(df_chat_deltas *d) {
    df_chat_deltas_reset(d);
    free(d->items);
    memset(d, 0, sizeof *d);
}

static df_chat_delta *delta_push(df_chat_deltas *d, df_chat_delta_kind kind, int tool_index) {
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 8;
        df_chat_delta *it = realloc(d->items, cap * sizeof *it);
        if (!it) return NULL;
        d->items = it;
        d->cap = cap;
    }
    df_chat_delta *x = &d->items[d->n++];
    memset(x, 0, sizeof *x);
    x->kind = kind;
    x->tool_index = tool_index;
    return x;
}

static char *dup_n(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (p) {
        if (n) memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}

/* Appends text to the last delta when it is of the same kind, else to a new one. */
static int delta_text(df_chat_deltas *d, df_chat_delta_kind kind, int tool_index, const char *s, size_t n) {
    if (n == 0) return 0;
    df_chat_delta *last = d->n ? &d->items[d->n - 1] : NULL;
    if (last && last->kind == kind && last->tool_index == tool_index && kind != DF_CHAT_DELTA_TOOL_START) {
        char *t = realloc(last->text, last->len + n + 1);
        if (!t) return -1;
        memcpy(t + last->len, s, n);
        last->len += n;
        t[last->len] = 0;
        last->text = t;
        return 0;
    }
    df_chat_delta *x = delta_push(d, kind, tool_index);
    if (!x) return -1;
    if (!(x->text = dup_n(s, n))) {
        d->n--;
        return -1;
    }
    x->len = n;
    return 0;
}

/* ---- emission with whitespace rules ---------------------------------------------------- */

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static int emit(df_chat_parser *p, int ch, const char *s, size_t n, df_chat_deltas *out) {
    df_chat_delta_kind kind = ch == CH_REASONING ? DF_CHAT_DELTA_REASONING : DF_CHAT_DELTA_CONTENT;
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        if (is_ws(s[i])) {
            while (j < n && is_ws(s[j])) j++;
            if (jbuf_put(&p->held[ch], s + i, j - i)) return -1;
        } else {
            while (j < n && !is_ws(s[j])) j++;
            if (p->emitted[ch] && p->held[ch].n && delta_text(out, kind, -1, p->held[ch].p, p->held[ch].n)) return -1;
            p->held[ch].n = 0;
            if (delta_text(out, kind, -1, s + i, j - i)) return -1;
            p->emitted[ch] = 1;
        }
        i = j;
    }
    return 0;
}

static void drop_held(df_chat_parser *p, int ch) { p->held[ch].n = 0; }

/* ---- helpers -------------------------------------------------------------------------- */

/* Length of the longest proper prefix of tag that s[0..n) ends with. */
static size_t partial_tag_suffix(const char *s, size_t n, const char *tag) {
    size_t tl = strlen(tag);
    for (size_t k = tl - 1; k > 0; k--)
        if (k <= n && !memcmp(s + n - k, tag, k)) return k;
    return 0;
}

/* Bytes at the end of s[0..n) that begin an unfinished UTF-8 character. */
static size_t partial_utf8_suffix(const char *s, size_t n) {
    for (size_t k = 1; k <= 3 && k <= n; k++) {
        unsigned char c = (unsigned char)s[n - k];
        if ((c & 0xC0) == 0x80) continue; /* continuation: look further back */
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return need > k ? k : 0;
    }
    return 0;
}

static const char *find(const char *s, size_t n, const char *tag) { return memmem(s, n, tag, strlen(tag)); }

static void consume(df_chat_parser *p, size_t k) {
    if (!p->pend.p) return;
    memmove(p->pend.p, p->pend.p + k, p->pend.n - k);
    p->pend.n -= k;
    p->pend.p[p->pend.n] = 0;
}

/* ---- tool call bodies ----------------------------------------------------------------- */

static const json_t *tool_param_schema(const json_t *tools, const char *fname, const char *pname) {
    size_t i;
    json_t *t;
    if (!json_is_array(tools)) return NULL;
    json_array_foreach(tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        if (!fn) fn = t;
        json_t *name = json_object_get(fn, "name");
        if (!json_is_string(name) || strcmp(json_string_value(name), fname)) continue;
        return json_object_get(json_object_get(json_object_get(fn, "parameters"), "properties"), pname);
    }
    return NULL;
}

static int type_listed(const json_t *type, const char *name) {
    if (json_is_string(type)) return !strcmp(json_string_value(type), name);
    size_t i;
    json_t *t;
    json_array_foreach((json_t *)type, i, t) if (json_is_string(t) && !strcmp(json_string_value(t), name)) return 1;
    return 0;
}

static int ieq(const char *s, size_t n, const char *lit) {
    size_t k = strlen(lit);
    if (n != k) return 0;
    for (size_t i = 0; i < k; i++) {
        char c = s[i];
        if (c >= 'A' && c <= 'Z') c = (char)(c - 'A' + 'a');
        if (c != lit[i]) return 0;
    }
    return 1;
}

/* An XML parameter value as the JSON value its schema type asks for, or a string. */
static json_t *convert_value(const json_t *schema, const char *v, size_t n) {
    const json_t *type = schema ? json_object_get(schema, "type") : NULL;
    if (type && !type_listed(type, "string")) {
        size_t b = 0, e = n;
        while (b < e && is_ws(v[b])) b++;
        while (e > b && is_ws(v[e - 1])) e--;
        const char *s = v + b;
        size_t sl = e - b;
        if (type_listed(type, "null") && sl == 4 && !memcmp(s, "null", 4)) return json_null();
        if (type_listed(type, "boolean")) {
            if (ieq(s, sl, "true")) return json_true();
            if (ieq(s, sl, "false")) return json_false();
        }
        if (sl && (type_listed(type, "integer") || type_listed(type, "number") || type_listed(type, "object") ||
                   type_listed(type, "array"))) {
            json_t *j = json_loadb(s, sl, JSON_DECODE_ANY, NULL);
            if (j && ((json_is_integer(j) && (type_listed(type, "integer") || type_listed(type, "number"))) ||
                      (json_is_real(j) && type_listed(type, "number")) ||
                      (json_is_object(j) && type_listed(type, "object")) ||
                      (json_is_array(j) && type_listed(type, "array"))))
                return j;
            json_decref(j);
        }
    }
    return json_stringn_nocheck(v, n);
}

static const char *skip_ws(const char *s, const char *e) {
    while (s < e && is_ws(*s)) s++;
    return s;
}

static int starts(const char *s, const char *e, const char *lit) {
    size_t k = strlen(lit);
    return (size_t)(e - s) >= k && !memcmp(s, lit, k);
}

/* <function=NAME> <parameter=P>\nvalue\n</parameter> ... </function> */
static int parse_xml_call(const df_chat_parser *p, const char *s, const char *e, char **name_out, json_t **args_out) {
    s = skip_ws(s, e);
    if (!starts(s, e, "<function=")) return 0;
    s += 10;
    const char *gt = memchr(s, '>', (size_t)(e - s));
    if (!gt) return 0;
    const char *nb = skip_ws(s, gt), *ne = gt;
    while (ne > nb && is_ws(ne[-1])) ne--;
    if (ne == nb || memchr(nb, '\n', (size_t)(ne - nb)) || memchr(nb, '<', (size_t)(ne - nb))) return 0;
    char *name = dup_n(nb, (size_t)(ne - nb));
    json_t *args = json_object();
    if (!name || !args) goto fail;
    s = gt + 1;
    for (;;) {
        s = skip_ws(s, e);
        if (s == e) break; /* tolerate a missing </function> */
        if (starts(s, e, "</function>")) {
            s = skip_ws(s + 11, e);
            if (s != e) goto fail;
            break;
        }
        if (!starts(s, e, "<parameter=")) goto fail;
        s += 11;
        const char *pgt = memchr(s, '>', (size_t)(e - s));
        if (!pgt) goto fail;
        const char *pb = skip_ws(s, pgt), *pe = pgt;
        while (pe > pb && is_ws(pe[-1])) pe--;
        if (pe == pb || memchr(pb, '\n', (size_t)(pe - pb)) || memchr(pb, '<', (size_t)(pe - pb))) goto fail;
        char *pname = dup_n(pb, (size_t)(pe - pb));
        if (!pname) goto fail;
        const char *vb = pgt + 1;
        if (vb < e && *vb == '\n') vb++;
        const char *close = memmem(vb, (size_t)(e - vb), "</parameter>", 12);
        const char *next = memmem(vb, (size_t)(e - vb), "<parameter=", 11);
        const char *vend, *after;
        if (close && (!next || close < next)) {
            vend = close;
            after = close + 12;
        } else { /* no </parameter>: the value ends at the next parameter or </function> */
            const char *fend = memmem(vb, (size_t)(e - vb), "</function>", 11);
            vend = e;
            if (next && next < vend) vend = next;
            if (fend && fend < vend) vend = fend;
            after = vend;
        }
        const char *ve = vend;
        if (ve > vb && ve[-1] == '\n') ve--;
        json_t *v = convert_value(tool_param_schema(p->opt.tools, name, pname), vb, (size_t)(ve - vb));
        int bad = !v || json_object_set_new(args, pname, v);
        free(pname);
        if (bad) goto fail;
        s = after;
    }
    *name_out = name;
    *args_out = args;
    return 1;
fail:
    free(name);
    json_decref(args);
    return 0;
}

/* {"name": NAME, "arguments": {...}} */
static int parse_json_call(const char *s, const char *e, char **name_out, json_t **args_out) {
    json_t *j = json_loadb(s, (size_t)(e - s), 0, NULL);
    json_t *name = json_object_get(j, "name");
    json_t *args = json_object_get(j, "arguments");
    if (!args) args = json_object_get(j, "parameters");
    if (!json_is_object(j) || !json_is_string(name) || json_string_length(name) == 0) {
        json_decref(j);
        return 0;
    }
    json_t *a = NULL;
    if (!args || json_is_null(args)) a = json_object();
    else if (json_is_object(args)) a = json_incref(args);
    else if (json_is_string(args)) {
        a = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
        if (!json_is_object(a)) {
            json_decref(a);
            a = NULL;
        }
    }
    if (!a) {
        json_decref(j);
        return 0;
    }
    *name_out = dup_n(json_string_value(name), json_string_length(name));
    *args_out = a;
    json_decref(j);
    if (!*name_out) {
        json_decref(a);
        return 0;
    }
    return 1;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Body of a closed <tool_call> (between the tags), valid UTF-8: emit the call, or 0 when
 * malformed. */
static int emit_tool_call_clean(df_chat_parser *p, const char *s, size_t n, df_chat_deltas *out, int *oom) {
    const char *b = skip_ws(s, s + n), *e = s + n;
    while (e > b && is_ws(e[-1])) e--;
    char *name = NULL;
    json_t *args = NULL;
    int ok = (b < e && *b == '{') ? parse_json_call(b, e, &name, &args) : parse_xml_call(p, b, e, &name, &args);
    if (!ok) return 0;
    jbuf js = {0};
    jpy_json_opts o = {.indent = -1};
    char id[48];
    uint64_t x = p->opt.id_seed ^ ((uint64_t)p->n_tools * 0xD1B54A32D192ED03ull);
    uint64_t h1 = splitmix64(&x), h2 = splitmix64(&x);
    snprintf(id, sizeof id, "call_%016llx%08llx", (unsigned long long)h1, (unsigned long long)(h2 >> 32));
    df_chat_delta *d = NULL;
    if (jpy_dump_json(&js, args, &o, 0) || !(d = delta_push(out, DF_CHAT_DELTA_TOOL_START, p->n_tools)) ||
        !(d->id = dup_n(id, strlen(id))) || !(d->name = name) ||
        delta_text(out, DF_CHAT_DELTA_TOOL_ARGS, p->n_tools, js.p, js.n)) {
        if (!d || !d->name) free(name);
        *oom = 1;
    }
    jbuf_free(&js);
    json_decref(args);
    p->n_tools++;
    return 1;
}

static int emit_tool_call(df_chat_parser *p, const char *s, size_t n, df_chat_deltas *out, int *oom) {
    jbuf clean = {0};
    if (ju8_invalid_at(s, n) < n) { /* names and arguments must be valid UTF-8 (JSON) */
        if (ju8_sanitize(&clean, s, n)) {
            jbuf_free(&clean);
            *oom = 1;
            return 1;
        }
        s = clean.p;
        n = clean.n;
    }
    int r = emit_tool_call_clean(p, s, n, out, oom);
    jbuf_free(&clean);
    return r;
}

/* ---- the state machine ---------------------------------------------------------------- */

static df_status process(df_chat_parser *p, int eof, df_chat_deltas *out, df_error *err) {
    for (;;) {
        const char *s = p->pend.p ? p->pend.p : "";
        size_t n = p->pend.n;
        switch (p->state) {
        case S_START: {
            size_t i = 0;
            while (i < n && is_ws(s[i])) i++;
            size_t rest = n - i;
            if (rest >= 7 && !memcmp(s + i, THINK_OPEN, 7)) {
                consume(p, i + 7);
                p->state = S_REASONING;
                continue;
            }
            if (!eof && (rest == 0 || !memcmp(s + i, THINK_OPEN, rest < 7 ? rest : 7))) return DF_OK;
            p->state = S_CONTENT;
            continue;
        }
        case S_REASONING: {
            const char *hit = find(s, n, THINK_CLOSE);
            if (hit) {
                size_t at = (size_t)(hit - s);
                if (emit(p, CH_REASONING, s, at, out)) return NOMEM(err);
                drop_held(p, CH_REASONING);
                consume(p, at + strlen(THINK_CLOSE));
                p->state = S_CONTENT;
                continue;
            }
            size_t keep = eof ? 0 : partial_tag_suffix(s, n, THINK_CLOSE);
            if (!eof && !keep) keep = partial_utf8_suffix(s, n);
            if (emit(p, CH_REASONING, s, n - keep, out)) return NOMEM(err);
            consume(p, n - keep);
            return DF_OK;
        }
        case S_CONTENT: {
            const char *hit = p->opt.parse_tool_calls ? find(s, n, TOOL_OPEN) : NULL;
            if (hit) {
                size_t at = (size_t)(hit - s);
                if (emit(p, CH_CONTENT, s, at, out)) return NOMEM(err);
                consume(p, at + strlen(TOOL_OPEN));
                p->state = S_TOOL;
                p->tool_scan = 0;
                continue;
            }
            size_t keep = (eof || !p->opt.parse_tool_calls) ? 0 : partial_tag_suffix(s, n, TOOL_OPEN);
            if (!eof && !keep) keep = partial_utf8_suffix(s, n);
            if (emit(p, CH_CONTENT, s, n - keep, out)) return NOMEM(err);
            consume(p, n - keep);
            return DF_OK;
        }
        case S_TOOL: {
            size_t from = p->tool_scan;
            const char *hit = find(s + from, n - from, TOOL_CLOSE);
            if (!hit && !eof) {
                size_t cl = strlen(TOOL_CLOSE);
                p->tool_scan = n >= cl ? n - cl + 1 : 0;
                return DF_OK;
            }
            size_t body = hit ? (size_t)(hit - s) : n;
            int oom = 0;
            if (hit && emit_tool_call(p, s, body, out, &oom)) {
                if (oom) return NOMEM(err);
                drop_held(p, CH_CONTENT);
            } else {
                /* malformed or unterminated: the exact text becomes content */
                if (emit(p, CH_CONTENT, TOOL_OPEN, strlen(TOOL_OPEN), out) || emit(p, CH_CONTENT, s, body, out) ||
                    (hit && emit(p, CH_CONTENT, TOOL_CLOSE, strlen(TOOL_CLOSE), out)))
                    return NOMEM(err);
            }
            consume(p, hit ? body + strlen(TOOL_CLOSE) : n);
            p->state = S_CONTENT;
            continue;
        }
        default: return DF_OK;
        }
    }
}

df_status df_chat_parser_new(const df_chat_parse_options *opt, df_chat_parser **out, df_error *err) {
    *out = NULL;
    df_chat_parser *p = calloc(1, sizeof *p);
    if (!p) return NOMEM(err);
    if (opt) p->opt = *opt;
    p->state = p->opt.thinking_open ? S_REASONING : S_START;
    *out = p;
    return DF_OK;
}

df_status df_chat_parser_feed(df_chat_parser *p, const char *text, size_t len, df_chat_deltas *out, df_error *err) {
    if (p->state == S_DONE || len == 0) return DF_OK;
    if (jbuf_put(&p->pend, text, len)) return NOMEM(err);
    return process(p, 0, out, err);
}

df_status df_chat_parser_finish(df_chat_parser *p, df_chat_deltas *out, df_error *err) {
    if (p->state == S_DONE) return DF_OK;
    df_status st = process(p, 1, out, err);
    if (st) return st;
    drop_held(p, CH_REASONING);
    drop_held(p, CH_CONTENT);
    p->state = S_DONE;
    return DF_OK;
}

int df_chat_parser_tool_calls(const df_chat_parser *p) { return p->n_tools; }

void df_chat_parser_free(df_chat_parser *p) {
    if (!p) return;
    jbuf_free(&p->pend);
    jbuf_free(&p->held[0]);
    jbuf_free(&p->held[1]);
    free(p);
}

/* ---- messages ------------------------------------------------------------------------- */

static int append(char **dst, size_t *len, const char *s, size_t n) {
    char *t = realloc(*dst, *len + n + 1);
    if (!t) return -1;
    if (n) memcpy(t + *len, s, n);
    *len += n;
    t[*len] = 0;
    *dst = t;
    return 0;
}

df_status df_chat_message_apply(df_chat_message *m, const df_chat_deltas *d, df_error *err) {
    if (!m->reasoning && append(&m->reasoning, &m->reasoning_len, "", 0)) return NOMEM(err);
    if (!m->content && append(&m->content, &m->content_len, "", 0)) return NOMEM(err);
    for (size_t i = 0; i < d->n; i++) {
        const df_chat_delta *x = &d->items[i];
        switch (x->kind) {
        case DF_CHAT_DELTA_REASONING:
            if (append(&m->reasoning, &m->reasoning_len, x->text, x->len)) return NOMEM(err);
            break;
        case DF_CHAT_DELTA_CONTENT:
            if (append(&m->content, &m->content_len, x->text, x->len)) return NOMEM(err);
            break;
        case DF_CHAT_DELTA_TOOL_START: {
            if (x->tool_index != (int)m->n_tool_calls)
                return df_error_set(err, DF_ERR_INVALID_ARG, "tool call %d started out of order", x->tool_index);
            df_chat_tool_call *tc = realloc(m->tool_calls, (m->n_tool_calls + 1) * sizeof *tc);
            if (!tc) return NOMEM(err);
            m->tool_calls = tc;
            df_chat_tool_call *c = &tc[m->n_tool_calls];
            memset(c, 0, sizeof *c);
            m->n_tool_calls++;
            size_t zero = 0;
            if (!(c->id = dup_n(x->id, strlen(x->id))) || !(c->name = dup_n(x->name, strlen(x->name))) ||
                append(&c->arguments, &zero, "", 0))
                return NOMEM(err);
            break;
        }
        case DF_CHAT_DELTA_TOOL_ARGS: {
            if (x->tool_index < 0 || (size_t)x->tool_index >= m->n_tool_calls)
                return df_error_set(err, DF_ERR_INVALID_ARG, "arguments for tool call %d that was not started",
                                    x->tool_index);
            df_chat_tool_call *c = &m->tool_calls[x->tool_index];
            size_t len = strlen(c->arguments);
            if (append(&c->arguments, &len, x->text, x->len)) return NOMEM(err);
            break;
        }
        }
    }
    return DF_OK;
}

void df_chat_message_free(df_chat_message *m) {
    if (!m) return;
    free(m->reasoning);
    free(m->content);
    for (size_t i = 0; i < m->n_tool_calls; i++) {
        free(m->tool_calls[i].id);
        free(m->tool_calls[i].name);
        free(m->tool_calls[i].arguments);
    }
    free(m->tool_calls);
    memset(m, 0, sizeof *m);
}

df_status df_chat_parse(const char *text, size_t len, const df_chat_parse_options *opt, df_chat_message *out,
                        df_error *err) {
    memset(out, 0, sizeof *out);
    df_chat_parser *p;
    df_chat_deltas d = {0};
    df_status st = df_chat_parser_new(opt, &p, err);
    if (st) return st;
    if (!(st = df_chat_parser_feed(p, text, len, &d, err)) && !(st = df_chat_parser_finish(p, &d, err)))
        st = df_chat_message_apply(out, &d, err);
    df_chat_deltas_free(&d);
    df_chat_parser_free(p);
    if (st) df_chat_message_free(out);
    return st;
}

json_t *df_chat_message_to_json(const df_chat_message *m) {
    json_t *o = json_object();
    if (!o) return NULL;
    int bad = json_object_set_new(o, "role", json_string("assistant"));
    size_t cl = m->content ? m->content_len : 0;
    if (cl == 0 && m->n_tool_calls) bad |= json_object_set_new(o, "content", json_null());
    else bad |= json_object_set_new(o, "content", json_stringn(m->content ? m->content : "", cl));
    if (m->reasoning && m->reasoning_len)
        bad |= json_object_set_new(o, "reasoning_content", json_stringn(m->reasoning, m->reasoning_len));
    if (m->n_tool_calls) {
        json_t *calls = json_array();
        for (size_t i = 0; calls && i < m->n_tool_calls; i++) {
            const df_chat_tool_call *c = &m->tool_calls[i];
            bad |= json_array_append_new(calls, json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", c->id, "type", "function",
                                                          "function", "name", c->name, "arguments", c->arguments));
        }
        bad |= !calls || json_object_set_new(o, "tool_calls", calls);
    }
    if (bad) {
        json_decref(o);
        return NULL;
    }
    return o;
}
