/* dflash server: the OpenAI API layer — routes, authentication, chat completions
 * (see include/dflash/server.h). The HTTP transport is in http.c. */
#include "server/server_impl.h"

#include <arpa/inet.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "dflash/generate.h"
#include "server/openai.h"

/* Value of the x-dflash header: this version always decodes plainly. */
#define X_DFLASH_PLAIN "fallback; reason=no-drafter"

df_server_options df_server_options_default(void) {
    df_server_options o;
    memset(&o, 0, sizeof o);
    o.host = DF_SERVER_DEFAULT_HOST;
    o.port = DF_SERVER_DEFAULT_PORT;
    o.max_body = DF_SERVER_DEFAULT_MAX_BODY;
    o.max_connections = 64;
    o.timeout_s = 60;
    return o;
}

int df_server_host_is_loopback(const char *host) {
    if (!host) return 0;
    if (strcasecmp(host, "localhost") == 0) return 1;
    struct in_addr a4;
    if (inet_pton(AF_INET, host, &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    struct in6_addr a6;
    if (inet_pton(AF_INET6, host, &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
    return 0;
}

/* ---- paths, logging ---------------------------------------------------------------- */

static void add_private(df_server *srv, const char *path, const char *public_name) {
    if (!path || strlen(path) < 2 || srv->n_private >= DF_SERVER_MAX_PRIVATE) return;
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;      /* "dir/" and "dir" are the same place */
    for (int i = 0; i < srv->n_private; i++)
        if (strlen(srv->private_paths[i]) == n && strncmp(srv->private_paths[i], path, n) == 0) return;
    char *copy = strndup(path, n);
    if (!copy) return;
    /* insertion keeping the longest path first, so a folder inside another wins */
    int i = srv->n_private++;
    while (i > 0 && strlen(srv->private_paths[i - 1]) < n) {
        srv->private_paths[i] = srv->private_paths[i - 1];
        srv->public_names[i] = srv->public_names[i - 1];
        i--;
    }
    srv->private_paths[i] = copy;
    srv->public_names[i] = public_name;
}

void df_server_redact(const df_server *srv, const char *in, char *out, size_t cap) {
    if (cap == 0) return;
    size_t o = 0;
    while (*in && o + 1 < cap) {
        int hit = 0;
        for (int i = 0; i < srv->n_private && !hit; i++) {
            size_t n = strlen(srv->private_paths[i]);
            if (strncmp(in, srv->private_paths[i], n) != 0) continue;
            size_t m = strlen(srv->public_names[i]);
            if (m > cap - 1 - o) m = cap - 1 - o;
            memcpy(out + o, srv->public_names[i], m);
            o += m;
            in += n;
            hit = 1;
        }
        if (!hit) out[o++] = *in++;
    }
    out[o] = 0;
}

void df_server_log(const df_server *srv, const char *fmt, ...) {
    if (!srv->opt.log) return;
    char raw[1024], line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    df_server_redact(srv, raw, line, sizeof line);
    srv->opt.log(srv->opt.log_user, line);
}

/* ---- init / free ------------------------------------------------------------------- */

df_status df_server_init(df_server **out, df_engine *eng, const df_server_options *opt_in, df_error *err) {
    *out = NULL;
    df_server_options opt = opt_in ? *opt_in : df_server_options_default();
    if (!opt.host || !opt.host[0]) opt.host = DF_SERVER_DEFAULT_HOST;
    if (!opt.model_id || !opt.model_id[0])
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: a model id is required");
    if (opt.port < 0 || opt.port > 65535)
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: port %d is outside 0..65535", opt.port);
    if (opt.max_tokens < 0 || opt.ctx_size < 0)
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: max_tokens and ctx_size must be >= 0");
    int has_key = opt.api_key && opt.api_key[0];
    if (!has_key && !df_server_host_is_loopback(opt.host))
        return df_error_set(err, DF_ERR_INVALID_ARG,
                            "server: listening on '%s' (not a loopback address) requires an API key", opt.host);
    if (opt.max_body == 0) opt.max_body = DF_SERVER_DEFAULT_MAX_BODY;
    if (opt.max_connections == 0) opt.max_connections = 64;
    if (opt.timeout_s == 0) opt.timeout_s = 60;

    df_server *srv = calloc(1, sizeof *srv);
    if (!srv) return df_error_set(err, DF_ERR_NOMEM, "server: out of memory");
    srv->eng = eng;
    srv->host = strdup(opt.host);
    srv->model_id = strdup(opt.model_id);
    srv->api_key = has_key ? strdup(opt.api_key) : NULL;
    if (!srv->host || !srv->model_id || (has_key && !srv->api_key)) {
        df_server_free(srv);
        return df_error_set(err, DF_ERR_NOMEM, "server: out of memory");
    }
    opt.host = srv->host;
    opt.model_id = srv->model_id;
    opt.api_key = srv->api_key;
    srv->opt = opt;
    pthread_mutex_init(&srv->gen_lock, NULL);
    atomic_init(&srv->stopping, 0);
    atomic_init(&srv->in_flight, 0);
    atomic_init(&srv->id_counter, 0);
    srv->created = time(NULL);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    srv->id_seed = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16);
    srv->bound_port = opt.port;

    const df_pack *pack = df_engine_pack(eng);
    if (pack && pack->dir) {
        char *real = realpath(pack->dir, NULL);
        add_private(srv, real, srv->model_id);
        free(real);
        add_private(srv, pack->dir, srv->model_id);
    }
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof cwd)) add_private(srv, cwd, ".");
    add_private(srv, getenv("HOME"), "~");

    df_status st = df_session_init(&srv->session, eng, opt.ctx_size, err);
    if (st != DF_OK) {
        df_server_free(srv);
        return st;
    }
    *out = srv;
    return DF_OK;
}

void df_server_free(df_server *srv) {
    if (!srv) return;
    df_server_stop(srv);
    if (srv->session) df_session_free(srv->session);
    pthread_mutex_destroy(&srv->gen_lock);
    for (int i = 0; i < srv->n_private; i++) free(srv->private_paths[i]);
    free(srv->host);
    free(srv->model_id);
    free(srv->api_key);
    free(srv);
}

int df_server_port(const df_server *srv) { return srv->bound_port; }

/* ---- responses --------------------------------------------------------------------- */

void df_http_response_free(df_http_response *resp) {
    free(resp->body);
    resp->body = NULL;
    resp->body_len = 0;
}

static void set_json(df_http_response *resp, int status, json_t *j) {
    resp->status = status;
    resp->content_type = "application/json";
    free(resp->body);
    resp->body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!resp->body) {
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"code\":null,\"param\":null}}";
        resp->status = 500;
        resp->body = strdup(oom);
        snprintf(resp->note, sizeof resp->note, "out of memory");
    }
    resp->body_len = resp->body ? strlen(resp->body) : 0;
}

