/* dflash server: the OpenAI API layer — options, routes, authentication, request
 * validation and tokenization, routing to speculative or plain decoding (see
 * include/dflash/server.h). Generation runs in worker.c, the HTTP transport in http.c. */
#include "server/server_impl.h"

#include "dflash/tokenizer.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <unistd.h>
#include <utf8proc.h>

#include "dflash/generate.h"

df_server_options df_server_options_default(void) {
    df_server_options o;
    memset(&o, 0, sizeof o);
    o.host = DF_SERVER_DEFAULT_HOST;
    o.port = DF_SERVER_DEFAULT_PORT;
    o.max_body = DF_SERVER_DEFAULT_MAX_BODY;
    o.max_header = DF_SERVER_DEFAULT_MAX_HEADER;
    o.max_connections = 64;
    o.timeout_s = 30;
    o.request_timeout_s = 60;
    o.queue = DF_SERVER_DEFAULT_QUEUE;
    o.top_logprobs_k = DF_MAX_TOP_LOGPROBS;
    o.spec = df_spec_params_default();
    o.draft_window = DF_SERVER_DEFAULT_DRAFT_WINDOW;
    o.cors_origin = "*";
    return o;
}

int df_server_model_id_valid(const char *id) {
    if (!id || !id[0]) return 0;
    const size_t n = strlen(id);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)id[i] < 0x20 || id[i] == 0x7f) return 0;
    return df_utf8_invalid_at(id, n) >= n;
}

