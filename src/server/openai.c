/* dflash server: OpenAI request validation, error objects and response pieces (see openai.h).
 *
 * Validation follows the OpenAI API's behaviour: unknown fields are ignored, a known field
 * with the wrong type or an out-of-range value is a 400 naming the field in "param"
 * (e.g. "messages[2].content[0].text"), and a known field set to null counts as omitted.
 */
#include "server/openai.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode/textout.h"
#include "dflash/chat.h"
#include "text/jinja_internal.h"

int df_api_error_set(df_api_error *e, int status, const char *type, const char *code, const char *param,
                     const char *fmt, ...) {
    e->status = status;
    e->type = type;
    e->code = code;
    e->n_prompt_tokens = e->n_ctx = 0;
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
    if (e->n_prompt_tokens > 0) {
        json_object_set_new(inner, "n_prompt_tokens", json_integer(e->n_prompt_tokens));
        json_object_set_new(inner, "n_ctx", json_integer(e->n_ctx));
    }
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

#define INVALID "invalid_request_error"

/* A number the JSON parser cannot hold (an integer past 64 bits, a real past the double range)
 * stands in the parsed request as a marker (see read_overflowing_numbers): an object whose one
 * key contains a NUL byte, which no request can contain, and whose value is the number's text.
 * Validators treat it as a number outside every range. Returns the text, or NULL when v is no
 * marker. */
#define OVERFLOW_KEY "\0number"
static const char *overflow_text(const json_t *v) {
    return json_is_object(v) ? json_string_value(json_object_getn(v, OVERFLOW_KEY, sizeof OVERFLOW_KEY - 1)) : NULL;
}

static const char *json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return overflow_text(v) ? "a number" : "an object";
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
    return df_api_error_set(e, 400, INVALID, "invalid_type", param,
                            "Invalid type for '%s': expected %s, but got %s instead.", param, expected,
                            json_type_name(got));
}

static int missing_error(df_api_error *e, const char *param) {
    return df_api_error_set(e, 400, INVALID, "missing_required_parameter", param, "Missing required parameter: '%s'.",
                            param);
}

static int unsupported(df_api_error *e, const char *param, const char *what) {
    return df_api_error_set(e, 400, INVALID, "unsupported_value", param, "%s is not supported by this server.", what);
}

/* A field that is absent or null counts as omitted: returns NULL. */
static json_t *field(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return (v && !json_is_null(v)) ? v : NULL;
}

/* The string field key of obj; NULL with e set when it is missing, null or not a string. */
static json_t *required_string(const json_t *obj, const char *key, const char *param, df_api_error *e) {
    json_t *v = field(obj, key);
    if (!v) missing_error(e, param);
    else if (!json_is_string(v)) type_error(e, param, "a string", v);
    else return v;
    return NULL;
}

/* The shortest "%g" text of x that reads back as x (2.0000001 is not "2"). */
static void shortest_text(char *buf, size_t n, double x) {
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
}

/* A number field in [lo, hi] (lo excluded when lo_open). *out untouched when omitted. */
static int get_number(const json_t *obj, const char *key, const char *param, double lo, int lo_open, double hi,
                      float *out, df_api_error *e) {
    json_t *v = field(obj, key);
    if (!v) return 0;
    const char *big = overflow_text(v);
    if (!big && !json_is_number(v)) return type_error(e, param, "a number", v);
    double x = big ? 0 : json_number_value(v);
    if (big || !isfinite(x) || x < lo || (lo_open && x == lo) || x > hi) {
        char got[32];
        shortest_text(got, sizeof got, x);
        return df_api_error_set(e, 400, INVALID, "invalid_value", param,
                                "Invalid '%s': expected a value %s %g and <= %g, but got %s instead.", param,
                                lo_open ? ">" : ">=", lo, hi, big ? big : got);
    }
    *out = (float)x;
    /* above an open lower bound, a value that float32 rounds down onto the bound is taken as the
     * next float (the smallest normal one above 0): a tiny top_p still means nearly greedy */
    if (lo_open && *out <= (float)lo) *out = lo == 0 ? FLT_MIN : nextafterf((float)lo, INFINITY);
    return 0;
}

/* An integer field in [lo, hi] (a real with an integral value counts). *given set to 1
 * when present. */
static int get_integer(const json_t *obj, const char *key, const char *param, long long lo, long long hi,
                       long long *out, int *given, df_api_error *e) {
    json_t *v = field(obj, key);
    if (!v) return 0;
    const char *big = overflow_text(v);
    char got[32] = "";
    long long x = 0;
    int in_range = 0;
    if (big) {
        /* past 64 bits: outside every range */
    } else if (json_is_integer(v)) {
        x = (long long)json_integer_value(v);
        in_range = x >= lo && x <= hi;
        snprintf(got, sizeof got, "%lld", x);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v))) {
        double r = json_real_value(v); /* finite: the parser holds no inf or nan */
        if (r >= -0x1p63 && r < 0x1p63) { /* exactly representable as a long long */
            x = (long long)r;
            in_range = x >= lo && x <= hi;
            snprintf(got, sizeof got, "%lld", x);
        } else {
            shortest_text(got, sizeof got, r);
        }
    } else {
        return type_error(e, param, "an integer", v);
    }
    if (!in_range)
        return df_api_error_set(e, 400, INVALID, "invalid_value", param,
                                "Invalid '%s': expected an integer >= %lld and <= %lld, but got %s instead.",
                                param, lo, hi, big ? big : got);
    *out = x;
    if (given) *given = 1;
    return 0;
}

static int get_bool(const json_t *obj, const char *key, const char *param, int *out, df_api_error *e) {
    json_t *v = field(obj, key);
    if (!v) return 0;
    if (!json_is_boolean(v)) return type_error(e, param, "a boolean", v);
    *out = json_is_true(v);
    return 0;
}

static int get_string(const json_t *obj, const char *key, const char *param, const char **out, df_api_error *e) {
    json_t *v = field(obj, key);
    if (!v) return 0;
    if (!json_is_string(v)) return type_error(e, param, "a string", v);
    *out = json_string_value(v);
    return 0;
}