static void set_error(df_http_response *resp, const df_api_error *e) {
    snprintf(resp->note, sizeof resp->note, "%.159s", e->message);
    set_json(resp, e->status, df_api_error_json(e));
}

/* An error from the engine: its message may name local files, so it is redacted. */
static void set_engine_error(const df_server *srv, df_http_response *resp, int status, const char *type,
                             const char *code, const df_error *err) {
    df_api_error e;
    char msg[DF_ERROR_MSG_MAX];
    df_server_redact(srv, err->msg, msg, sizeof msg);
    df_api_error_set(&e, status, type, code, NULL, "%s", msg);
    set_error(resp, &e);
}

/* ---- routes ------------------------------------------------------------------------ */

/* Constant-time comparison of the Authorization header with "Bearer <key>": the time
 * depends only on the lengths, never on where the first difference is. */
static int authorized(const df_server *srv, const char *header) {
    if (!srv->api_key) return 1;
    if (!header || strncasecmp(header, "Bearer ", 7) != 0) return 0;
    const char *given = header + 7;
    while (*given == ' ') given++;
    size_t n = strlen(given), m = strlen(srv->api_key);
    unsigned char diff = (unsigned char)(n != m);
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)given[i] ^ (unsigned char)srv->api_key[i % m];
    return diff == 0;
}