int df_server_cors_origin_valid(const char *o) {
    if (!o) return 0;
    if (!strcmp(o, "*") || !strcmp(o, "null")) return 1;
    const size_t n = strlen(o);
    if (n == 0 || n > 255 || !isalpha((unsigned char)o[0])) return 0;
    size_t i = 1;
    while (i < n && (isalnum((unsigned char)o[i]) || o[i] == '+' || o[i] == '.' || o[i] == '-')) i++;
    if (strncmp(o + i, "://", 3) != 0) return 0;
    i += 3;
    const size_t h0 = i;
    if (i < n && o[i] == '[') { /* [IPv6] */
        i++;
        while (i < n && (isxdigit((unsigned char)o[i]) || o[i] == ':' || o[i] == '.')) i++;
        if (i >= n || o[i] != ']' || i == h0 + 1) return 0;
        i++;
    } else {
        while (i < n && (isalnum((unsigned char)o[i]) || o[i] == '.' || o[i] == '-')) i++;
        if (i == h0) return 0;
    }
    if (i < n && o[i] == ':') { /* port */
        const size_t p0 = ++i;
        long port = 0;
        while (i < n && isdigit((unsigned char)o[i]) && i - p0 < 5) port = port * 10 + (o[i++] - '0');
        if (i == p0 || port > 65535 || (i < n && isdigit((unsigned char)o[i]))) return 0;
    }
    return i == n;
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

double df_ms_since(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

double df_peak_rss_mib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_maxrss / 1024.0; /* Linux: KiB */
}

/* ---- paths, logging ---------------------------------------------------------------- */

static void add_private(df_server *srv, const char *path, const char *public_name) {
    if (!path || strlen(path) < 2 || srv->n_private >= DF_SERVER_MAX_PRIVATE) return;
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--; /* "dir/" and "dir" are the same place */
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

static void add_private_dir(df_server *srv, const char *dir, const char *public_name) {
    if (!dir) return;
    char *real = realpath(dir, NULL);
    add_private(srv, real, public_name);
    free(real);
    add_private(srv, dir, public_name);
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

/* A printable copy of an untrusted string for the log: characters are kept whole (when they
 * fit), except controls, format characters (direction marks), line and paragraph separators and
 * unassigned or private ones, which become '?' like bytes that are not UTF-8. */
static void printable(const char *in, char *out, size_t cap) {
    size_t o = 0;
    const utf8proc_uint8_t *p = (const utf8proc_uint8_t *)in;
    while (p && *p && o + 1 < cap) {
        utf8proc_int32_t cp;
        const utf8proc_ssize_t n = utf8proc_iterate(p, -1, &cp);
        utf8proc_category_t c = n > 0 ? utf8proc_category(cp) : UTF8PROC_CATEGORY_CN;
        if (c == UTF8PROC_CATEGORY_CC || c == UTF8PROC_CATEGORY_CF || c == UTF8PROC_CATEGORY_ZL ||
            c == UTF8PROC_CATEGORY_ZP || c == UTF8PROC_CATEGORY_CS || c == UTF8PROC_CATEGORY_CO ||
            c == UTF8PROC_CATEGORY_CN) {
            out[o++] = '?';
            p += n > 0 ? n : 1;
        } else if (o + (size_t)n + 1 <= cap) {
            memcpy(out + o, p, (size_t)n);
            o += (size_t)n;
            p += n;
        } else {
            break;
        }
    }
    out[o] = 0;
}

/* ---- init / free ------------------------------------------------------------------- */

static char *dup_or_null(const char *s, int *bad) {
    if (!s) return NULL;
    char *d = strdup(s);
    if (!d) *bad = 1;
    return d;
}

df_status df_server_init(df_server **out, const df_server_options *opt_in, df_error *err) {
    *out = NULL;
    df_server_options opt = opt_in ? *opt_in : df_server_options_default();
    if (!opt.host || !opt.host[0]) opt.host = DF_SERVER_DEFAULT_HOST;
    if (!opt.model_id || !opt.model_id[0])
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: a model id is required");
    if (!df_server_model_id_valid(opt.model_id))
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: the model id must be UTF-8 text without control characters");
    if (!opt.model_dir || !opt.model_dir[0])
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: a model folder is required");
    if (opt.port < 0 || opt.port > 65535)
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: port %d is outside 0..65535", opt.port);
    if (opt.max_tokens < 0 || opt.ctx_size < 0 || opt.queue < 0 || opt.n_threads < 0)
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: max_tokens, ctx_size, queue and threads must be >= 0");
    if (opt.top_logprobs_k < 0 || opt.top_logprobs_k > DF_MAX_TOP_LOGPROBS)
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: top_logprobs_k must lie within 0..%d",
                            DF_MAX_TOP_LOGPROBS);
    if (opt.draft_window < 1) return df_error_set(err, DF_ERR_INVALID_ARG, "server: the draft window must be >= 1");
    if (opt.draft_quant != 0 && opt.draft_quant != 4 && opt.draft_quant != 8)
        return df_error_set(err, DF_ERR_INVALID_ARG, "server: drafter quantization must be 4 or 8 bits");
    int has_key = opt.api_key && opt.api_key[0];
    if (!has_key && !df_server_host_is_loopback(opt.host))
        return df_error_set(err, DF_ERR_INVALID_ARG,
                            "server: listening on '%s' (not a loopback address) requires an API key", opt.host);
    if (opt.cors_origin && opt.cors_origin[0] && !df_server_cors_origin_valid(opt.cors_origin)) {
        char shown[64];
        printable(opt.cors_origin, shown, sizeof shown);
        return df_error_set(err, DF_ERR_INVALID_ARG,
                            "server: CORS origin '%s' is not *, null or one origin scheme://host[:port] "
                            "(no path, no list)", shown);
    }
    if (opt.max_body == 0) opt.max_body = DF_SERVER_DEFAULT_MAX_BODY;
    if (opt.max_header == 0) opt.max_header = DF_SERVER_DEFAULT_MAX_HEADER;
    if (opt.max_connections == 0) opt.max_connections = 64;
    if (opt.timeout_s == 0) opt.timeout_s = 30;
    if (opt.request_timeout_s == 0) opt.request_timeout_s = 60;

    df_server *srv = calloc(1, sizeof *srv);
    if (!srv) return df_error_set(err, DF_ERR_NOMEM, "server: out of memory");
    int bad = 0;
    srv->host = dup_or_null(opt.host, &bad);
    srv->model_id = dup_or_null(opt.model_id, &bad);
    srv->api_key = has_key ? dup_or_null(opt.api_key, &bad) : NULL;
    srv->model_dir = dup_or_null(opt.model_dir, &bad);
    srv->drafter_dir = opt.drafter_dir && opt.drafter_dir[0] ? dup_or_null(opt.drafter_dir, &bad) : NULL;
    srv->cors_origin = opt.cors_origin && opt.cors_origin[0] ? dup_or_null(opt.cors_origin, &bad) : NULL;
    opt.host = srv->host;
    opt.model_id = srv->model_id;
    opt.api_key = srv->api_key;
    opt.model_dir = srv->model_dir;
    opt.drafter_dir = srv->drafter_dir;
    opt.cors_origin = srv->cors_origin;
    srv->opt = opt;
    pthread_mutex_init(&srv->qlock, NULL);
    pthread_cond_init(&srv->qcond, NULL);
    pthread_mutex_init(&srv->metrics.lock, NULL);
    atomic_init(&srv->state, DF_SERVER_LOADING);
    atomic_init(&srv->stopping, 0);
    atomic_init(&srv->in_flight, 0);
    atomic_init(&srv->seq, 0);
    atomic_init(&srv->id_counter, 0);
    srv->created = time(NULL);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    srv->id_seed = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16);
    srv->bound_port = opt.port;
    if (bad) {
        df_server_free(srv);
        return df_error_set(err, DF_ERR_NOMEM, "server: out of memory");
    }
    add_private_dir(srv, srv->model_dir, srv->model_id);
    add_private_dir(srv, srv->drafter_dir, "drafter");
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof cwd)) add_private(srv, cwd, ".");
    add_private(srv, getenv("HOME"), "~");
    *out = srv;
    return DF_OK;
}