/* ---- messages -------------------------------------------------------------------------- */

static int known_role(const char *role) {
    static const char *const roles[] = {"system", "developer", "user", "assistant", "tool"};
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
        if (strcmp(role, roles[i]) == 0) return 1;
    return 0;
}

static int check_content_parts(const json_t *content, size_t i, df_api_error *e) {
    char param[96];
    size_t j;
    json_t *part;
    json_array_foreach(content, j, part) {
        snprintf(param, sizeof param, "messages[%zu].content[%zu]", i, j);
        if (!json_is_object(part)) return type_error(e, param, "an object", part);
        snprintf(param, sizeof param, "messages[%zu].content[%zu].type", i, j);
        json_t *type = required_string(part, "type", param, e);
        if (!type) return -1;
        const char *t = json_string_value(type);
        if (!strcmp(t, "image_url") || !strcmp(t, "input_audio") || !strcmp(t, "file"))
            return unsupported(e, param, "Image, audio and file content");
        if (strcmp(t, "text") != 0)
            return df_api_error_set(e, 400, INVALID, "invalid_value", param,
                                    "Invalid value: '%.64s'. Supported values are: 'text'.", t);
        snprintf(param, sizeof param, "messages[%zu].content[%zu].text", i, j);
        if (!required_string(part, "text", param, e)) return -1;
    }
    return 0;
}

static int check_tool_calls(const json_t *calls, size_t i, df_api_error *e) {
    char param[96];
    snprintf(param, sizeof param, "messages[%zu].tool_calls", i);
    if (!json_is_array(calls)) return type_error(e, param, "an array", calls);
    size_t j;
    json_t *call;
    json_array_foreach(calls, j, call) {
        snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu]", i, j);
        if (!json_is_object(call)) return type_error(e, param, "an object", call);
        snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu].function", i, j);
        json_t *fn = field(call, "function");
        if (!fn) return missing_error(e, param);
        if (!json_is_object(fn)) return type_error(e, param, "an object", fn);
        snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu].function.name", i, j);
        if (!required_string(fn, "name", param, e)) return -1;
        snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu].function.arguments", i, j);
        json_t *args = field(fn, "arguments");
        if (args && !json_is_string(args) && !json_is_object(args))
            return type_error(e, param, "a string or an object", args);
        if (json_is_string(args)) { /* the template needs the arguments as a JSON object */
            json_t *parsed = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
            int ok = json_is_object(parsed);
            json_decref(parsed);
            if (!ok)
                return df_api_error_set(e, 400, INVALID, "invalid_value", param,
                                        "Invalid value for '%s': expected a JSON object encoded as a string.", param);
        }
    }
    return 0;
}

static int check_messages(const json_t *root, df_api_error *e) {
    json_t *msgs = field(root, "messages");
    if (!msgs) return missing_error(e, "messages");
    if (!json_is_array(msgs)) return type_error(e, "messages", "an array", msgs);
    size_t n = json_array_size(msgs);
    if (n == 0)
        return df_api_error_set(e, 400, INVALID, "empty_array", "messages",
                                "Invalid 'messages': empty array. Expected an array with minimum length 1, "
                                "but got an empty array instead.");
    if (n > 100000)
        return df_api_error_set(e, 400, INVALID, "array_above_max_length", "messages",
                                "Invalid 'messages': %zu messages, at most 100000.", n);
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(msgs, i);
        char param[96];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(m)) return type_error(e, param, "an object", m);
        snprintf(param, sizeof param, "messages[%zu].role", i);
        json_t *role = required_string(m, "role", param, e);
        if (!role) return -1;
        const char *r = json_string_value(role);
        if (!known_role(r))
            return df_api_error_set(e, 400, INVALID, "invalid_value", param,
                                    "Invalid value: '%.64s'. Supported values are: 'system', 'developer', "
                                    "'user', 'assistant' and 'tool'.",
                                    r);
        int assistant = !strcmp(r, "assistant");
        json_t *content = field(m, "content");
        snprintf(param, sizeof param, "messages[%zu].content", i);
        if (!content) {
            if (!assistant) return missing_error(e, param); /* an assistant turn may carry only tool calls */
        } else if (json_is_array(content)) {
            if (check_content_parts(content, i, e)) return -1;
        } else if (!json_is_string(content)) {
            return type_error(e, param, "a string or an array of content parts", content);
        }
        json_t *calls = field(m, "tool_calls");
        if (calls && check_tool_calls(calls, i, e)) return -1;
        static const char *const strings[] = {"reasoning_content", "name", "tool_call_id"};
        for (size_t k = 0; k < sizeof strings / sizeof strings[0]; k++) {
            snprintf(param, sizeof param, "messages[%zu].%s", i, strings[k]);
            const char *dummy;
            if (get_string(m, strings[k], param, &dummy, e)) return -1;
        }
    }
    return 0;
}

/* ---- tools ----------------------------------------------------------------------------- */

/* OpenAI's rule for function names: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'. */
static int valid_function_name(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 64) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

static int bad_name(df_api_error *e, const char *param, const char *name) {
    return df_api_error_set(e, 400, INVALID, "invalid_value", param,
                            "Invalid '%s': '%.80s' is not a valid function name (1 to 64 characters: a-z, A-Z, "
                            "0-9, '_' and '-').",
                            param, name);
}