static json_t *model_object(const df_server *srv) {
    return json_pack("{s:s, s:s, s:I, s:s}", "id", srv->model_id, "object", "model", "created",
                     (json_int_t)srv->created, "owned_by", "dflash");
}

static void route_models(const df_server *srv, df_http_response *resp) {
    json_t *list = json_pack("{s:s, s:[o]}", "object", "list", "data", model_object(srv));
    set_json(resp, 200, list);
}

static void route_model(const df_server *srv, const char *id, df_http_response *resp) {
    if (strcmp(id, srv->model_id) == 0) {
        set_json(resp, 200, model_object(srv));
        return;
    }
    df_api_error e;
    df_api_error_set(&e, 404, "invalid_request_error", "model_not_found", "model",
                     "The model '%.128s' does not exist; this server serves '%.128s'.", id, srv->model_id);
    set_error(resp, &e);
}

typedef struct gen_ctx {
    df_server *srv;
    const df_http_request *req;
    int client_gone;
} gen_ctx;

static int on_token(void *user, int32_t id, const char *text, size_t len) {
    (void)id, (void)text, (void)len;
    gen_ctx *g = user;
    if (atomic_load(&g->srv->stopping)) return 1;
    if (g->req->client_gone && g->req->client_gone(g->req->client_user)) {
        g->client_gone = 1;
        return 1;
    }
    return 0;
}

static void make_id(df_server *srv, char *out, size_t cap) {
    /* splitmix64 of a per-process seed and a counter: unique per response */
    uint64_t x = srv->id_seed + 0x9E3779B97F4A7C15ull * (atomic_fetch_add(&srv->id_counter, 1) + 1);
    uint64_t h[2];
    for (int i = 0; i < 2; i++) {
        uint64_t z = (x += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        h[i] = z ^ (z >> 31);
    }
    snprintf(out, cap, "chatcmpl-%016llx%08llx", (unsigned long long)h[0], (unsigned long long)(h[1] >> 32));
}

static json_t *chat_response(df_server *srv, const df_gen_result *res) {
    char id[48];
    make_id(srv, id, sizeof id);
    double pms = res->prompt_ms, dms = res->decode_ms;
    json_t *message = json_pack("{s:s, s:o}", "role", "assistant", "content", df_json_text(res->text ? res->text : "", res->text_len));
    json_t *choice = json_pack("{s:i, s:o, s:n, s:s}", "index", 0, "message", message, "logprobs", "finish_reason",
                               df_finish_reason_name(res->finish));
    json_t *usage = json_pack("{s:i, s:i, s:i}", "prompt_tokens", res->n_prompt, "completion_tokens", res->n_ids,
                              "total_tokens", res->n_prompt + res->n_ids);
    json_t *timings = json_pack("{s:i, s:f, s:f, s:i, s:f, s:f}", "prompt_n", res->n_prompt, "prompt_ms", pms,
                                "prompt_per_second", pms > 0 ? res->n_prompt * 1000.0 / pms : 0.0, "predicted_n",
                                res->n_ids, "predicted_ms", dms, "predicted_per_second",
                                dms > 0 ? res->n_ids * 1000.0 / dms : 0.0);
    return json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o, s:o}", "id", id, "object", "chat.completion", "created",
                     (json_int_t)time(NULL), "model", srv->model_id, "choices", choice, "usage", usage, "timings",
                     timings);
}

/* Appends k ids to the growing array *ids (*n used, *cap allocated). */
static df_status append_ids(const int32_t *part, size_t k, int32_t **ids, size_t *n, size_t *cap, df_error *err) {
    if (*n + k > *cap) {
        size_t c = (*n + k) * 2 + 16;
        int32_t *p = realloc(*ids, c * sizeof *p);
        if (!p) return df_error_set(err, DF_ERR_NOMEM, "out of memory tokenizing the prompt");
        *ids = p;
        *cap = c;
    }
    memcpy(*ids + *n, part, k * sizeof *part);
    *n += k;
    return DF_OK;
}

