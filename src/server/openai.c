/* dflash server: OpenAI request validation and error objects (see openai.h).
 *
 * Validation follows the OpenAI API's behaviour: unknown fields are ignored, a known field
 * with the wrong type or an out-of-range value is a 400 naming the field in "param"
 * (e.g. "messages[2].content[0].text"), and a known field set to null counts as omitted.
 */
#include "server/openai.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int df_api_error_set(df_api_error *e, int status, const char *type, const char *code, const char *param,
                     const char *fmt, ...) {
    e->status = status;
    e->type = type;
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

json_t *df_api_error_json(const df_api_error *e) {
    json_t *inner = json_object();
    json_t *outer = json_object();
    if (!inner || !outer) {
        json_decref(inner);
        json_decref(outer);
        return NULL;
    }
    json_object_set_new(inner, "message", df_json_text(e->message, strlen(e->message)));
    json_object_set_new(inner, "type", json_string(e->type ? e->type : "invalid_request_error"));
    json_object_set_new(inner, "code", e->code ? json_string(e->code) : json_null());
    json_object_set_new(inner, "param", e->param[0] ? df_json_text(e->param, strlen(e->param)) : json_null());
    json_object_set_new(outer, "error", inner);
    return outer;
}

json_t *df_json_text(const char *text, size_t len) {
    json_t *j = json_stringn(text, len);
    if (j) return j;
    /* Not UTF-8 (the engine promises UTF-8; a request's bytes may be anything): keep the
     * ASCII and replace every other byte, so the answer is still valid JSON. */
    char *buf = malloc(len + 1);
    if (!buf) return NULL;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        buf[i] = (c >= 0x80 || c == 0) ? '?' : (char)c;
    }
    j = json_stringn(buf, len);
    free(buf);
    return j;
}

/* ---- field validators ------------------------------------------------------------------ */

static const char *json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "a value";
}

static int type_error(df_api_error *e, const char *param, const char *expected, const json_t *got) {
    return df_api_error_set(e, 400, "invalid_request_error", "invalid_type", param,
                            "Invalid type for '%s': expected %s, but got %s instead.", param, expected,
                            json_type_name(got));
}

static int missing_error(df_api_error *e, const char *param) {
    return df_api_error_set(e, 400, "invalid_request_error", "missing_required_parameter", param,
                            "Missing required parameter: '%s'.", param);
}

static int value_error(df_api_error *e, const char *param, const char *fmt, double got) {
    char expect[160];
    snprintf(expect, sizeof expect, fmt, got);
    return df_api_error_set(e, 400, "invalid_request_error", "invalid_value", param, "Invalid '%s': %s", param,
                            expect);
}

/* The string field key of obj (param names it in errors); NULL with e set when it is
 * missing, null or not a string. */
static json_t *required_string(json_t *obj, const char *key, const char *param, df_api_error *e) {
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) missing_error(e, param);
    else if (!json_is_string(v)) type_error(e, param, "a string", v);
    else return v;
    return NULL;
}

/* A field that is absent or null counts as omitted: returns NULL. */
static json_t *field(json_t *root, const char *name) {
    json_t *v = json_object_get(root, name);
    return (v && !json_is_null(v)) ? v : NULL;
}

/* A number field in [lo, hi] (lo excluded when lo_open). *out untouched when omitted. */
static int get_number(json_t *root, const char *name, double lo, int lo_open, double hi, float *out,
                      df_api_error *e) {
    json_t *v = field(root, name);
    if (!v) return 0;
    if (!json_is_number(v)) return type_error(e, name, "a number", v);
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || (lo_open && x == lo) || x > hi) {
        char fmt[128];
        snprintf(fmt, sizeof fmt, "expected a value %s %g and <= %g, but got %%g instead.", lo_open ? ">" : ">=",
                 lo, hi);
        return value_error(e, name, fmt, x);
    }
    *out = (float)x;
    return 0;
}

/* An integer field in [lo, hi] (a real with an integral value counts). *given set to 1
 * when present. */