static int parse_tools(df_api_request *req, df_api_error *e) {
    json_t *tools = field(req->root, "tools");
    if (tools && !json_is_array(tools)) return type_error(e, "tools", "an array", tools);
    if (tools && json_array_size(tools) > 128)
        return df_api_error_set(e, 400, INVALID, "array_above_max_length", "tools",
                                "Invalid 'tools': expected at most 128 tools, but got %zu.", json_array_size(tools));
    size_t i;
    json_t *t;
    char param[96];
    json_array_foreach(tools, i, t) {
        snprintf(param, sizeof param, "tools[%zu]", i);
        if (!json_is_object(t)) return type_error(e, param, "an object", t);
        snprintf(param, sizeof param, "tools[%zu].type", i);
        json_t *type = required_string(t, "type", param, e);
        if (!type) return -1;
        if (strcmp(json_string_value(type), "function") != 0)
            return df_api_error_set(e, 400, INVALID, "invalid_value", param,
                                    "Invalid value: '%.64s'. Supported values are: 'function'.",
                                    json_string_value(type));
        snprintf(param, sizeof param, "tools[%zu].function", i);
        json_t *fn = field(t, "function");
        if (!fn) return missing_error(e, param);
        if (!json_is_object(fn)) return type_error(e, param, "an object", fn);
        snprintf(param, sizeof param, "tools[%zu].function.name", i);
        json_t *name = required_string(fn, "name", param, e);
        if (!name) return -1;
        if (!valid_function_name(json_string_value(name))) return bad_name(e, param, json_string_value(name));
        /* a call names its function: two tools of one name would make it ambiguous */
        for (size_t k = 0; k < i; k++) {
            json_t *fk = json_object_get(json_array_get(tools, k), "function");
            const char *other = json_string_value(json_object_get(fk, "name"));
            if (other && !strcmp(other, json_string_value(name)))
                return df_api_error_set(e, 400, INVALID, "invalid_value", param,
                                        "Invalid '%s': '%s' is the name of tools[%zu] too; tool names must be unique.",
                                        param, json_string_value(name), k);
        }
        snprintf(param, sizeof param, "tools[%zu].function.description", i);
        const char *d;
        if (get_string(fn, "description", param, &d, e)) return -1;
        snprintf(param, sizeof param, "tools[%zu].function.parameters", i);
        json_t *params = field(fn, "parameters");
        if (params && !json_is_object(params)) return type_error(e, param, "an object", params);
    }
    req->tools = tools && json_array_size(tools) > 0 ? tools : NULL;

    int parallel = 1;
    if (get_bool(req->root, "parallel_tool_calls", "parallel_tool_calls", &parallel, e)) return -1;

    json_t *choice = field(req->root, "tool_choice");
    req->tool_choice = req->tools ? DF_TOOL_CHOICE_AUTO : DF_TOOL_CHOICE_NONE;
    if (!choice) return 0;
    if (json_is_string(choice)) {
        const char *c = json_string_value(choice);
        if (!strcmp(c, "none")) req->tool_choice = DF_TOOL_CHOICE_NONE;
        else if (!strcmp(c, "auto")) req->tool_choice = req->tools ? DF_TOOL_CHOICE_AUTO : DF_TOOL_CHOICE_NONE;
        else if (!strcmp(c, "required")) req->tool_choice = DF_TOOL_CHOICE_REQUIRED;
        else
            return df_api_error_set(e, 400, INVALID, "invalid_value", "tool_choice",
                                    "Invalid value: '%.64s'. Supported values are: 'none', 'auto', 'required' or "
                                    "{\"type\": \"function\", \"function\": {\"name\": ...}}.",
                                    c);
    } else if (json_is_object(choice)) {
        json_t *type = required_string(choice, "type", "tool_choice.type", e);
        if (!type) return -1;
        if (strcmp(json_string_value(type), "function") != 0)
            return df_api_error_set(e, 400, INVALID, "invalid_value", "tool_choice.type",
                                    "Invalid value: '%.64s'. Supported values are: 'function'.",
                                    json_string_value(type));
        json_t *fn = field(choice, "function");
        if (!fn) return missing_error(e, "tool_choice.function");
        if (!json_is_object(fn)) return type_error(e, "tool_choice.function", "an object", fn);
        json_t *name = required_string(fn, "name", "tool_choice.function.name", e);
        if (!name) return -1;
        req->tool_choice = DF_TOOL_CHOICE_NAMED;
        req->tool_name = json_string_value(name);
    } else {
        return type_error(e, "tool_choice", "a string or an object", choice);
    }
    if (req->tool_choice >= DF_TOOL_CHOICE_REQUIRED && !req->tools)
        return df_api_error_set(e, 400, INVALID, "invalid_value", "tool_choice",
                                "Invalid 'tool_choice': %s needs a non-empty 'tools' list.",
                                req->tool_choice == DF_TOOL_CHOICE_NAMED ? "a named function" : "'required'");
    if (req->tool_choice == DF_TOOL_CHOICE_NAMED) {
        int found = 0;
        json_array_foreach(req->tools, i, t) {
            const char *n = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
            if (n && !strcmp(n, req->tool_name)) found = 1;
        }
        if (!found)
            return df_api_error_set(e, 400, INVALID, "invalid_value", "tool_choice.function.name",
                                    "Invalid 'tool_choice': the function '%.64s' is not among the request's tools.",
                                    req->tool_name);
    }
    return 0;
}

/* ---- sampling, limits, output options --------------------------------------------------- */

