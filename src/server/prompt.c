/* dflash server: chat prompts (see prompt.h).
 *
 * Untrusted text: before rendering, every occurrence of a special token's text inside a
 * string of the request (values and object keys, at any depth) is replaced by a sentinel —
 * U+10FFFF followed by the private-use character U+F0000 + k for special token k — and a
 * U+10FFFF of the request itself is doubled, so no request text can pose as a sentinel. The
 * template then renders as usual; afterwards special tokens are matched only in the rendered
 * text (where the template wrote them), and every stretch between them is encoded with
 * special tokens off after the sentinels are turned back into the original text. The
 * tokenizer encodes the text between added tokens independently, so when the request holds
 * no special token text, this equals encoding the whole prompt with special tokens on.
 */
#include "server/prompt.h"

#include <stdlib.h>
#include <string.h>

#include "text/jinja_internal.h"

/* Plain ChatML for packs without a chat template; thinking follows enable_thinking as the
 * Qwen3.5 template does. Tools are not shown (the format has no place for them). */
static const char BUILTIN_CHATML[] =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}";

#define SENTINEL_LEAD "\xF4\x8F\xBF\xBF" /* U+10FFFF */
#define SENTINEL_BASE 0xF0000
#define NOMEM(err) df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt")

static int by_length_desc(const void *a, const void *b) {
    size_t la = strlen(*(char *const *)a), lb = strlen(*(char *const *)b);
    return la < lb ? 1 : la > lb ? -1 : 0;
}

df_status df_chat_setup_init(df_chat_setup *cs, const char *pack_dir, const df_tokenizer *tok,
                             int default_enable_thinking, df_error *err) {
    memset(cs, 0, sizeof *cs);
    cs->tok = tok;
    cs->default_enable_thinking = default_enable_thinking ? 1 : 0;
    char *text = NULL;
    size_t len = 0;
    df_error rerr = {0};
    df_status st;
    if (df_chat_template_read(pack_dir, &text, &len, &rerr) != DF_OK) {
        *err = rerr;
        return rerr.code;
    }
    if (text) {
        st = df_chat_template_parse(text, len, &cs->tmpl, err);
        if (st) df_error_prefix(err, "%s: chat template", pack_dir);
        cs->xml_tools = strstr(text, "<function=") != NULL;
        free(text);
        if (st) return st;
    } else { /* the pack has none */
        cs->builtin = 1;
        st = df_chat_template_parse(BUILTIN_CHATML, sizeof BUILTIN_CHATML - 1, &cs->tmpl, err);
        if (st) return st;
    }
    /* the special tokens, longest first (a longer one wins where two start together) */
    int32_t V = df_tokenizer_vocab_size(tok);
    int n = 0;
    for (int32_t id = 0; id < V; id++) n += df_tokenizer_is_special(tok, id) != 0;
    cs->special = calloc((size_t)n + 1, sizeof *cs->special);
    cs->special_len = calloc((size_t)n + 1, sizeof *cs->special_len);
    cs->special_id = calloc((size_t)n + 1, sizeof *cs->special_id);
    if (!cs->special || !cs->special_len || !cs->special_id) goto oom;
    for (int32_t id = 0; id < V; id++) {
        size_t k = 0;
        const char *piece = df_tokenizer_is_special(tok, id) ? df_tokenizer_piece(tok, id, &k) : NULL;
        if (!piece || k == 0) continue;
        if (!(cs->special[cs->n_special++] = strndup(piece, k))) goto oom;
    }
    qsort(cs->special, (size_t)cs->n_special, sizeof *cs->special, by_length_desc);
    for (int i = 0; i < cs->n_special; i++) {
        cs->special_len[i] = strlen(cs->special[i]);
        cs->special_id[i] = df_tokenizer_token_id(tok, cs->special[i]);
    }
    return DF_OK;
oom:
    df_chat_setup_free(cs);
    return df_error_set(err, DF_ERR_NOMEM, "out of memory loading the chat template");
}

void df_chat_setup_free(df_chat_setup *cs) {
    if (!cs) return;
    df_chat_template_free(cs->tmpl);
    if (cs->special)
        for (int i = 0; i < cs->n_special; i++) free(cs->special[i]);
    free(cs->special);
    free(cs->special_len);
    free(cs->special_id);
    memset(cs, 0, sizeof *cs);
}

/* The special token whose text starts at s (n bytes left), or -1. */
static int special_at(const df_chat_setup *cs, const char *s, size_t n) {
    for (int i = 0; i < cs->n_special; i++)
        if (cs->special_len[i] <= n && s[0] == cs->special[i][0] && !memcmp(s, cs->special[i], cs->special_len[i]))
            return i;
    return -1;
}

#define LEAD_LEN (sizeof SENTINEL_LEAD - 1)

static int is_lead(const char *s, size_t n) { return n >= LEAD_LEN && !memcmp(s, SENTINEL_LEAD, LEAD_LEN); }

