/* Chat prompt rendering: OpenAI request -> template variables -> prompt (see dflash/chat.h).
 * The variables follow transformers' apply_chat_template (messages, tools,
 * add_generation_prompt, then the chat_template_kwargs) and vLLM's request handling (content
 * part lists, tool-call arguments given as JSON strings). */
#include "dflash/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/files.h"
#include "text/jinja_internal.h"

struct df_chat_template {
    df_jinja_template *jt;
    int content_lists;
};

df_status df_chat_template_parse(const char *src, size_t len, df_chat_template **out, df_error *err) {
    *out = NULL;
    df_chat_template *t = calloc(1, sizeof *t);
    if (!t) return df_error_set(err, DF_ERR_NOMEM, "out of memory loading the chat template");
    df_status st = df_jinja_parse(src, len, &t->jt, err);
    if (st) {
        free(t);
        return st;
    }
    t->content_lists = df_jinja_handles_content_lists(t->jt);
    *out = t;
    return DF_OK;
}

void df_chat_template_free(df_chat_template *t) {
    if (!t) return;
    df_jinja_free(t->jt);
    free(t);
}

const df_jinja_template *df_chat_template_jinja(const df_chat_template *t) { return t ? t->jt : NULL; }

int df_chat_template_handles_content_lists(const df_chat_template *t) { return t ? t->content_lists : 0; }

static df_status read_file(const char *path, char **text, size_t *len, df_error *err) {
    FILE *f = df_fopen_regular(path, err);
    if (!f) return err ? err->code : DF_ERR_IO;
    jbuf b = {0};
    char chunk[65536];
    size_t k;
    while ((k = fread(chunk, 1, sizeof chunk, f)) > 0)
        if (jbuf_put(&b, chunk, k)) {
            fclose(f);
            jbuf_free(&b);
            return df_error_set(err, DF_ERR_NOMEM, "out of memory reading %s", path);
        }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        jbuf_free(&b);
        return df_error_set(err, DF_ERR_IO, "error reading %s", path);
    }
    *text = jbuf_take(&b, len);
    return *text ? DF_OK : df_error_set(err, DF_ERR_NOMEM, "out of memory reading %s", path);
}

/* The "chat_template" value of a JSON file: a string, or [{"name", "template"}] ("default").
 * optional: a file without the key (tokenizer_config.json often has none) gives DF_OK with
 * *text NULL (no template) instead of a format error. */
/* The JSON of the regular file at path (NULL with err set when it cannot be read or parsed). */
static json_t *json_file(const char *path, df_error *err) {
    json_error_t je;
    FILE *f = df_fopen_regular(path, err);
    if (!f) return NULL;
    json_t *root = json_loadf(f, 0, &je);
    fclose(f);
    if (!root) df_error_set(err, DF_ERR_FORMAT, "%s: invalid JSON at line %d: %s", path, je.line, je.text);
    return root;
}

static df_status template_from_json(const char *path, int optional, char **text, size_t *len, df_error *err) {
    json_t *root = json_file(path, err);
    if (!root) return err ? err->code : DF_ERR_FORMAT;
    json_t *ct = json_object_get(root, "chat_template");
    const json_t *s = NULL;
    if (json_is_string(ct)) {
        s = ct;
    } else if (json_is_array(ct)) {
        size_t i;
        json_t *e;
        json_array_foreach(ct, i, e) {
            json_t *name = json_object_get(e, "name"), *tpl = json_object_get(e, "template");
            if (json_is_string(name) && !strcmp(json_string_value(name), "default") && json_is_string(tpl)) s = tpl;
        }
    }
    if (!s) {
        const int absent = ct == NULL;
        json_decref(root);
        if (optional && absent) { /* no template there: not an error (*text stays NULL) */
            *text = NULL;
            *len = 0;
            return DF_OK;
        }
        return df_error_set(err, DF_ERR_FORMAT, "%s: no \"chat_template\" string (or \"default\" entry)", path);
    }
    *len = json_string_length(s);
    *text = malloc(*len + 1);
    if (*text) {
        memcpy(*text, json_string_value(s), *len);
        (*text)[*len] = 0;
    }
    json_decref(root);
    return *text ? DF_OK : df_error_set(err, DF_ERR_NOMEM, "out of memory reading %s", path);
}