/* Appends the ids of text (special tokens recognised or not). */
static df_status append_encoded(const df_tokenizer *tok, const char *text, int parse_special, int32_t **ids,
                                size_t *n, size_t *cap, df_error *err) {
    int32_t *part = NULL;
    size_t k = 0;
    df_status st = df_tokenizer_encode(tok, text, strlen(text), parse_special, &part, &k, err);
    if (st == DF_OK) st = append_ids(part, k, ids, n, cap, err);
    free(part);
    return st;
}

/* Tokenizes the messages in the ChatML framing of df_chatml_render (thinking off), with
 * message content treated as untrusted text: special tokens written in a message
 * ("<|im_end|>", "<|im_start|>") are encoded as plain text, so a message cannot forge turn
 * boundaries. The framing tokens are looked up by name. Because the tokenizer encodes the
 * text between added tokens independently, the ids equal those of df_chatml_render's string
 * encoded with special tokens whenever no content contains a special token.
 * A tokenizer without <|im_start|> / <|im_end|> falls back to encoding the rendered string. */
static df_status encode_chat(const df_tokenizer *tok, const df_chat_request *cr, int32_t **ids, size_t *n,
                             df_error *err) {
    *ids = NULL;
    *n = 0;
    size_t cap = 0;
    df_status st = DF_OK;
    int32_t start = df_tokenizer_token_id(tok, "<|im_start|>"), end = df_tokenizer_token_id(tok, "<|im_end|>");
    char *text = df_chatml_render(cr->roles, (const char *const *)cr->contents, start < 0 || end < 0 ? cr->n_messages : 0, 0);
    if (!text) return df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt");
    if (start >= 0 && end >= 0) {
        for (int i = 0; i < cr->n_messages && st == DF_OK; i++) {
            size_t len = strlen(cr->roles[i]) + strlen(cr->contents[i]) + 2;
            char *turn = malloc(len);
            if (!turn) {
                st = df_error_set(err, DF_ERR_NOMEM, "out of memory rendering the prompt");
                break;
            }
            snprintf(turn, len, "%s\n%s", cr->roles[i], cr->contents[i]);
            st = append_ids(&start, 1, ids, n, &cap, err);
            if (st == DF_OK) st = append_encoded(tok, turn, 0, ids, n, &cap, err);
            if (st == DF_OK) st = append_ids(&end, 1, ids, n, &cap, err);
            if (st == DF_OK) st = append_encoded(tok, "\n", 0, ids, n, &cap, err);
            free(turn);
        }
    }
    /* the rendered text is the assistant prefix alone, or everything in the fallback */
    if (st == DF_OK) st = append_encoded(tok, text, 1, ids, n, &cap, err);
    free(text);
    if (st != DF_OK) {
        free(*ids);
        *ids = NULL;
        *n = 0;
    }
    return st;
}