/* 1 if s holds a special token's text or the sentinel lead character (both are escaped). */
static int has_special(const df_chat_setup *cs, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (special_at(cs, s + i, n - i) >= 0 || is_lead(s + i, n - i)) return 1;
    return 0;
}

/* s with each special token's text replaced by its sentinel, and each U+10FFFF doubled (so a
 * request cannot write a sentinel itself); NULL when out of memory. */
static json_t *sentinel_string(const df_chat_setup *cs, const char *s, size_t n) {
    jbuf b = {0};
    int bad = 0;
    for (size_t i = 0; i < n && !bad;) {
        int k = special_at(cs, s + i, n - i);
        if (k >= 0) {
            bad = jbuf_puts(&b, SENTINEL_LEAD) || ju8_put(&b, SENTINEL_BASE + k);
            i += cs->special_len[k];
        } else if (is_lead(s + i, n - i)) {
            bad = jbuf_puts(&b, SENTINEL_LEAD SENTINEL_LEAD);
            i += LEAD_LEN;
        } else {
            bad = jbuf_putc(&b, s[i++]);
        }
    }
    json_t *j = bad ? NULL : json_stringn_nocheck(b.p ? b.p : "", b.n);
    jbuf_free(&b);
    return j;
}

/* A copy of v in which no string (value or key) holds a special token's text. */
static json_t *sanitize(const df_chat_setup *cs, json_t *v) {
    if (json_is_string(v)) {
        if (!has_special(cs, json_string_value(v), json_string_length(v))) return json_incref(v);
        return sentinel_string(cs, json_string_value(v), json_string_length(v));
    }
    if (json_is_array(v)) {
        json_t *a = json_array();
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) {
            if (!a || json_array_append_new(a, sanitize(cs, x))) {
                json_decref(a);
                return NULL;
            }
        }
        return a;
    }
    if (json_is_object(v)) {
        json_t *o = json_object();
        const char *key;
        size_t klen;
        json_t *x;
        json_object_keylen_foreach(v, key, klen, x) {
            json_t *val = o ? sanitize(cs, x) : NULL;
            int bad = !val;
            if (!bad && has_special(cs, key, klen)) {
                json_t *k = sentinel_string(cs, key, klen);
                bad = !k || json_object_setn_new_nocheck(o, json_string_value(k), json_string_length(k), val);
                json_decref(k);
            } else if (!bad) {
                bad = json_object_setn_new_nocheck(o, key, klen, val);
            }
            if (bad) {
                json_decref(o);
                return NULL;
            }
        }
        return o;
    }
    return json_incref(v);
}

/* Appends s[0..n) to b with every sentinel turned back into its special token's text and
 * every doubled U+10FFFF into one. */
static int restore(const df_chat_setup *cs, const char *s, size_t n, jbuf *b) {
    size_t i = 0;
    while (i < n) {
        const char *hit = memmem(s + i, n - i, SENTINEL_LEAD, LEAD_LEN);
        size_t upto = hit ? (size_t)(hit - s) : n;
        if (jbuf_put(b, s + i, upto - i)) return -1;
        i = upto;
        if (!hit) break;
        i += LEAD_LEN;
        size_t adv = 0;
        int32_t c = i < n ? ju8_decode(s + i, n - i, &adv) : -1;
        if (is_lead(s + i, n - i)) { /* an escaped U+10FFFF of the request */
            if (jbuf_put(b, SENTINEL_LEAD, LEAD_LEN)) return -1;
            i += LEAD_LEN;
        } else if (c >= SENTINEL_BASE && c < SENTINEL_BASE + cs->n_special) {
            if (jbuf_puts(b, cs->special[c - SENTINEL_BASE])) return -1;
            i += adv;
        } else if (jbuf_put(b, SENTINEL_LEAD, LEAD_LEN)) { /* a lone one the template wrote */
            return -1;
        }
    }
    return 0;
}

typedef struct idbuf {
    int32_t *p;
    size_t n, cap;
} idbuf;