df_status df_chat_template_read(const char *pack_dir, char **text, size_t *len, df_error *err) {
    char path[4096];
    size_t dummy;
    if (!len) len = &dummy;
    *text = NULL;
    *len = 0;
    /* tokenizer_config.json, when present, is valid JSON even where a template file takes
     * precedence over it: a broken pack file is reported, not passed over */
    snprintf(path, sizeof path, "%s/tokenizer_config.json", pack_dir);
    if (df_path_present(path)) {
        json_t *root = json_file(path, err);
        if (!root) return err ? err->code : DF_ERR_FORMAT;
        json_decref(root);
    }
    /* a file that is there but cannot be read (a FIFO, a folder, a link loop) is an error, never
     * taken for an absent one (df_path_present) */
    snprintf(path, sizeof path, "%s/chat_template.jinja", pack_dir);
    if (df_path_present(path)) {
        df_status st = read_file(path, text, len, err);
        if (st == DF_OK && *len == 0) {
            free(*text);
            *text = NULL;
            st = df_error_set(err, DF_ERR_FORMAT, "%s: empty chat template", path);
        }
        return st;
    }
    snprintf(path, sizeof path, "%s/chat_template.json", pack_dir);
    if (df_path_present(path)) return template_from_json(path, 0, text, len, err);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", pack_dir);
    if (df_path_present(path)) return template_from_json(path, 1, text, len, err);
    return DF_OK; /* none: *text NULL */
}

df_status df_chat_template_load(const char *pack_dir, df_chat_template **out, df_error *err) {
    char *text;
    size_t len;
    *out = NULL;
    df_status st = df_chat_template_read(pack_dir, &text, &len, err);
    if (st) return st;
    if (!text)
        return df_error_set(err, DF_ERR_IO,
                            "%s: no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json)",
                            pack_dir);
    st = df_chat_template_parse(text, len, out, err);
    free(text);
    if (st) df_error_prefix(err, "%s: chat template", pack_dir);
    return st;
}

/* ---- rendering ------------------------------------------------------------------------ */

#define BAD(...) df_error_set(err, DF_ERR_INVALID_ARG, __VA_ARGS__)

/* Normalises message i (a deep copy is made when something changes). */
static df_status normalize_message(const df_chat_template *t, json_t *msgs, size_t i, df_error *err) {
    json_t *m = json_array_get(msgs, i);
    if (!json_is_object(m)) return BAD("messages[%zu]: expected an object", i);
    json_t *role = json_object_get(m, "role");
    if (!json_is_string(role)) return BAD("messages[%zu].role: expected a string", i);
    json_t *content = json_object_get(m, "content");
    json_t *copy = NULL;
    if (content && !json_is_string(content) && !json_is_null(content) && !json_is_array(content))
        return BAD("messages[%zu].content: expected a string, an array of content parts or null", i);
    if (!content || json_is_null(content)) {
        /* Templates without list support treat content as a string ("'x' in content",
         * content.startswith(...)); vLLM passes "" for a missing content there. */
        if (!t->content_lists) {
            copy = json_copy(m);
            if (!copy || json_object_set_new(copy, "content", json_string("")))
                goto oom;
        }
    } else if (json_is_array(content)) {
        size_t k;
        json_t *part;
        int all_text = 1;
        json_array_foreach(content, k, part) {
            json_t *type = json_object_get(part, "type");
            if (!json_is_object(part) || !json_is_string(type))
                return BAD("messages[%zu].content[%zu]: expected an object with a string \"type\"", i, k);
            if (!strcmp(json_string_value(type), "text")) {
                if (!json_is_string(json_object_get(part, "text")))
                    return BAD("messages[%zu].content[%zu].text: expected a string", i, k);
            } else {
                all_text = 0;
            }
        }
        if (!t->content_lists && all_text) {
            jbuf b = {0};
            json_array_foreach(content, k, part) {
                json_t *s = json_object_get(part, "text");
                if (jbuf_put(&b, json_string_value(s), json_string_length(s))) {
                    jbuf_free(&b);
                    return df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt");
                }
            }
            copy = json_copy(m);
            if (!copy || json_object_set_new(copy, "content", json_stringn_nocheck(b.p ? b.p : "", b.n))) {
                jbuf_free(&b);
                json_decref(copy);
                return df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt");
            }
            jbuf_free(&b);
        }
    }
    json_t *calls = json_object_get(m, "tool_calls");
    if (calls && !json_is_null(calls)) {
        if (!json_is_array(calls)) {
            json_decref(copy);
            return BAD("messages[%zu].tool_calls: expected an array", i);
        }
        size_t k;
        json_t *call;
        json_t *new_calls = NULL;
        json_array_foreach(calls, k, call) {
            json_t *fn = json_object_get(call, "function");
            if (!json_is_object(call) || (fn && !json_is_object(fn))) {
                json_decref(copy);
                json_decref(new_calls);
                return BAD("messages[%zu].tool_calls[%zu]: expected an object with a \"function\" object", i, k);
            }
            json_t *args = fn ? json_object_get(fn, "arguments") : NULL;
            if (!json_is_string(args)) continue;
            json_t *parsed = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
            if (!json_is_object(parsed)) {
                json_decref(parsed);
                continue;
            }
            if (!new_calls && !(new_calls = json_deep_copy(calls))) {
                json_decref(parsed);
                json_decref(copy);
                return df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt");
            }
            json_object_set_new(json_object_get(json_array_get(new_calls, k), "function"), "arguments", parsed);
        }
        if (new_calls) {
            if (!copy) copy = json_copy(m);
            if (!copy || json_object_set_new(copy, "tool_calls", new_calls)) {
                json_decref(copy);
                return df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt");
            }
        }
    }
    if (copy && json_array_set_new(msgs, i, copy)) return df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt");
    return DF_OK;
oom:
    json_decref(copy);
    return df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt");
}