static int get_integer(json_t *root, const char *name, long long lo, long long hi, long long *out, int *given,
                       df_api_error *e) {
    json_t *v = field(root, name);
    if (!v) return 0;
    long long x;
    if (json_is_integer(v)) {
        x = (long long)json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9.0e15) {
        x = (long long)json_real_value(v);
    } else {
        return type_error(e, name, "an integer", v);
    }
    if (x < lo || x > hi) {
        char fmt[128];
        snprintf(fmt, sizeof fmt, "expected an integer >= %lld and <= %lld, but got %%.0f instead.", lo, hi);
        return value_error(e, name, fmt, (double)x);
    }
    *out = x;
    if (given) *given = 1;
    return 0;
}

static int get_bool(json_t *root, const char *name, int *out, df_api_error *e) {
    json_t *v = field(root, name);
    if (!v) return 0;
    if (!json_is_boolean(v)) return type_error(e, name, "a boolean", v);
    *out = json_is_true(v);
    return 0;
}

static int unsupported(df_api_error *e, const char *param, const char *what) {
    return df_api_error_set(e, 400, "invalid_request_error", "unsupported_value", param,
                            "%s is not supported by this server yet.", what);
}

/* ---- messages -------------------------------------------------------------------------- */

/* Accepted roles and the name each renders as. */
static const char *render_role(const char *role) {
    static const char *const roles[][2] = {
        {"system", "system"}, {"developer", "system"}, {"user", "user"}, {"assistant", "assistant"}, {"tool", "tool"},
    };
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
        if (strcmp(role, roles[i][0]) == 0) return roles[i][1];
    return NULL;
}

/* The text of a message's content: a string or a list of {"type": "text", "text": ...}
 * parts (concatenated as they are, as the Qwen chat template does). */
static int message_text(json_t *content, int i, char **out, df_api_error *e) {
    char param[96];
    snprintf(param, sizeof param, "messages[%d].content", i);
    if (json_is_string(content)) {
        *out = strndup(json_string_value(content), json_string_length(content));
        if (!*out) return df_api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return 0;
    }
    if (!json_is_array(content)) return type_error(e, param, "a string or an array of content parts", content);
    size_t total = 0, n = json_array_size(content);
    for (size_t j = 0; j < n; j++) {
        json_t *part = json_array_get(content, j);
        snprintf(param, sizeof param, "messages[%d].content[%zu]", i, j);
        if (!json_is_object(part)) return type_error(e, param, "an object", part);
        snprintf(param, sizeof param, "messages[%d].content[%zu].type", i, j);
        json_t *type = required_string(part, "type", param, e);
        if (!type) return -1;
        if (strcmp(json_string_value(type), "text") != 0) {
            if (strcmp(json_string_value(type), "image_url") == 0) return unsupported(e, param, "Image content");
            return df_api_error_set(e, 400, "invalid_request_error", "invalid_value", param,
                                    "Invalid value: '%.64s'. Supported values are: 'text'.", json_string_value(type));
        }
        snprintf(param, sizeof param, "messages[%d].content[%zu].text", i, j);
        json_t *text = required_string(part, "text", param, e);
        if (!text) return -1;
        total += json_string_length(text);
    }
    char *buf = malloc(total + 1);
    if (!buf) return df_api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    size_t o = 0;
    for (size_t j = 0; j < n; j++) {
        json_t *text = json_object_get(json_array_get(content, j), "text");
        memcpy(buf + o, json_string_value(text), json_string_length(text));
        o += json_string_length(text);
    }
    buf[o] = 0;
    *out = buf;
    return 0;
}