void df_server_free(df_server *srv) {
    if (!srv) return;
    df_server_stop(srv);
    df_draft_state_free(srv->dstate);
    df_drafter_free(srv->drafter);
    df_session_free(srv->session);
    df_chat_setup_free(&srv->chat);
    df_engine_free(srv->eng);
    pthread_mutex_destroy(&srv->qlock);
    pthread_cond_destroy(&srv->qcond);
    pthread_mutex_destroy(&srv->metrics.lock);
    for (int i = 0; i < srv->n_private; i++) free(srv->private_paths[i]);
    free(srv->host);
    free(srv->model_id);
    free(srv->api_key);
    free(srv->model_dir);
    free(srv->drafter_dir);
    free(srv->cors_origin);
    free(srv);
}

int df_server_port(const df_server *srv) { return srv->bound_port; }

df_server_state df_server_get_state(const df_server *srv) { return (df_server_state)atomic_load(&srv->state); }

const char *df_server_load_error(const df_server *srv) { return srv->load_error; }
const char *df_server_load_error_full(const df_server *srv) { return srv->load_error_full; }

/* ---- responses --------------------------------------------------------------------- */

void df_http_response_free(df_http_response *resp) {
    free(resp->body);
    resp->body = NULL;
    resp->body_len = 0;
    if (resp->stream) df_server_stream_close(resp->stream);
    resp->stream = NULL;
}

static void set_body(df_http_response *resp, int status, const char *content_type, char *text) {
    resp->status = status;
    resp->content_type = content_type;
    free(resp->body);
    resp->body = text;
    if (!resp->body) {
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"code\":null,\"param\":null}}";
        resp->status = 500;
        resp->content_type = "application/json";
        resp->body = strdup(oom);
    }
    resp->body_len = resp->body ? strlen(resp->body) : 0;
}

static void set_json(df_http_response *resp, int status, json_t *j) {
    set_body(resp, status, "application/json", j ? json_dumps(j, JSON_COMPACT) : NULL);
    json_decref(j);
}

static void set_error(df_http_response *resp, const df_api_error *e) { set_json(resp, e->status, df_api_error_json(e)); }

/* ---- routes ------------------------------------------------------------------------ */

/* Constant-time comparison of the Authorization header with "Bearer <key>": the time
 * depends only on the lengths, never on where the first difference is. */
static int authorized(const df_server *srv, const char *header) {
    if (!srv->api_key) return 1;
    if (!header || strncasecmp(header, "Bearer ", 7) != 0) return 0;
    const char *given = header + 7;
    while (*given == ' ' || *given == '\t') given++;
    size_t n = strlen(given), m = strlen(srv->api_key);
    while (n > 0 && (given[n - 1] == ' ' || given[n - 1] == '\t')) n--; /* optional whitespace (RFC 9110 5.5) */
    unsigned char diff = (unsigned char)(n != m);
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)given[i] ^ (unsigned char)srv->api_key[i % m];
    return diff == 0;
}

static json_t *model_object(const df_server *srv) {
    json_t *o = json_pack("{s:s, s:s, s:I, s:s}", "id", srv->model_id, "object", "model", "created",
                          (json_int_t)srv->created, "owned_by", "dflash");
    if (o && srv->eng && srv->session) {
        json_t *meta = json_pack("{s:i, s:i, s:b, s:s}", "n_ctx", df_session_max_ctx(srv->session), "n_vocab",
                                 df_engine_vocab_size(srv->eng), "speculative",
                                 srv->dstate != NULL && !srv->opt.no_draft, "chat_template",
                                 srv->chat.builtin ? "builtin-chatml" : "pack");
        if (meta && srv->drafter) json_object_set_new(meta, "draft_quant_bits", json_integer(srv->opt.draft_quant));
        if (meta) json_object_set_new(o, "meta", meta);
    }
    return o;
}

static int ready(const df_server *srv) { return atomic_load(&srv->state) == DF_SERVER_READY; }