static int ids_put(idbuf *b, const int32_t *ids, size_t k) {
    if (b->n + k > b->cap) {
        size_t cap = (b->n + k) * 2 + 64;
        int32_t *p = realloc(b->p, cap * sizeof *p);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    if (k) memcpy(b->p + b->n, ids, k * sizeof *ids);
    b->n += k;
    return 0;
}

/* Encodes one stretch of rendered text (no template-written special token inside). */
static df_status encode_stretch(const df_chat_setup *cs, const char *s, size_t n, idbuf *out, df_error *err) {
    if (n == 0) return DF_OK;
    jbuf b = {0};
    if (restore(cs, s, n, &b)) {
        jbuf_free(&b);
        return NOMEM(err);
    }
    int32_t *ids = NULL;
    size_t k = 0;
    df_status st = df_tokenizer_encode(cs->tok, b.p ? b.p : "", b.n, 0, &ids, &k, err);
    if (st == DF_OK && ids_put(out, ids, k)) st = NOMEM(err);
    free(ids);
    jbuf_free(&b);
    return st;
}

static df_status encode_rendered(const df_chat_setup *cs, const char *s, size_t n, idbuf *out, df_error *err) {
    size_t start = 0;
    for (size_t i = 0; i < n;) {
        int k = special_at(cs, s + i, n - i);
        if (k < 0) {
            i++;
            continue;
        }
        df_status st = encode_stretch(cs, s + start, i - start, out, err);
        if (st) return st;
        if (ids_put(out, &cs->special_id[k], 1)) return NOMEM(err);
        i += cs->special_len[k];
        start = i;
    }
    return encode_stretch(cs, s + start, n - start, out, err);
}

/* The template variables' source: messages (developer -> system), tools unless choice is
 * NONE, and the rendering switches, sanitized. */
static json_t *template_request(const df_chat_setup *cs, const json_t *request, df_tool_choice choice) {
    json_t *r = json_object();
    if (!r) return NULL;
    static const char *const keys[] = {"messages", "tools", "enable_thinking", "chat_template_kwargs",
                                       "add_generation_prompt"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        json_t *v = json_object_get(request, keys[i]);
        if (!v || (i == 1 && choice == DF_TOOL_CHOICE_NONE)) continue;
        json_t *c = sanitize(cs, v);
        if (!c || json_object_set_new(r, keys[i], c)) {
            json_decref(r);
            return NULL;
        }
    }
    json_t *msgs = json_object_get(r, "messages");
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        json_t *role = json_object_get(m, "role");
        if (json_is_string(role) && !strcmp(json_string_value(role), "developer")) {
            json_t *copy = json_copy(m);
            if (!copy || json_object_set_new(copy, "role", json_string("system")) ||
                json_array_set_new(msgs, i, copy)) {
                json_decref(r);
                return NULL;
            }
        }
    }
    return r;
}

df_status df_chat_build(const df_chat_setup *cs, const json_t *request, df_tool_choice choice, const char *tool_name,
                        int want_ids, df_chat_built *out, df_error *err) {
    memset(out, 0, sizeof *out);
    json_t *req = template_request(cs, request, choice);
    if (!req) return NOMEM(err);
    df_chat_render_options ro = {.default_enable_thinking = cs->default_enable_thinking};
    df_chat_prompt p;
    df_status st = df_chat_render(cs->tmpl, req, &ro, &p, err);
    json_decref(req);
    if (st) return st;

    jbuf prefix = {0}, text = {0};
    idbuf ids = {0};
    int bad = 0;
    if (choice == DF_TOOL_CHOICE_REQUIRED || choice == DF_TOOL_CHOICE_NAMED) {
        if (p.thinking_open) bad |= jbuf_puts(&prefix, "\n</think>\n\n");
        bad |= jbuf_puts(&prefix, "<tool_call>\n");
        if (choice == DF_TOOL_CHOICE_NAMED && tool_name) {
            if (cs->xml_tools) bad |= jbuf_printf(&prefix, "<function=%s>\n", tool_name);
            else bad |= jbuf_printf(&prefix, "{\"name\": \"%s\", \"arguments\": ", tool_name);
        }
    }
    bad |= jbuf_puts(&prefix, "");
    /* the printed prompt: sentinels back to their text */
    bad = bad || restore(cs, p.text, p.len, &text) || jbuf_put(&text, prefix.p, prefix.n);
    if (bad) {
        st = NOMEM(err);
        goto done;
    }
    if (want_ids) {
        /* prompt and prefix in one piece: BPE may merge across the seam */
        jbuf raw = {0};
        if (jbuf_put(&raw, p.text, p.len) || jbuf_put(&raw, prefix.p, prefix.n)) {
            jbuf_free(&raw);
            st = NOMEM(err);
            goto done;
        }
        const size_t max_piece = df_tokenizer_max_piece_len(cs->tok);
        if (cs->max_ids && max_piece && raw.n > DF_PROMPT_EXACT_BYTES && raw.n / max_piece >= cs->max_ids) {
            out->too_long = 1; /* tokenizing it would only cost time and memory */
            ids.n = raw.n / max_piece;
        } else {
            st = encode_rendered(cs, raw.p, raw.n, &ids, err);
        }
        jbuf_free(&raw);
        if (st) goto done;
    }
    out->thinking_open = p.thinking_open;
    out->prefix = jbuf_take(&prefix, NULL);
    out->text = jbuf_take(&text, &out->len);
    out->ids = ids.p;
    out->n_ids = ids.n;
    ids.p = NULL;
    if (!out->prefix || !out->text) {
        df_chat_built_free(out);
        st = NOMEM(err);
    }
done:
    df_chat_prompt_free(&p);
    jbuf_free(&prefix);
    jbuf_free(&text);
    free(ids.p);
    return st;
}

void df_chat_built_free(df_chat_built *b) {
    if (!b) return;
    free(b->text);
    free(b->prefix);
    free(b->ids);
    memset(b, 0, sizeof *b);
}