static int parse_messages(df_chat_request *req, df_api_error *e) {
    json_t *msgs = json_object_get(req->root, "messages");
    if (!msgs || json_is_null(msgs))
        return missing_error(e, "messages");
    if (!json_is_array(msgs)) return type_error(e, "messages", "an array", msgs);
    size_t n = json_array_size(msgs);
    if (n == 0)
        return df_api_error_set(e, 400, "invalid_request_error", "empty_array", "messages",
                                "Invalid 'messages': empty array. Expected an array with minimum length 1, "
                                "but got an empty array instead.");
    if (n > 100000)
        return df_api_error_set(e, 400, "invalid_request_error", "array_above_max_length", "messages",
                                "Invalid 'messages': too many messages (%zu).", n);
    req->roles = calloc(n, sizeof *req->roles);
    req->contents = calloc(n, sizeof *req->contents);
    if (!req->roles || !req->contents) return df_api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(msgs, i);
        char param[96];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(m)) return type_error(e, param, "an object", m);
        snprintf(param, sizeof param, "messages[%zu].role", i);
        json_t *role = required_string(m, "role", param, e);
        if (!role) return -1;
        const char *rendered = render_role(json_string_value(role));
        if (!rendered)
            return df_api_error_set(e, 400, "invalid_request_error", "invalid_value", param,
                                    "Invalid value: '%.64s'. Supported values are: 'system', 'developer', "
                                    "'user', 'assistant' and 'tool'.",
                                    json_string_value(role));
        req->roles[i] = rendered;
        json_t *content = field(m, "content");
        if (!content) {
            /* An assistant turn may carry only tool calls. */
            if (strcmp(rendered, "assistant") != 0) {
                snprintf(param, sizeof param, "messages[%zu].content", i);
                return missing_error(e, param);
            }
            req->contents[i] = strdup("");
            if (!req->contents[i]) return df_api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        } else if (message_text(content, (int)i, &req->contents[i], e)) {
            return -1;
        }
        req->n_messages = (int)i + 1;
    }
    return 0;
}

/* ---- sampling and limits --------------------------------------------------------------- */

static int parse_stop(df_chat_request *req, df_api_error *e) {
    json_t *stop = field(req->root, "stop");
    if (!stop) return 0;
    if (json_is_string(stop)) {
        if (json_string_length(stop) == 0) return 0;
        req->gen.stop[0] = json_string_value(stop);
        req->gen.n_stop = 1;
        return 0;
    }
    if (!json_is_array(stop)) return type_error(e, "stop", "a string or an array of strings", stop);
    if (json_array_size(stop) > DF_MAX_STOP)
        return df_api_error_set(e, 400, "invalid_request_error", "array_above_max_length", "stop",
                                "Invalid 'stop': expected at most %d strings, but got %zu.", DF_MAX_STOP,
                                json_array_size(stop));
    for (size_t i = 0; i < json_array_size(stop); i++) {
        json_t *s = json_array_get(stop, i);
        if (!json_is_string(s)) {
            char param[32];
            snprintf(param, sizeof param, "stop[%zu]", i);
            return type_error(e, param, "a string", s);
        }
        if (json_string_length(s) > 0) req->gen.stop[req->gen.n_stop++] = json_string_value(s);
    }
    return 0;
}

static int parse_sampling(df_chat_request *req, const df_generation_defaults *d, df_api_error *e) {
    df_sampling_params *sp = &req->gen.sampling;
    *sp = df_sampling_default();
    sp->temperature = 1.0f;
    if (d) {
        if (d->has_temperature) sp->temperature = d->temperature;
        if (d->has_top_p) sp->top_p = d->top_p;
        if (d->has_top_k) sp->top_k = d->top_k;
        if (d->has_min_p) sp->min_p = d->min_p;
    }
    json_t *root = req->root;
    if (get_number(root, "temperature", 0, 0, 2, &sp->temperature, e)) return -1;
    if (get_number(root, "top_p", 0, 1, 1, &sp->top_p, e)) return -1;
    if (get_number(root, "min_p", 0, 0, 1, &sp->min_p, e)) return -1;
    long long v = 0;
    int given = 0;
    if (get_integer(root, "top_k", -1, 1 << 30, &v, &given, e)) return -1;
    if (given) sp->top_k = v < 0 ? 0 : (int)v;   /* -1 and 0 both mean off */
    given = 0;
    if (get_integer(root, "seed", INT64_MIN, INT64_MAX, &v, &given, e)) return -1;
    if (given) {
        sp->seed = (uint64_t)v;
        sp->has_seed = 1;
    }

    /* max_completion_tokens is the current name; max_tokens the older one. */
    long long mt = 0;
    given = 0;
    if (get_integer(root, "max_tokens", 1, 1 << 30, &mt, &given, e)) return -1;
    if (get_integer(root, "max_completion_tokens", 1, 1 << 30, &mt, &given, e)) return -1;
    req->gen.max_tokens = given ? (int)mt : 0;
    return parse_stop(req, e);
}