static void route_models(const df_server *srv, df_http_response *resp) {
    set_json(resp, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", model_object(srv)));
}

/* GET /v1/models/ID. The path arrives with %2F still encoded (a slash escaped in a path is data,
 * never a separator: see http.c), so an id with a slash may come as "org%2Fname": decoded here. */
static void route_model(const df_server *srv, const char *raw_id, df_http_response *resp) {
    char id[512];
    size_t k = 0;
    for (const char *r = raw_id; *r && k + 1 < sizeof id;) {
        if (r[0] == '%' && r[1] == '2' && (r[2] == 'F' || r[2] == 'f')) {
            id[k++] = '/';
            r += 3;
        } else {
            id[k++] = *r++;
        }
    }
    id[k] = 0;
    if (strcmp(id, srv->model_id) == 0) {
        set_json(resp, 200, model_object(srv));
        return;
    }
    df_api_error e;
    df_api_error_set(&e, 404, "invalid_request_error", "model_not_found", "model",
                     "The model '%.128s' does not exist; this server serves '%.128s'.", id, srv->model_id);
    set_error(resp, &e);
}

static void route_health(const df_server *srv, df_http_response *resp) {
    int st = atomic_load(&srv->state);
    if (atomic_load(&srv->stopping))
        set_json(resp, 503, json_pack("{s:s}", "status", "stopping"));
    else if (st == DF_SERVER_READY)
        set_json(resp, 200, json_pack("{s:s}", "status", "ok"));
    else if (st == DF_SERVER_LOADING)
        set_json(resp, 503, json_pack("{s:s}", "status", "loading"));
    else
        set_json(resp, 503, json_pack("{s:s, s:s}", "status", "error", "message", srv->load_error));
    if (resp->status == 503) resp->retry_after = 5;
}

static void make_id(df_server *srv, const char *prefix, char *out, size_t cap) {
    /* splitmix64 of a per-process seed and a counter: unique per response (two outputs per
     * id, so the counter advances the generator by two) */
    uint64_t x = srv->id_seed + 0x9E3779B97F4A7C15ull * 2u * (uint64_t)atomic_fetch_add(&srv->id_counter, 1);
    uint64_t h[2];
    for (int i = 0; i < 2; i++) {
        uint64_t z = (x += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        h[i] = z ^ (z >> 31);
    }
    snprintf(out, cap, "%s-%016llx%08llx", prefix, (unsigned long long)h[0], (unsigned long long)(h[1] >> 32));
}

/* The decode mode of a validated request: speculative, or why not. */
static const char *route_decision(const df_server *srv, const df_api_request *r, int *speculative) {
    *speculative = 0;
    const df_sampling_params *sp = &r->gen.sampling;
    if (!srv->dstate) return "fallback; reason=no-drafter";
    if (srv->opt.no_draft) return "fallback; reason=disabled";
    if (r->forced_output) return "fallback; reason=forced";
    if (sp->temperature > 0.0f) return "fallback; reason=sampled";
    if (r->gen.logprobs) return "fallback; reason=logprobs";
    if ((sp->repetition_penalty != 0.0f && sp->repetition_penalty != 1.0f) || sp->presence_penalty != 0.0f ||
        sp->frequency_penalty != 0.0f)
        return "fallback; reason=penalties";
    if (sp->n_logit_bias > 0) return "fallback; reason=logit_bias";
    if (df_sampling_has_processors(sp)) return "fallback; reason=penalties";
    *speculative = 1;
    return "speculative";
}

static df_job *job_new(df_server *srv, df_route_label route, const df_http_request *req) {
    df_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    atomic_init(&j->refs, 1);
    atomic_init(&j->cancelled, 0);
    j->srv = srv;
    j->route = route;
    j->client_fd = -1;
    j->created = time(NULL);
    clock_gettime(CLOCK_MONOTONIC, &j->t0);
    printable(req->client ? req->client : "-", j->client, sizeof j->client);
    pthread_mutex_init(&j->lock, NULL);
    pthread_cond_init(&j->cond, NULL);
    return j;
}

void df_job_unref(df_job *j) {
    if (!j || atomic_fetch_sub(&j->refs, 1) != 1) return;
    df_api_request_free(&j->req);
    for (int i = 0; i < j->n_prompts; i++) {
        if (j->ids[i] != j->chat.ids) free(j->ids[i]);
        free(j->echo[i]);
    }
    df_chat_built_free(&j->chat);
    free(j->forced);
    jbuf_free(&j->out);
    json_decref(j->body);
    if (j->client_fd >= 0) close(j->client_fd);
    pthread_mutex_destroy(&j->lock);
    pthread_cond_destroy(&j->cond);
    free(j);
}

static const char *route_path(df_route_label r) {
    static const char *const paths[DF_ROUTE_COUNT] = {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                      "/v1/models/{id}", "/health", "/metrics", "other"};
    return paths[r];
}

/* The 400 of a prompt of n tokens (at_least: n is a lower bound from its length, the prompt
 * was not tokenized: one of more than DF_PROMPT_EXACT_BYTES) that the context of n_ctx
 * positions cannot hold with a completion. The counts go into n_prompt_tokens and n_ctx, as
 * llama.cpp's server gives them (n_prompt_tokens the lower bound where at_least). */
static int context_exceeded(df_api_error *e, const char *param, size_t n, size_t n_ctx, int at_least) {
    df_api_error_set(e, 400, "invalid_request_error", "exceed_context_size_error", param,
                     "The request exceeds the available context size: the prompt has %s%zu tokens and the context "
                     "holds %zu (at least one more is needed for the completion).",
                     at_least ? "at least " : "", n, n_ctx);
    e->n_prompt_tokens = (long long)n;
    e->n_ctx = (long long)n_ctx;
    return -1;
}

/* Tokenizes the prompts of a validated request into j. */
static int prepare_prompts(df_server *srv, df_job *j, df_api_error *e) {
    df_api_request *r = &j->req;
    const df_tokenizer *tok = df_engine_tokenizer(srv->eng);
    const size_t n_ctx = (size_t)df_session_max_ctx(srv->session);
    df_error err = {0};
    char msg[DF_ERROR_MSG_MAX];
    if (r->route == DF_API_CHAT) {
        df_status st = df_chat_build(&srv->chat, r->root, r->tool_choice, r->tool_name, 1, &j->chat, &err);
        if (st) {
            df_server_redact(srv, err.msg, msg, sizeof msg);
            if (st == DF_ERR_INVALID_ARG)
                return df_api_error_set(e, 400, "invalid_request_error", "chat_template_error", "messages", "%s", msg);
            if (st == DF_ERR_RANGE)
                return df_api_error_set(e, 400, "invalid_request_error", "chat_template_error", "messages",
                                        "The chat template exceeded its limits: %s", msg);
            return df_api_error_set(e, 500, "server_error", NULL, NULL, "%s", msg);
        }
        if (j->chat.too_long) return context_exceeded(e, "messages", j->chat.n_ids, n_ctx, 1);
        j->n_prompts = 1;
        j->ids[0] = j->chat.ids;
        j->n_ids[0] = (int)j->chat.n_ids;
        if (j->chat.n_ids > INT_MAX / 2) return df_api_error_set(e, 400, "invalid_request_error", NULL, NULL, "too long");
    } else {
        const size_t max_piece = df_tokenizer_max_piece_len(tok);
        for (int i = 0; i < r->n_prompts; i++) {
            const json_t *p = r->prompts[i];
            /* a prompt with at least as many tokens as the context holds is refused before it is
             * tokenized: a list of ids by its length (exact), a text of more than
             * DF_PROMPT_EXACT_BYTES by its length over the longest piece a token covers (a lower
             * bound: tokenizing it would cost time and many times its size in memory) */
            const int is_text = json_is_string(p);
            const size_t len = is_text ? json_string_length(p) : json_array_size(p);
            const size_t known = !is_text ? len : (max_piece && len > DF_PROMPT_EXACT_BYTES ? len / max_piece : 0);
            if (known >= n_ctx) {
                char param[32] = "prompt";
                if (r->n_prompts > 1) snprintf(param, sizeof param, "prompt[%d]", i);
                return context_exceeded(e, param, known, n_ctx, is_text);
            }
            if (json_is_string(p)) {
                size_t n = 0;
                if (df_tokenizer_encode(tok, json_string_value(p), json_string_length(p), 1, &j->ids[i], &n, &err)) {
                    df_server_redact(srv, err.msg, msg, sizeof msg);
                    return df_api_error_set(e, err.code == DF_ERR_NOMEM ? 500 : 400, "invalid_request_error",
                                            "invalid_value", "prompt", "%s", msg);
                }
                j->n_ids[i] = (int)n;
                if (r->echo && !(j->echo[i] = strndup(json_string_value(p), json_string_length(p))))
                    return df_api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            } else {
                size_t n = json_array_size(p);
                if (!(j->ids[i] = malloc(n * sizeof(int32_t))))
                    return df_api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
                for (size_t k = 0; k < n; k++) j->ids[i][k] = (int32_t)json_integer_value(json_array_get(p, k));
                j->n_ids[i] = (int)n;
                if (r->echo && df_tokenizer_decode(tok, j->ids[i], n, 0, &j->echo[i], NULL, &err))
                    return df_api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            }
            j->n_prompts = i + 1;
        }
    }
    for (int i = 0; i < j->n_prompts; i++) {
        char param[32] = "messages"; /* which prompt, when there are several */
        if (r->route != DF_API_CHAT) {
            if (j->n_prompts > 1) snprintf(param, sizeof param, "prompt[%d]", i);
            else snprintf(param, sizeof param, "prompt");
        }
        if (j->n_ids[i] == 0)
            return df_api_error_set(e, 400, "invalid_request_error", "invalid_value", param,
                                    "The prompt is empty after tokenization.");
        if ((size_t)j->n_ids[i] >= n_ctx) return context_exceeded(e, param, (size_t)j->n_ids[i], n_ctx, 0);
    }
    if (r->forced_output) {
        size_t n = 0;
        if (df_tokenizer_encode(tok, r->forced_output, strlen(r->forced_output), 1, &j->forced, &n, &err))
            return df_api_error_set(e, 400, "invalid_request_error", "invalid_value", "dflash_forced_output", "%s",
                                    err.msg);
        j->n_forced = (int)n;
    }
    /* The server's --max-tokens is the default and the upper bound. */
    int cap = srv->opt.max_tokens;
    j->max_tokens = r->gen.max_tokens;
    if (j->max_tokens <= 0 || (cap > 0 && j->max_tokens > cap)) j->max_tokens = cap;
    return 0;
}

static void log_arrival(df_server *srv, const df_job *j) {
    int total = 0;
    for (int i = 0; i < j->n_prompts; i++) total += j->n_ids[i];
    const char *reason = strstr(j->x_dflash, "reason=");
    char mt[16] = "none"; /* 0: no limit but the context */
    if (j->max_tokens > 0) snprintf(mt, sizeof mt, "%d", j->max_tokens);
    df_server_log(srv, "#%llu %s POST %s: mode=%s%s%s prompt=%d max_tokens=%s%s%s", (unsigned long long)j->seq,
                  j->client, route_path(j->route), j->speculative ? "speculative" : "plain",
                  reason ? " reason=" : "", reason ? reason + 7 : "", total, mt,
                  j->req.stream ? " stream" : "", j->req.tools && j->req.tool_choice ? " tools" : "");
}

/* Answers a completion request; returns 1 when it was queued (its end is then logged by the
 * worker), 0 when it was answered at once. */
static int route_completion(df_server *srv, const df_http_request *req, df_route_label route,
                            df_http_response *resp) {
    df_api_error e;
    if (req->body_too_large) {
        df_api_error_set(&e, 413, "invalid_request_error", "request_too_large", NULL,
                         "The request body is larger than the limit of %zu bytes.", srv->opt.max_body);
        set_error(resp, &e);
        return 0;
    }
    if (!ready(srv)) {
        int failed = atomic_load(&srv->state) == DF_SERVER_FAILED;
        df_api_error_set(&e, 503, "server_error", failed ? "model_load_failed" : "loading_model", NULL, "%s",
                         failed ? "The model failed to load." : "The model is still loading; retry shortly.");
        set_error(resp, &e);
        resp->retry_after = 5;
        return 0;
    }
    df_job *j = job_new(srv, route, req);
    if (!j) {
        set_json(resp, 500, NULL);
        return 0;
    }
    const df_pack *pack = df_engine_pack(srv->eng);
    const int vocab = df_engine_vocab_size(srv->eng);
    df_api_context ctx = {srv->model_id, pack ? &pack->gen : NULL, vocab,
                          srv->opt.top_logprobs_k, srv->opt.test_hooks};
    if (df_api_request_parse(&j->req, route == DF_ROUTE_CHAT ? DF_API_CHAT : DF_API_COMPLETIONS, req->body,
                             req->body_len, &ctx, &e) ||
        prepare_prompts(srv, j, &e)) {
        set_error(resp, &e);
        df_job_unref(j);
        return 0;
    }
    j->x_dflash = route_decision(srv, &j->req, &j->speculative);
    make_id(srv, route == DF_ROUTE_CHAT ? "chatcmpl" : "cmpl", j->id, sizeof j->id);
    if (req->client_fd >= 0) j->client_fd = dup(req->client_fd);
    if (df_job_enqueue(srv, j, &e)) {
        set_error(resp, &e);
        resp->retry_after = j->retry_after > 0 ? j->retry_after : 1;
        df_job_unref(j);
        return 0;
    }
    log_arrival(srv, j);
    resp->x_dflash = j->x_dflash;
    /* This connection's own thread waits: for a stream, until its generation starts (then the
     * 200 headers go and the events follow) or the job ends without starting (turned away at
     * shutdown: a JSON error with its real status); otherwise until the answer is complete. */
    pthread_mutex_lock(&j->lock);
    while (!j->finished && !(j->req.stream && j->started)) pthread_cond_wait(&j->cond, &j->lock);
    const int streaming = j->req.stream && j->started;
    pthread_mutex_unlock(&j->lock);
    if (streaming) {
        resp->status = 200;
        resp->content_type = "text/event-stream; charset=utf-8";
        resp->stream = j; /* the handler's reference passes to the stream */
        return 1;
    }
    resp->retry_after = j->retry_after;
    json_t *body = j->body;
    j->body = NULL;
    if (j->status == 499) { /* nobody to answer (a half-closed client is told nothing made up) */
        json_decref(body);
        resp->status = 499;
        resp->no_answer = 1;
    } else {
        set_json(resp, j->status, body);
    }
    df_job_unref(j);
    return 1;
}

size_t df_server_stream_read(df_server_stream *s, char *buf, size_t cap) {
    pthread_mutex_lock(&s->lock);
    while (s->out_pos == s->out.n && !s->finished) pthread_cond_wait(&s->cond, &s->lock);
    size_t n = s->out.n - s->out_pos;
    if (n > cap) n = cap;
    if (n) memcpy(buf, s->out.p + s->out_pos, n);
    s->out_pos += n;
    if (s->out_pos == s->out.n) s->out_pos = s->out.n = 0;
    pthread_mutex_unlock(&s->lock);
    return n;
}

void df_server_stream_close(df_server_stream *s) {
    if (!s) return;
    atomic_store(&s->cancelled, 1);
    df_job_unref(s);
}

static void route_metrics(df_server *srv, df_http_response *resp) {
    df_queue_prune(srv);
    set_body(resp, 200, "text/plain; version=0.0.4; charset=utf-8", df_metrics_render(srv));
}

static void method_not_allowed(const char *method, const char *path, const char *allow, df_http_response *resp) {
    df_api_error e;
    char m[24], p[160];
    printable(method, m, sizeof m);
    printable(path, p, sizeof p);
    df_api_error_set(&e, 405, "invalid_request_error", "method_not_allowed", NULL,
                     "Method %s is not allowed on %s; use %s.", m, p, allow);
    set_error(resp, &e);
    resp->allow = allow;
}

static df_route_label classify(const char *path) {
    static const char models[] = "/v1/models";
    if (!strcmp(path, "/v1/chat/completions")) return DF_ROUTE_CHAT;
    if (!strcmp(path, "/v1/completions")) return DF_ROUTE_COMPLETIONS;
    if (!strcmp(path, models)) return DF_ROUTE_MODELS;
    if (!strncmp(path, models, sizeof models - 1) && path[sizeof models - 1] == '/' && path[sizeof models])
        return DF_ROUTE_MODEL;
    if (!strcmp(path, "/health")) return DF_ROUTE_HEALTH;
    if (!strcmp(path, "/metrics")) return DF_ROUTE_METRICS;
    return DF_ROUTE_OTHER;
}

/* The end line of a request that ran no generation (and its count in the metrics). /health's
 * 503 reports the server's state (loading, stopping) and is not counted as an error. */
static void log_simple(df_server *srv, const df_http_request *req, df_route_label route, const df_http_response *r,
                       const struct timespec *t0) {
    df_metrics_request(&srv->metrics, route, r->status);
    if (r->status >= 400 && !(route == DF_ROUTE_HEALTH && r->status == 503)) {
        pthread_mutex_lock(&srv->metrics.lock);
        srv->metrics.errors++;
        pthread_mutex_unlock(&srv->metrics.lock);
    }
    char m[24], path[200], client[64], note[200] = "";
    printable(req->method, m, sizeof m);
    printable(req->path, path, sizeof path);
    printable(req->client ? req->client : "-", client, sizeof client);
    if (r->status >= 400 && r->body) {
        json_t *j = json_loadb(r->body, r->body_len, 0, NULL);
        const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
        if (msg) {
            snprintf(note, sizeof note, " : ");
            printable(msg, note + 3, sizeof note - 3);
        }
        json_decref(j);
    }
    df_server_log(srv, "#%llu %s %s %s %d %.1fms%s", (unsigned long long)(atomic_fetch_add(&srv->seq, 1) + 1), client,
                  m, path, r->status, df_ms_since(t0), note);
}

/* The answer to a CORS preflight (OPTIONS) of a known route: 204, the route's methods, and the
 * request headers the browser asked for (Access-Control-Request-Headers without the whitespace
 * around it, when made only of header-name characters, commas, spaces and tabs), else
 * Authorization and Content-Type. */
static void cors_preflight(const df_http_request *req, df_route_label route, df_http_response *resp) {
    resp->status = 204;
    resp->body = calloc(1, 1);
    resp->body_len = 0;
    resp->cors_methods = route == DF_ROUTE_CHAT || route == DF_ROUTE_COMPLETIONS ? "POST, OPTIONS" : "GET, HEAD, OPTIONS";
    const char *h = req->acr_headers ? req->acr_headers : "";
    while (*h == ' ' || *h == '\t') h++; /* the list without the whitespace around it */
    size_t n = strlen(h);
    while (n > 0 && (h[n - 1] == ' ' || h[n - 1] == '\t')) n--;
    int ok = n > 0 && n < sizeof resp->cors_headers;
    for (size_t i = 0; ok && i < n; i++)
        ok = isalnum((unsigned char)h[i]) || strchr("-_,\t !#$%&'*+.^`|~", h[i]) != NULL;
    if (ok) snprintf(resp->cors_headers, sizeof resp->cors_headers, "%.*s", (int)n, h);
    else snprintf(resp->cors_headers, sizeof resp->cors_headers, "Authorization, Content-Type");
}

/* 1 when a completion body comes with a Content-Encoding (415: it is read as sent). */
static int compressed_body(const df_http_request *req) {
    return req->content_encoding && req->content_encoding[0] && strcasecmp(req->content_encoding, "identity") != 0;
}

int df_server_refuses_by_headers(df_server *srv, const df_http_request *req) {
    const char *m = req->method ? req->method : "";
    const df_route_label route = classify(req->path ? req->path : "");
    if (route == DF_ROUTE_HEALTH || (srv->cors_origin && strcmp(m, "OPTIONS") == 0 && route != DF_ROUTE_OTHER))
        return 0;
    if (!authorized(srv, req->authorization)) return 1;
    if (route != DF_ROUTE_CHAT && route != DF_ROUTE_COMPLETIONS) return 0;
    return strcmp(m, "POST") != 0 || compressed_body(req);
}

void df_server_handle(df_server *srv, const df_http_request *req, df_http_response *resp) {
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    memset(resp, 0, sizeof *resp);
    resp->content_type = "application/json";
    resp->cors_origin = srv->cors_origin;
    const char *m = req->method ? req->method : "";
    const char *path = req->path ? req->path : "";
    int get = strcmp(m, "GET") == 0 || strcmp(m, "HEAD") == 0;
    int post = strcmp(m, "POST") == 0;
    df_route_label route = classify(path);
    df_api_error e;
    /* a 405's Allow: every method the route answers (OPTIONS where CORS preflights are) */
    const char *allow_get = srv->cors_origin ? "GET, HEAD, OPTIONS" : "GET, HEAD";
    const char *allow_post = srv->cors_origin ? "POST, OPTIONS" : "POST";

    if (req->timed_out) {
        df_api_error_set(&e, 408, "invalid_request_error", "request_timeout", NULL,
                         "The request was not received within %u s.", srv->opt.request_timeout_s);
        set_error(resp, &e);
    } else if (srv->cors_origin && strcmp(m, "OPTIONS") == 0 && route != DF_ROUTE_OTHER) {
        cors_preflight(req, route, resp); /* no key: browsers send none with a preflight */
    } else if (route == DF_ROUTE_HEALTH) { /* no key needed: for load balancers and probes */
        if (!get) method_not_allowed(m, path, allow_get, resp);
        else route_health(srv, resp);
    } else if (!authorized(srv, req->authorization)) {
        df_api_error_set(&e, 401, "invalid_request_error", "invalid_api_key", NULL,
                         "Missing or incorrect API key; send 'Authorization: Bearer <key>'.");
        set_error(resp, &e);
        resp->www_authenticate = 1;
    } else if (route == DF_ROUTE_CHAT || route == DF_ROUTE_COMPLETIONS) {
        if (!post) {
            method_not_allowed(m, path, allow_post, resp);
        } else if (compressed_body(req)) {
            char enc[64];
            printable(req->content_encoding, enc, sizeof enc);
            df_api_error_set(&e, 415, "invalid_request_error", "unsupported_content_encoding", NULL,
                             "Content-Encoding '%s' is not supported: send the body uncompressed.", enc);
            set_error(resp, &e);
        } else if (atomic_load(&srv->stopping)) {
            df_api_error_set(&e, 503, "server_error", "shutting_down", NULL, "The server is shutting down.");
            set_error(resp, &e);
        } else {
            if (route_completion(srv, req, route, resp)) return; /* logged by the worker */
        }
    } else if (route == DF_ROUTE_MODELS || route == DF_ROUTE_MODEL || route == DF_ROUTE_METRICS) {
        if (!get) method_not_allowed(m, path, allow_get, resp);
        else if (route == DF_ROUTE_MODELS) route_models(srv, resp);
        else if (route == DF_ROUTE_MODEL) route_model(srv, path + sizeof "/v1/models", resp);
        else route_metrics(srv, resp);
    } else {
        char pm[24], pp[160];
        printable(m, pm, sizeof pm);
        printable(path, pp, sizeof pp);
        df_api_error_set(&e, 404, "invalid_request_error", "not_found", NULL, "Unknown route: %s %s", pm, pp);
        set_error(resp, &e);
    }
    log_simple(srv, req, route, resp, req->timed_out && req->began ? req->began : &t0);
}