static int parse_stop(df_api_request *req, df_api_error *e) {
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
        return df_api_error_set(e, 400, INVALID, "array_above_max_length", "stop",
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

/* logit_bias: {"token id": bias in [-100, 100]} */
static int parse_logit_bias(df_api_request *req, int vocab, df_api_error *e) {
    json_t *lb = field(req->root, "logit_bias");
    if (!lb) return 0;
    if (!json_is_object(lb)) return type_error(e, "logit_bias", "an object", lb);
    if (json_object_size(lb) > DF_MAX_LOGIT_BIAS)
        return df_api_error_set(e, 400, INVALID, "invalid_value", "logit_bias",
                                "Invalid 'logit_bias': at most %d entries are allowed, but got %zu.",
                                DF_MAX_LOGIT_BIAS, json_object_size(lb));
    const char *key;
    json_t *v;
    int n = 0;
    json_object_foreach(lb, key, v) {
        char param[96];
        snprintf(param, sizeof param, "logit_bias.%.64s", key);
        /* the canonical decimal form only ("5", never "05" or "+5"): one key per token */
        size_t nd = strspn(key, "0123456789");
        long id = nd > 0 && nd <= 9 && !key[nd] && (key[0] != '0' || nd == 1) ? strtol(key, NULL, 10) : -1;
        if (id < 0 || id >= vocab)
            return df_api_error_set(e, 400, INVALID, "invalid_value", "logit_bias",
                                    "Invalid 'logit_bias': key '%.64s' is not a token id (an integer from 0 to %d, "
                                    "written without sign or leading zeros: the model's vocabulary).",
                                    key, vocab - 1);
        float bias = 0;
        if (get_number(lb, key, param, -100, 0, 100, &bias, e)) return -1;
        if (json_is_null(v)) return type_error(e, param, "a number", v);
        req->bias[n].id = (int32_t)id;
        req->bias[n].bias = bias;
        n++;
    }
    req->gen.sampling.logit_bias = req->bias;
    req->gen.sampling.n_logit_bias = n;
    return 0;
}

static int parse_sampling(df_api_request *req, const df_api_context *ctx, df_api_error *e) {
    df_sampling_params *sp = &req->gen.sampling;
    const df_generation_defaults *d = ctx->gen_defaults;
    *sp = df_sampling_default();
    sp->temperature = 1.0f;
    if (d) {
        if (d->has_temperature) sp->temperature = d->temperature;
        if (d->has_top_p) sp->top_p = d->top_p;
        if (d->has_top_k) sp->top_k = d->top_k;
        if (d->has_min_p) sp->min_p = d->min_p;
        if (d->has_repetition_penalty) sp->repetition_penalty = d->repetition_penalty;
    }
    json_t *root = req->root;
    if (get_number(root, "temperature", "temperature", 0, 0, 2, &sp->temperature, e)) return -1;
    if (get_number(root, "top_p", "top_p", 0, 1, 1, &sp->top_p, e)) return -1;
    if (get_number(root, "min_p", "min_p", 0, 0, 1, &sp->min_p, e)) return -1;
    if (get_number(root, "presence_penalty", "presence_penalty", -2, 0, 2, &sp->presence_penalty, e)) return -1;
    if (get_number(root, "frequency_penalty", "frequency_penalty", -2, 0, 2, &sp->frequency_penalty, e)) return -1;
    if (get_number(root, "repetition_penalty", "repetition_penalty", 0, 1, 10, &sp->repetition_penalty, e))
        return -1;
    long long v = 0;
    int given = 0;
    if (get_integer(root, "top_k", "top_k", -1, 1 << 30, &v, &given, e)) return -1;
    if (given) sp->top_k = v < 0 ? 0 : (int)v; /* -1 and 0 both mean off */
    given = 0;
    if (get_integer(root, "seed", "seed", INT64_MIN, INT64_MAX, &v, &given, e)) return -1;
    if (given) {
        sp->seed = (uint64_t)v;
        sp->has_seed = 1;
    }
    if (parse_logit_bias(req, ctx->vocab, e)) return -1;

    /* max_completion_tokens is the current name; max_tokens the older one (both routes take
     * both, checked alike; the newer one wins when both are given) */
    long long mt = 0;
    given = 0;
    if (get_integer(root, "max_tokens", "max_tokens", 1, 1 << 30, &mt, &given, e)) return -1;
    if (get_integer(root, "max_completion_tokens", "max_completion_tokens", 1, 1 << 30, &mt, &given, e)) return -1;
    req->gen.max_tokens = given ? (int)mt : 0;
    return parse_stop(req, e);
}

static int parse_output_options(df_api_request *req, const df_api_context *ctx, df_api_error *e) {
    json_t *root = req->root;
    if (get_bool(root, "stream", "stream", &req->stream, e)) return -1;
    json_t *so = field(root, "stream_options");
    if (so) {
        if (!json_is_object(so)) return type_error(e, "stream_options", "an object", so);
        if (!req->stream)
            return df_api_error_set(e, 400, INVALID, "invalid_value", "stream_options",
                                    "Invalid 'stream_options': only allowed when 'stream' is true.");
        if (get_bool(so, "include_usage", "stream_options.include_usage", &req->include_usage, e)) return -1;
    }
    /* n: one choice per prompt is generated, so anything but 1 is refused, saying so: as an
     * invalid value outside the API's 1..128, as an unsupported one inside it */
    long long n = 1;
    if (get_integer(root, "n", "n", 1, 128, &n, NULL, e)) {
        if (!strcmp(e->code, "invalid_type")) return -1;
        const json_t *nv = field(root, "n");
        char got[48];
        if (overflow_text(nv)) snprintf(got, sizeof got, "%.40s", overflow_text(nv));
        else if (json_is_integer(nv)) snprintf(got, sizeof got, "%lld", (long long)json_integer_value(nv));
        else snprintf(got, sizeof got, "%g", json_number_value(nv));
        return df_api_error_set(e, 400, INVALID, "invalid_value", "n",
                                "Invalid 'n': one choice per prompt is generated; 'n' must be 1, but got %s.", got);
    }
    if (n != 1)
        return df_api_error_set(e, 400, INVALID, "unsupported_value", "n",
                                "Invalid 'n': one choice per prompt is generated; 'n' must be 1, but got %lld.", n);
    const char *user;
    if (get_string(root, "user", "user", &user, e)) return -1;

    int k = ctx->max_top_logprobs;
    if (req->route == DF_API_CHAT) {
        int lp = 0;
        long long top = 0;
        int top_given = 0;
        if (get_bool(root, "logprobs", "logprobs", &lp, e)) return -1;
        if (get_integer(root, "top_logprobs", "top_logprobs", 0, k, &top, &top_given, e)) return -1;
        if (top_given && !lp)
            return df_api_error_set(e, 400, INVALID, "invalid_value", "top_logprobs",
                                    "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.");
        req->gen.logprobs = lp;
        req->gen.top_logprobs = (int)top;
        json_t *rf = field(root, "response_format");
        if (rf) {
            if (!json_is_object(rf)) return type_error(e, "response_format", "an object", rf);
            json_t *type = required_string(rf, "type", "response_format.type", e);
            if (!type) return -1;
            const char *t = json_string_value(type);
            if (!strcmp(t, "json_object") || !strcmp(t, "json_schema"))
                return unsupported(e, "response_format.type", "Structured output (json_object, json_schema)");
            if (strcmp(t, "text") != 0)
                return df_api_error_set(e, 400, INVALID, "invalid_value", "response_format.type",
                                        "Invalid value: '%.64s'. Supported values are: 'text'.", t);
        }
        int b = 0;
        if (get_bool(root, "enable_thinking", "enable_thinking", &b, e)) return -1;
        if (get_bool(root, "add_generation_prompt", "add_generation_prompt", &b, e)) return -1;
        json_t *kw = field(root, "chat_template_kwargs");
        if (kw) {
            if (!json_is_object(kw)) return type_error(e, "chat_template_kwargs", "an object", kw);
            if (get_bool(kw, "enable_thinking", "chat_template_kwargs.enable_thinking", &b, e)) return -1;
            const char *own = df_chat_kwargs_reserved(kw); /* a variable the request's own field sets */
            if (own) {
                char param[64];
                snprintf(param, sizeof param, "chat_template_kwargs.%s", own);
                return df_api_error_set(e, 400, INVALID, "invalid_value", param,
                                        "Invalid '%s': the request's '%s' field sets it; it may not be given here.",
                                        param, own);
            }
        }
    } else {
        long long top = 0;
        int given = 0;
        json_t *lp = field(root, "logprobs");
        if (lp && json_is_boolean(lp)) return type_error(e, "logprobs", "an integer", lp);
        if (get_integer(root, "logprobs", "logprobs", 0, k, &top, &given, e)) return -1;
        req->gen.logprobs = given;
        req->gen.top_logprobs = (int)top;
        if (get_bool(root, "echo", "echo", &req->echo, e)) return -1;
        const char *suffix = NULL;
        if (get_string(root, "suffix", "suffix", &suffix, e)) return -1;
        if (suffix && suffix[0]) return unsupported(e, "suffix", "'suffix' (insertion)");
        long long best_of = 1;
        if (get_integer(root, "best_of", "best_of", 1, 128, &best_of, NULL, e)) return -1;
        if (best_of != 1)
            return df_api_error_set(e, 400, INVALID, "unsupported_value", "best_of",
                                    "Invalid 'best_of': this server generates one choice per prompt; it must be 1.");
        if (req->echo && req->gen.logprobs)
            return unsupported(e, "echo", "'echo' together with 'logprobs' (prompt log-probabilities)");
    }
    if (ctx->test_hooks) {
        long long delay = 0;
        if (get_string(root, "dflash_forced_output", "dflash_forced_output", &req->forced_output, e) ||
            get_integer(root, "dflash_delay_ms", "dflash_delay_ms", 0, 1000, &delay, NULL, e))
            return -1;
        req->delay_ms = (int)delay;
    }
    return 0;
}

/* prompt: a string, a list of strings, a list of token ids, or a list of lists of ids. */
static int check_ids(const json_t *a, const char *param, int vocab, df_api_error *e) {
    if (json_array_size(a) == 0)
        return df_api_error_set(e, 400, INVALID, "invalid_value", param, "Invalid '%s': the prompt is empty.", param);
    size_t i;
    json_t *x;
    json_array_foreach(a, i, x) {
        char p[96];
        snprintf(p, sizeof p, "%s[%zu]", param, i);
        if (overflow_text(x))
            return df_api_error_set(e, 400, INVALID, "invalid_value", p,
                                    "Invalid '%s': token id %s is outside 0..%d (the model's vocabulary).", p,
                                    overflow_text(x), vocab - 1);
        if (!json_is_integer(x)) return type_error(e, p, "a token id (an integer)", x);
        json_int_t id = json_integer_value(x);
        if (id < 0 || id >= vocab)
            return df_api_error_set(e, 400, INVALID, "invalid_value", p,
                                    "Invalid '%s': token id %lld is outside 0..%d (the model's vocabulary).", p,
                                    (long long)id, vocab - 1);
    }
    return 0;
}

static int parse_prompt(df_api_request *req, int vocab, df_api_error *e) {
    json_t *p = field(req->root, "prompt");
    if (!p) return missing_error(e, "prompt");
    if (json_is_string(p)) {
        req->prompts[req->n_prompts++] = p;
    } else if (json_is_array(p)) {
        size_t n = json_array_size(p);
        if (n == 0)
            return df_api_error_set(e, 400, INVALID, "invalid_value", "prompt", "Invalid 'prompt': the prompt is empty.");
        json_t *first = json_array_get(p, 0);
        if (json_is_number(first) || overflow_text(first)) { /* token ids (a number that is none is named) */
            if (check_ids(p, "prompt", vocab, e)) return -1;
            req->prompts[req->n_prompts++] = p;
        } else {
            if (n > DF_API_MAX_PROMPTS)
                return df_api_error_set(e, 400, INVALID, "array_above_max_length", "prompt",
                                        "Invalid 'prompt': at most %d prompts per request, but got %zu.",
                                        DF_API_MAX_PROMPTS, n);
            /* a list of strings or a list of id lists, as the first item says (not both) */
            const int lists = json_is_array(first);
            size_t i;
            json_t *x;
            json_array_foreach(p, i, x) {
                char param[32];
                snprintf(param, sizeof param, "prompt[%zu]", i);
                if (lists && json_is_array(x)) {
                    if (check_ids(x, param, vocab, e)) return -1;
                } else if (lists) {
                    return type_error(e, param, "an array of token ids (as prompt[0])", x);
                } else if (!json_is_string(x)) {
                    return type_error(e, param, i == 0 ? "a string or an array of token ids" : "a string (as prompt[0])",
                                      x);
                }
                req->prompts[req->n_prompts++] = x;
            }
        }
    } else {
        return type_error(e, "prompt", "a string, an array of strings or an array of token ids", p);
    }
    for (int i = 0; i < req->n_prompts; i++)
        if (json_is_string(req->prompts[i]) && json_string_length(req->prompts[i]) == 0) {
            char param[32];
            if (json_is_array(p)) snprintf(param, sizeof param, "prompt[%d]", i);
            else snprintf(param, sizeof param, "prompt");
            return df_api_error_set(e, 400, INVALID, "invalid_value", param, "Invalid '%s': the prompt is empty.",
                                    param);
        }
    return 0;
}

/* ---- numbers past the parser's range -------------------------------------------------------- */

/* jansson stops at the first number it cannot hold ("too big integer", "too big negative
 * integer", "real number overflow"), at the byte after it. Such a number is given the place of
 * a marker (see overflow_text), so that the field's validator answers as for any value out of
 * its range, naming the field and the range. */

#define OVERFLOW_MAX 8    /* such numbers read in one request; past that, the parser's error */
#define OVERFLOW_DEPTH 16 /* nesting levels followed to place one */

/* One nesting level around a number: an object's current key (its quoted text in the body)
 * or an array's current index. */
typedef struct json_level {
    int object;
    int key_next;        /* object: the next string is a key */
    size_t key, key_len; /* object */
    size_t index;        /* array */
} json_level;

typedef struct overflow {
    json_level at[OVERFLOW_DEPTH];
    int depth;
    char text[64];  /* the number as written (shortened when long) */
    char param[96]; /* its place, as errors name it: "max_tokens", "logit_bias.5", "prompt[2]" */
} overflow;

static int is_overflow(const json_error_t *je) {
    return strstr(je->text, "too big") != NULL || strstr(je->text, "real number overflow") != NULL;
}

static int is_number_char(char c) {
    return (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E';
}

/* The number that ends at byte end of body, which the parser read up to there as valid JSON:
 * its first byte (*start) and its nesting levels (o->at, o->depth). A plain scan suffices as
 * the text before it is valid JSON. -1 when it is not nested (the body is that number) or
 * nested deeper than OVERFLOW_DEPTH. */
static int locate_number(const char *body, size_t end, overflow *o, size_t *start) {
    int depth = 0;
    size_t num = SIZE_MAX;
    for (size_t i = 0; i < end; i++) {
        char c = body[i];
        json_level *top = depth > 0 && depth <= OVERFLOW_DEPTH ? &o->at[depth - 1] : NULL;
        if (c == '"') {
            size_t s = i++;
            while (i < end && body[i] != '"') i += body[i] == '\\' ? 2 : 1;
            if (top && top->object && top->key_next) {
                top->key = s;
                top->key_len = i + 1 - s;
                top->key_next = 0;
            }
        } else if (c == '{' || c == '[') {
            if (depth < OVERFLOW_DEPTH) o->at[depth] = (json_level){.object = c == '{', .key_next = 1};
            depth++;
        } else if (c == '}' || c == ']') {
            if (depth > 0) depth--;
        } else if (c == ',') {
            if (top && top->object) top->key_next = 1;
            else if (top) top->index++;
        } else if ((c == '-' || (c >= '0' && c <= '9')) && (i == 0 || !is_number_char(body[i - 1]))) {
            num = i;
        }
    }
    if (num == SIZE_MAX || depth == 0 || depth > OVERFLOW_DEPTH || end - num < 4) return -1;
    for (size_t i = num; i < end; i++)
        if (!is_number_char(body[i])) return -1;
    o->depth = depth;
    *start = num;
    return 0;
}

/* The key of object level l, decoded (a JSON string), or NULL. */
static json_t *level_key(const char *body, const json_level *l) {
    json_t *k = json_loadb(body + l->key, l->key_len, JSON_DECODE_ANY, NULL);
    if (json_is_string(k)) return k;
    json_decref(k);
    return NULL;
}

/* Puts a marker holding o->text where o's levels lead in root. -1 when they lead nowhere
 * (a key given twice, say: the parser keeps the last value). */
static int place_marker(json_t *root, const char *body, const overflow *o) {
    json_t *cur = root;
    for (int k = 0; k < o->depth; k++) {
        const json_level *l = &o->at[k];
        const int last = k == o->depth - 1;
        json_t *marker = NULL;
        if (last) {
            marker = json_object();
            if (!marker || json_object_setn_new(marker, OVERFLOW_KEY, sizeof OVERFLOW_KEY - 1, json_string(o->text))) {
                json_decref(marker);
                return -1;
            }
        }
        if (l->object) {
            json_t *key = level_key(body, l);
            if (!key || !json_is_object(cur)) {
                json_decref(key);
                json_decref(marker);
                return -1;
            }
            if (last) {
                int rc = json_object_set_new(cur, json_string_value(key), marker);
                json_decref(key);
                return rc;
            }
            cur = json_object_get(cur, json_string_value(key));
            json_decref(key);
        } else {
            if (!json_is_array(cur) || l->index >= json_array_size(cur)) {
                json_decref(marker);
                return -1;
            }
            if (last) return json_array_set_new(cur, l->index, marker);
            cur = json_array_get(cur, l->index);
        }
    }
    return -1; /* (depth 0: the body is the number itself) */
}

/* After the parser stopped at a number it cannot hold (jerr): parses body again with each
 * such number (up to OVERFLOW_MAX) read as null, then puts a marker in its place. Fills
 * over[0, return value). req->root is left NULL (and jerr set) when the body still does not
 * parse: a later error, or more such numbers. */
static int read_overflowing_numbers(df_api_request *req, const char *body, size_t len, json_error_t *jerr,
                                    overflow *over) {
    char *copy = malloc(len);
    if (!copy) return 0;
    memcpy(copy, body, len);
    int n = 0;
    while (!req->root && is_overflow(jerr) && n < OVERFLOW_MAX) {
        overflow *o = &over[n];
        size_t end = (size_t)jerr->position, start;
        if (end > len || locate_number(copy, end, o, &start)) break;
        if (end - start < sizeof o->text) snprintf(o->text, sizeof o->text, "%.*s", (int)(end - start), copy + start);
        else snprintf(o->text, sizeof o->text, "%.24s... (%zu characters)", copy + start, end - start);
        size_t used = 0;
        o->param[0] = 0;
        for (int k = 0; k < o->depth && used < sizeof o->param; k++) {
            json_t *key = o->at[k].object ? level_key(copy, &o->at[k]) : NULL;
            if (o->at[k].object)
                snprintf(o->param + used, sizeof o->param - used, "%s%s", k ? "." : "",
                         key ? json_string_value(key) : "?");
            else snprintf(o->param + used, sizeof o->param - used, "[%zu]", o->at[k].index);
            json_decref(key);
            used = strlen(o->param);
        }
        /* "null" and spaces take its place: the text keeps its length, so later positions hold */
        memcpy(copy + start, "null", 4);
        memset(copy + start + 4, ' ', end - start - 4);
        n++;
        req->root = json_loadb(copy, len, JSON_DECODE_ANY, jerr);
    }
    /* one that cannot be placed is passed by validation, and df_api_request_parse refuses it */
    for (int i = 0; req->root && i < n; i++) place_marker(req->root, copy, &over[i]);
    free(copy);
    return n;
}

int df_api_request_parse(df_api_request *req, df_api_route route, const char *body, size_t len,
                         const df_api_context *ctx, df_api_error *e) {
    memset(req, 0, sizeof *req);
    req->route = route;
    req->gen = df_gen_params_default();
    req->gen.max_tokens = 0;
    json_error_t jerr;
    if (len == 0)
        return df_api_error_set(e, 400, INVALID, "invalid_json", NULL,
                                "The request body is empty; expected a JSON object.");
    req->root = json_loadb(body, len, JSON_DECODE_ANY, &jerr);
    overflow over[OVERFLOW_MAX];
    int n_over = 0;
    if (!req->root && is_overflow(&jerr)) n_over = read_overflowing_numbers(req, body, len, &jerr, over);
    if (!req->root && strstr(jerr.text, "JSON_ALLOW_NUL"))
        return df_api_error_set(e, 400, INVALID, "invalid_value", NULL,
                                "Strings containing the NUL character (\\u0000) are not supported (line %d, column %d).",
                                jerr.line, jerr.column);
    if (!req->root && is_overflow(&jerr))
        return df_api_error_set(e, 400, INVALID, "invalid_value", NULL,
                                "A number in the request is out of range: %s (line %d, column %d).", jerr.text,
                                jerr.line, jerr.column);
    if (!req->root)
        return df_api_error_set(e, 400, INVALID, "invalid_json", NULL,
                                "The request body is not valid JSON: %s (line %d, column %d).", jerr.text, jerr.line,
                                jerr.column);
    int rc = -1;
    if (!json_is_object(req->root)) {
        df_api_error_set(e, 400, INVALID, "invalid_type", NULL, "The request body must be a JSON object, but it is %s.",
                         json_type_name(req->root));
        goto done;
    }
    json_t *model = field(req->root, "model");
    if (model && !json_is_string(model)) {
        type_error(e, "model", "a string", model);
        goto done;
    }
    if (model && ctx->model_id && strcmp(json_string_value(model), ctx->model_id) != 0) {
        df_api_error_set(e, 404, INVALID, "model_not_found", "model",
                         "The model '%.128s' does not exist; this server serves '%.128s'.", json_string_value(model),
                         ctx->model_id);
        goto done;
    }
    if (route == DF_API_CHAT) {
        if (check_messages(req->root, e) || parse_tools(req, e)) goto done;
    } else if (parse_prompt(req, ctx->vocab, e)) {
        goto done;
    }
    if (parse_sampling(req, ctx, e) || parse_output_options(req, ctx, e)) goto done;
    if (n_over > 0) { /* a number past the parser's range that no validator read (no field takes one there) */
        df_api_error_set(e, 400, INVALID, "invalid_value", over[0].param,
                         "Invalid '%s': the number %s is out of the range this server reads (integers must fit in "
                         "64 bits, other numbers in a double).",
                         over[0].param, over[0].text);
        goto done;
    }
    rc = 0;
done:
    if (rc) df_api_request_free(req);
    return rc;
}

void df_api_request_free(df_api_request *req) {
    json_decref(req->root);
    memset(req, 0, sizeof *req);
}

/* ---- response pieces --------------------------------------------------------------------- */

json_t *df_api_usage(int prompt_tokens, int completion_tokens) {
    return json_pack("{s:i, s:i, s:i}", "prompt_tokens", prompt_tokens, "completion_tokens", completion_tokens,
                     "total_tokens", prompt_tokens + completion_tokens);
}

json_t *df_api_timings(const df_gen_result *res, int n_prompt, int n_after_first, int speculative) {
    double pms = res->prompt_ms, dms = res->decode_ms;
    json_t *t = json_pack("{s:i, s:f, s:f, s:i, s:f, s:f}", "prompt_n", n_prompt, "prompt_ms", pms,
                          "prompt_per_second", pms > 0 ? n_prompt * 1000.0 / pms : 0.0, "predicted_n", res->n_ids,
                          "predicted_ms", dms, "predicted_per_second", df_decode_tokens_per_second(n_after_first, dms));
    if (t && speculative) {
        json_object_set_new(t, "draft_rounds", json_integer(res->draft_rounds));
        json_object_set_new(t, "draft_n", json_integer(res->draft_n));
        json_object_set_new(t, "draft_n_accepted", json_integer(res->draft_n_accepted));
        json_object_set_new(t, "plain_steps", json_integer(res->plain_steps));
        json_object_set_new(t, "draft_ms", json_real(res->draft_ms));
        json_object_set_new(t, "verify_ms", json_real(res->verify_ms));
    }
    return t;
}

/* A token's text (invalid UTF-8 -> U+FFFD) and its bytes. */
static void token_text(const df_tokenizer *tok, int32_t id, json_t **text, json_t **bytes) {
    size_t n = 0;
    const char *piece = df_tokenizer_piece(tok, id, &n);
    jbuf b = {0};
    if (ju8_sanitize(&b, piece ? piece : "", n) == 0) *text = json_stringn(b.p ? b.p : "", b.n);
    else *text = NULL;
    jbuf_free(&b);
    *bytes = json_array();
    for (size_t i = 0; *bytes && i < n; i++) json_array_append_new(*bytes, json_integer((unsigned char)piece[i]));
}

static json_t *logprob_value(float lp) {
    /* JSON has no -inf: a token masked by logit_bias -100 or the like reports -9999 as OpenAI does */
    return json_real(isfinite(lp) ? (double)lp : -9999.0);
}

json_t *df_api_logprob_entry(const df_tokenizer *tok, const df_token_info *info) {
    json_t *text, *bytes;
    token_text(tok, info->id, &text, &bytes);
    json_t *top = json_array();
    for (int k = 0; top && k < info->n_top; k++) {
        json_t *t, *b;
        token_text(tok, info->top[k].id, &t, &b);
        json_array_append_new(top, json_pack("{s:o*, s:o, s:o*}", "token", t, "logprob",
                                             logprob_value(info->top[k].logprob), "bytes", b));
    }
    return json_pack("{s:o*, s:o, s:o*, s:o*}", "token", text, "logprob", logprob_value(info->logprob), "bytes", bytes,
                     "top_logprobs", top);
}

/* Code points of UTF-8 text (continuation bytes are not counted). */
static size_t utf8_chars(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

void df_api_text_offset_init(df_api_text_offset *o, const char *text, size_t len, int skip_special) {
    memset(o, 0, sizeof *o);
    o->skip_special = skip_special;
    if (!text || !len) return;
    json_t *t = df_json_text(text, len); /* the text as the answer carries it */
    if (t) o->chars = utf8_chars(json_string_value(t), json_string_length(t));
    json_decref(t);
}

/* Advances o past token id's text, decoded as the generation's text is (decode/textout.c). */
static void text_offset_advance(df_api_text_offset *o, const df_tokenizer *tok, int32_t id) {
    if (o->skip_special && df_tokenizer_is_special(tok, id)) return;
    size_t n = 0;
    const char *piece = df_tokenizer_piece(tok, id, &n);
    if (!piece) return;
    while (n > 0) { /* in slices, into a bounded buffer */
        const size_t k = n < 64 ? n : 64;
        char out[3 * (64 + 8)];
        size_t w = df_utf8_sanitize((const unsigned char *)piece, k, o->pend, &o->n_pend, 0, out);
        o->chars += utf8_chars(out, w);
        piece += k;
        n -= k;
    }
}

/* 1 if byte b continues the unfinished sequence o->pend (as far as it goes, a valid prefix of
 * a UTF-8 character), so that a token starting with b points at that character. Otherwise the
 * pending bytes come out as one U+FFFD each before b's text. */
static int text_offset_continues(const df_api_text_offset *o, unsigned char b) {
    if (o->n_pend <= 0 || (b & 0xC0) != 0x80) return 0;
    unsigned char s[2] = {o->pend[0], o->n_pend > 1 ? o->pend[1] : b};
    if (s[0] == 0xE0 && s[1] < 0xA0) return 0;
    if (s[0] == 0xED && s[1] > 0x9F) return 0;
    if (s[0] == 0xF0 && s[1] < 0x90) return 0;
    if (s[0] == 0xF4 && s[1] > 0x8F) return 0;
    return 1;
}

/* The offset of token id's text: where it begins in the returned text, after the U+FFFD of
 * pending bytes that its first byte does not continue. */
static size_t text_offset_of(const df_api_text_offset *o, const df_tokenizer *tok, int32_t id) {
    if (o->n_pend <= 0 || (o->skip_special && df_tokenizer_is_special(tok, id))) return o->chars;
    size_t n = 0;
    const char *piece = df_tokenizer_piece(tok, id, &n);
    if (!piece || !n || text_offset_continues(o, (unsigned char)piece[0])) return o->chars;
    return o->chars + (size_t)o->n_pend;
}

/* A token as the legacy completions format writes it: its text when that is valid UTF-8 on its
 * own, else "bytes:" and its bytes as \xNN escapes (as OpenAI's API does), so that byte pieces
 * get keys of their own in top_logprobs. */
static json_t *legacy_token(const df_tokenizer *tok, int32_t id) {
    size_t n = 0;
    const char *piece = df_tokenizer_piece(tok, id, &n);
    if (!piece) return json_string("");
    if (ju8_invalid_at(piece, n) == n) return json_stringn(piece, n);
    jbuf b = {0};
    int bad = jbuf_put(&b, "bytes:", 6);
    for (size_t i = 0; !bad && i < n; i++) {
        char x[5];
        snprintf(x, sizeof x, "\\x%02x", (unsigned char)piece[i]);
        bad = jbuf_put(&b, x, 4);
    }
    json_t *t = bad ? NULL : json_stringn(b.p, b.n);
    jbuf_free(&b);
    return t;
}

json_t *df_api_completion_logprobs(const df_tokenizer *tok, const df_token_info *info, int n, df_api_text_offset *off) {
    json_t *tokens = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    for (int i = 0; i < n; i++) {
        json_t *t = legacy_token(tok, info[i].id);
        json_array_append_new(offs, json_integer((json_int_t)text_offset_of(off, tok, info[i].id)));
        text_offset_advance(off, tok, info[i].id);
        /* the n most likely tokens, and the sampled one when it is not among them (OpenAI's
         * legacy format: up to logprobs + 1 entries), in that order */
        json_t *top = json_object();
        for (int k = 0; top && k < info[i].n_top; k++) {
            json_t *tt = legacy_token(tok, info[i].top[k].id);
            /* two tokens of the same text keep the first, more likely one's value */
            if (tt && !json_object_get(top, json_string_value(tt)))
                json_object_set_new(top, json_string_value(tt), logprob_value(info[i].top[k].logprob));
            json_decref(tt);
        }
        if (top && t && !json_object_get(top, json_string_value(t)))
            json_object_set_new(top, json_string_value(t), logprob_value(info[i].logprob));
        json_array_append_new(tokens, t ? t : json_string(""));
        json_array_append_new(lps, logprob_value(info[i].logprob));
        json_array_append_new(tops, top);
    }
    return json_pack("{s:o*, s:o*, s:o*, s:o*}", "tokens", tokens, "token_logprobs", lps, "top_logprobs", tops,
                     "text_offset", offs);
}