static int ends_with_open_think(const char *s, size_t n) {
    while (n > 0 && ju_isspace((unsigned char)s[n - 1])) n--;
    return n >= 7 && !memcmp(s + n - 7, "<think>", 7);
}

const char *df_chat_kwargs_reserved(const json_t *kwargs) {
    static const char *const reserved[] = {"messages", "tools", "add_generation_prompt"};
    if (!json_is_object(kwargs)) return NULL;
    for (size_t k = 0; k < sizeof reserved / sizeof reserved[0]; k++)
        if (json_object_get(kwargs, reserved[k])) return reserved[k];
    return NULL;
}

df_status df_chat_render(const df_chat_template *t, const json_t *request, const df_chat_render_options *opt,
                         df_chat_prompt *out, df_error *err) {
    memset(out, 0, sizeof *out);
    if (!t) return df_error_set(err, DF_ERR_INVALID_ARG, "no chat template");
    if (!json_is_object(request)) return BAD("request body: expected a JSON object");
    json_t *msgs_in = json_object_get(request, "messages");
    if (!json_is_array(msgs_in)) return BAD("messages: expected an array");
    if (json_array_size(msgs_in) == 0)
        return BAD("Cannot apply chat template to an empty conversation. Provide at least one message.");
    json_t *tools = json_object_get(request, "tools");
    if (tools && !json_is_null(tools) && !json_is_array(tools)) return BAD("tools: expected an array");
    json_t *kwargs = json_object_get(request, "chat_template_kwargs");
    if (kwargs && !json_is_null(kwargs) && !json_is_object(kwargs)) return BAD("chat_template_kwargs: expected an object");
    json_t *agp = json_object_get(request, "add_generation_prompt");
    if (agp && !json_is_null(agp) && !json_is_boolean(agp)) return BAD("add_generation_prompt: expected a boolean");
    json_t *et = json_object_get(request, "enable_thinking");
    if (et && !json_is_null(et) && !json_is_boolean(et)) return BAD("enable_thinking: expected a boolean");

    json_t *vars = json_object(), *msgs = json_copy(msgs_in);
    df_status st = DF_OK;
    if (!vars || !msgs) {
        st = df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt");
        goto done;
    }
    for (size_t i = 0; i < json_array_size(msgs) && !st; i++) st = normalize_message(t, msgs, i, err);
    if (st) goto done;
    if (opt && json_is_object(opt->extra_vars)) json_object_update(vars, (json_t *)opt->extra_vars);
    if (opt && opt->default_enable_thinking >= 0)
        json_object_set_new(vars, "enable_thinking", json_boolean(opt->default_enable_thinking));
    if (json_is_object(kwargs)) {
        const char *reserved = df_chat_kwargs_reserved(kwargs);
        if (reserved) {
            st = BAD("chat_template_kwargs.%s: may not be set here (use the request field)", reserved);
            goto done;
        }
        json_object_update(vars, kwargs);
    }
    if (json_is_boolean(et)) json_object_set(vars, "enable_thinking", et);
    json_object_set(vars, "messages", msgs);
    if (json_is_array(tools)) json_object_set(vars, "tools", tools);
    json_object_set_new(vars, "add_generation_prompt", json_boolean(!json_is_false(agp)));

    st = df_jinja_render(t->jt, vars, opt ? opt->limits : NULL, &out->text, &out->len, err);
    if (!st) out->thinking_open = !json_is_false(agp) && ends_with_open_think(out->text, out->len);
done:
    json_decref(vars);
    json_decref(msgs);
    return st;
}

void df_chat_prompt_free(df_chat_prompt *p) {
    if (!p) return;
    free(p->text);
    memset(p, 0, sizeof *p);
}