/* Known OpenAI fields this version validates but cannot honour unless they are neutral. */
static int parse_unsupported(json_t *root, df_api_error *e) {
    int b = 0;
    if (get_bool(root, "stream", &b, e)) return -1;
    if (b) return unsupported(e, "stream", "Streaming (\"stream\": true)");
    b = 0;
    if (get_bool(root, "logprobs", &b, e)) return -1;
    if (b) return unsupported(e, "logprobs", "\"logprobs\": true");
    long long n = 1;
    if (get_integer(root, "n", 1, 128, &n, NULL, e)) return -1;
    if (n != 1) return unsupported(e, "n", "More than one choice (\"n\" > 1)");
    static const char *const penalties[] = {"presence_penalty", "frequency_penalty"};
    for (int i = 0; i < 2; i++) {
        float p = 0;
        if (get_number(root, penalties[i], -2, 0, 2, &p, e)) return -1;
        if (p != 0) return unsupported(e, penalties[i], "A non-zero penalty");
    }
    json_t *tools = field(root, "tools");
    if (tools && !json_is_array(tools)) return type_error(e, "tools", "an array", tools);
    if (tools && json_array_size(tools) > 0) return unsupported(e, "tools", "Tool calling");
    return 0;
}

int df_chat_request_parse(df_chat_request *req, const char *body, size_t len, const char *model_id,
                          const df_generation_defaults *gen_defaults, df_api_error *e) {
    memset(req, 0, sizeof *req);
    req->gen = df_gen_params_default();
    json_error_t jerr;
    if (len == 0)
        return df_api_error_set(e, 400, "invalid_request_error", "invalid_json", NULL,
                                "The request body is empty; expected a JSON object.");
    req->root = json_loadb(body, len, JSON_DECODE_ANY, &jerr);
    if (!req->root)
        return df_api_error_set(e, 400, "invalid_request_error", "invalid_json", NULL,
                                "The request body is not valid JSON: %s (line %d, column %d).", jerr.text,
                                jerr.line, jerr.column);
    int rc = -1;
    if (!json_is_object(req->root)) {
        df_api_error_set(e, 400, "invalid_request_error", "invalid_type", NULL,
                         "The request body must be a JSON object, but it is %s.", json_type_name(req->root));
        goto done;
    }
    json_t *model = field(req->root, "model");
    if (model && !json_is_string(model)) {
        type_error(e, "model", "a string", model);
        goto done;
    }
    if (model && strcmp(json_string_value(model), model_id) != 0) {
        df_api_error_set(e, 404, "invalid_request_error", "model_not_found", "model",
                         "The model '%.128s' does not exist; this server serves '%.128s'.",
                         json_string_value(model), model_id);
        goto done;
    }
    if (parse_messages(req, e) || parse_sampling(req, gen_defaults, e) || parse_unsupported(req->root, e)) goto done;
    rc = 0;
done:
    if (rc) df_chat_request_free(req);
    return rc;
}

void df_chat_request_free(df_chat_request *req) {
    if (req->contents)
        for (int i = 0; i < req->n_messages; i++) free(req->contents[i]);
    free(req->contents);
    free(req->roles);
    json_decref(req->root);
    memset(req, 0, sizeof *req);
}