static void route_chat(df_server *srv, const df_http_request *req, df_http_response *resp) {
    df_api_error e;
    if (req->body_too_large) {
        df_api_error_set(&e, 413, "invalid_request_error", "request_too_large", NULL,
                         "The request body is larger than the limit of %zu bytes.", srv->opt.max_body);
        set_error(resp, &e);
        return;
    }
    df_chat_request cr;
    const df_pack *pack = df_engine_pack(srv->eng);
    if (df_chat_request_parse(&cr, req->body, req->body_len, srv->model_id, pack ? &pack->gen : NULL, &e)) {
        set_error(resp, &e);
        return;
    }
    int32_t *ids = NULL;
    size_t n_ids = 0;
    df_error err = {0};
    if (encode_chat(df_engine_tokenizer(srv->eng), &cr, &ids, &n_ids, &err) != DF_OK) {
        set_engine_error(srv, resp, err.code == DF_ERR_INVALID_ARG ? 400 : 500,
                         err.code == DF_ERR_INVALID_ARG ? "invalid_request_error" : "server_error", NULL, &err);
        goto done;
    }
    int n_ctx = df_session_max_ctx(srv->session);
    if (n_ids >= (size_t)n_ctx) {
        df_api_error_set(&e, 400, "invalid_request_error", "context_length_exceeded", "messages",
                         "This model's maximum context length is %d tokens, but the messages take %zu tokens.",
                         n_ctx, n_ids);
        set_error(resp, &e);
        goto done;
    }
    /* The server's --max-tokens is the default and the upper bound. */
    int cap = srv->opt.max_tokens;
    if (cr.gen.max_tokens <= 0 || (cap > 0 && cr.gen.max_tokens > cap)) cr.gen.max_tokens = cap;

    gen_ctx g = {srv, req, 0};
    df_gen_result res;
    memset(&res, 0, sizeof res);
    pthread_mutex_lock(&srv->gen_lock);
    df_status st = DF_ERR_CANCELLED;
    if (!atomic_load(&srv->stopping))
        st = df_generate(srv->session, ids, (int)n_ids, &cr.gen, on_token, &g, &res, &err);
    pthread_mutex_unlock(&srv->gen_lock);

    resp->prompt_tokens = res.n_prompt ? res.n_prompt : (int)n_ids;
    resp->completion_tokens = res.n_ids;
    resp->gen_ms = res.prompt_ms + res.decode_ms;
    if (st == DF_ERR_CANCELLED || (st == DF_OK && res.finish == DF_FINISH_CANCELLED)) {
        df_api_error_set(&e, 503, "server_error", g.client_gone ? "client_closed" : "shutting_down", NULL,
                         g.client_gone ? "The client closed the connection." : "The server is shutting down.");
        set_error(resp, &e);
    } else if (st == DF_ERR_RANGE) {
        set_engine_error(srv, resp, 400, "invalid_request_error", "context_length_exceeded", &err);
    } else if (st == DF_ERR_INVALID_ARG) {
        set_engine_error(srv, resp, 400, "invalid_request_error", "invalid_value", &err);
    } else if (st != DF_OK) {
        set_engine_error(srv, resp, 500, "server_error", NULL, &err);
    } else {
        resp->finish = df_finish_reason_name(res.finish);
        resp->x_dflash = X_DFLASH_PLAIN;
        set_json(resp, 200, chat_response(srv, &res));
    }
    df_gen_result_free(&res);
done:
    free(ids);
    df_chat_request_free(&cr);
}

static void method_not_allowed(const char *method, const char *path, const char *allow, df_http_response *resp) {
    df_api_error e;
    df_api_error_set(&e, 405, "invalid_request_error", "method_not_allowed", NULL,
                     "Method %.16s is not allowed on %.128s; use %s.", method, path, allow);
    set_error(resp, &e);
    resp->allow = allow;
}

void df_server_handle(df_server *srv, const df_http_request *req, df_http_response *resp) {
    memset(resp, 0, sizeof *resp);
    resp->prompt_tokens = -1;
    resp->content_type = "application/json";
    const char *m = req->method ? req->method : "";
    const char *path = req->path ? req->path : "";
    int get = strcmp(m, "GET") == 0 || strcmp(m, "HEAD") == 0;
    df_api_error e;

    if (strcmp(path, "/health") == 0) {   /* no key needed: for load balancers and probes */
        if (!get) method_not_allowed(m, path, "GET", resp);
        else set_json(resp, 200, json_pack("{s:s}", "status", "ok"));
        return;
    }
    if (!authorized(srv, req->authorization)) {
        df_api_error_set(&e, 401, "invalid_request_error", "invalid_api_key", NULL,
                         "Missing or incorrect API key; send 'Authorization: Bearer <key>'.");
        set_error(resp, &e);
        resp->www_authenticate = 1;
        return;
    }
    static const char models[] = "/v1/models";
    if (strcmp(path, models) == 0) {
        if (!get) method_not_allowed(m, path, "GET", resp);
        else route_models(srv, resp);
    } else if (strncmp(path, models, sizeof models - 1) == 0 && path[sizeof models - 1] == '/' &&
               path[sizeof models]) {
        if (!get) method_not_allowed(m, path, "GET", resp);
        else route_model(srv, path + sizeof models, resp);
    } else if (strcmp(path, "/v1/chat/completions") == 0) {
        if (strcmp(m, "POST") != 0) method_not_allowed(m, path, "POST", resp);
        else route_chat(srv, req, resp);
    } else {
        df_api_error_set(&e, 404, "invalid_request_error", "not_found", NULL, "Unknown route: %.16s %.128s", m, path);
        set_error(resp, &e);
    }
}
