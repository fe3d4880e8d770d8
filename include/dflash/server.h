/* dflash: the OpenAI-compatible HTTP server.
 *
 * Layers:
 * - df_server_handle: the API itself, transport-free. It takes one whole HTTP request
 *   (method, path, Authorization header, body) and produces the status, headers and either
 *   the JSON body or, for "stream": true, a stream of Server-Sent Events read with
 *   df_server_stream_read. Every route, validation rule and error object lives here, so it can
 *   be driven directly (tests, fuzzing) without a socket.
 * - df_server_listen / df_server_stop: a libmicrohttpd daemon (one thread per connection)
 *   that reads requests (bodies bounded by max_body, headers by max_header) and writes the
 *   answers.
 *
 * Model: df_server_listen binds the socket first, then loads the pack (and the drafter, the
 * chat template) in the background: until it is ready GET /health answers 503
 * {"status": "loading"} and completion routes 503 with Retry-After. df_server_state tells
 * the caller when loading failed.
 *
 * Routes: GET /health, GET /metrics (Prometheus text), GET /v1/models, GET /v1/models/{id},
 * POST /v1/chat/completions, POST /v1/completions (both streaming and not). Errors are OpenAI
 * error objects {"error": {"message", "type", "code", "param"}}: 400 (invalid request, or
 * exceed_context_size_error with n_prompt_tokens and n_ctx), 401 (API key), 404 (unknown
 * route or model), 405 (wrong method), 408 (request not received within request_timeout_s),
 * 413 (body above max_body), 500 (engine failure), 503
 * (loading, queue full, shutting down; with Retry-After).
 *
 * Generation: one request at a time on a single session, fed by a bounded FIFO queue of
 * waiting requests (opt.queue; a request finding it full gets 503). Chat prompts are rendered
 * with the pack's chat template (a built-in ChatML one when the pack has none); text from the
 * request never becomes a special token. Greedy requests (temperature 0, no logit
 * processors, no logprobs) are decoded speculatively when a drafter is loaded; the others run
 * plain. Each answer says which in the x-dflash header ("speculative" or "fallback;
 * reason=<no-drafter|disabled|sampled|logprobs|penalties|logit_bias|forced>").
 *
 * Privacy: responses and log lines never contain a local path: the pack and drafter folders
 * are replaced by the model id / "drafter", $HOME / the working directory by "~" / ".".
 *
 * Thread safety: df_server_handle may be called from several threads at once. The library
 * never prints and never exits; log lines go to the caller's callback.
 */
#ifndef DFLASH_SERVER_H
#define DFLASH_SERVER_H

#include <stddef.h>
#include <sys/types.h>

#include "dflash/speculative.h"
#include "dflash/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct df_server df_server;

/* Receives one log line (no trailing newline). Called from any server thread, possibly
 * concurrently: the callback must be thread-safe. */
typedef void (*df_server_log_fn)(void *user, const char *line);

#define DF_SERVER_DEFAULT_HOST "127.0.0.1"
#define DF_SERVER_DEFAULT_PORT 8080
#define DF_SERVER_DEFAULT_MAX_BODY ((size_t)8 << 20)
#define DF_SERVER_DEFAULT_MAX_HEADER ((size_t)32 << 10)
#define DF_SERVER_DEFAULT_QUEUE 16
#define DF_SERVER_DEFAULT_DRAFT_WINDOW 2048

typedef struct df_server_options {
    const char *host;         /* address to listen on (numeric or a name); default 127.0.0.1 */
    int port;                 /* TCP port; 0 = one chosen by the system (see df_server_port) */
    const char *model_id;     /* public model name (required, non-empty) */
    const char *api_key;      /* Bearer key; NULL or "" = none, allowed only on a loopback host */
    const char *model_dir;    /* the pack folder (required), loaded by df_server_listen */
    int n_threads;            /* compute threads; 0 = all CPUs */
    const char *device;       /* compute backend: NULL/"cpu" or "cuda" */
    int ctx_size;             /* positions of the session; 0 = the pack's (df_session_init) */
    int max_tokens;           /* default and upper bound of completion tokens per request;
                                 0 = until the context is full */
    int enable_thinking;      /* thinking for chat requests that do not say: 0 off, 1 on */
    int top_logprobs_k;       /* largest top_logprobs a request may ask for (0..20) */
    int queue;                /* requests that may wait while one generates (>= 0) */
    /* speculative decoding */
    const char *drafter_dir;  /* DFlash drafter folder, or NULL for none */
    df_spec_params spec;      /* block size (0 = the drafter's), adaptive range */
    int draft_window;         /* drafter context positions kept (>= 1) */
    int draft_quant;          /* 0, or 4 / 8: the drafter's weights quantized at load */
    int no_draft;             /* load the drafter but decode every request plain */
    /* transport limits */
    size_t max_body;          /* request body limit in bytes (413 above); 0 = 8 MiB */
    size_t max_header;        /* memory for the request line and headers; 0 = 32 KiB */
    unsigned max_connections; /* concurrent connections; 0 = 64 */
    unsigned timeout_s;       /* idle connection timeout in seconds; 0 = 30 */
    unsigned request_timeout_s; /* longest time a client may take to send one whole request
                                 * (request line, headers and body), counted from the
                                 * connection's opening or the end of its previous answer:
                                 * past it a body still arriving gets 408 and the connection
                                 * is closed, headers still arriving close it; 0 = 60 */
    /* testing only: honour the request field "dflash_forced_output" (a text whose tokens
     * replace the sampled ones; the model still runs). Never enable on a real deployment. */
    int test_hooks;
    /* cross-origin requests (CORS): the Access-Control-Allow-Origin of every answer, and
     * OPTIONS preflights of the API's routes answered 204 (no key needed); "*" (the default)
     * = any origin; NULL or "" = none (no CORS headers; OPTIONS is a method the routes do not
     * take). Otherwise df_server_cors_origin_valid must accept it. */
    const char *cors_origin;
    df_server_log_fn log;     /* NULL = no log */
    void *log_user;
} df_server_options;

df_server_options df_server_options_default(void);

/* 1 if origin can be df_server_options.cors_origin: "*", "null", or one origin as browsers send
 * it, scheme://host[:port] (no path, no list, no spaces; host a name, IPv4 or [IPv6]), at most
 * 255 characters. */
int df_server_cors_origin_valid(const char *origin);

/* 1 when id can be the served model id: non-empty UTF-8 text without control characters (it
 * goes into every JSON answer and log line); df_server_init refuses any other. */
int df_server_model_id_valid(const char *id);

/* 1 if host names a loopback address ("localhost", 127.0.0.0/8, ::1). */
int df_server_host_is_loopback(const char *host);

/* Creates a server (not yet listening; nothing loaded). Errors: DF_ERR_INVALID_ARG (no model
 * id or folder, a non-loopback host without an API key, bad limits), DF_ERR_NOMEM. */
df_status df_server_init(df_server **out, const df_server_options *opt, df_error *err);

/* Binds opt->host:opt->port, starts answering in background threads, and starts loading the
 * model in the background; returns at once. Errors: DF_ERR_INVALID_ARG (the host does not
 * resolve), DF_ERR_IO (the address cannot be bound). */
df_status df_server_listen(df_server *srv, df_error *err);

typedef enum df_server_state {
    DF_SERVER_LOADING = 0,
    DF_SERVER_READY,
    DF_SERVER_FAILED     /* loading failed: df_server_load_error says why */
} df_server_state;

df_server_state df_server_get_state(const df_server *srv);
/* The loading error with the model and drafter paths replaced by their public names (what
 * HTTP clients see), or "" when none. */
const char *df_server_load_error(const df_server *srv);
/* The same error with the paths as given (for the operator: the command line, stderr). */
const char *df_server_load_error_full(const df_server *srv);

/* The port actually bound (after df_server_listen), else the configured one. */
int df_server_port(const df_server *srv);

/* Stops gracefully: no new connections are accepted; the generation in progress is
 * cancelled within one decoding round (or one prefill chunk of 16 prompt tokens while its
 * prompt is processed), waiting requests are answered 503, and every request
 * already received gets its answer within a grace period of 10 s (one whose body is still
 * arriving is closed at once: it can no longer be answered); then open connections are
 * closed and their threads joined. Safe to call twice or when not listening. */
void df_server_stop(df_server *srv);

/* Stops (df_server_stop) and frees. NULL is fine. */
void df_server_free(df_server *srv);

/* One whole HTTP request, as the transport read it. */
typedef struct df_http_request {
    const char *method;          /* "GET", "POST", ... */
    const char *path;            /* URL path, without the query string */
    const char *authorization;   /* value of the Authorization header, or NULL */
    const char *content_encoding; /* value of the Content-Encoding header, or NULL */
    const char *acr_headers;     /* value of Access-Control-Request-Headers (a preflight), or NULL */
    const char *body;            /* may be NULL when body_len is 0; need not be NUL-terminated */
    size_t body_len;
    int body_too_large;          /* the transport stopped keeping the body past max_body */
    int timed_out;               /* the transport gave up reading it: the client took longer
                                    than request_timeout_s (answered 408) */
    int client_fd;               /* the client's socket, polled for hang-ups (the server
                                    dup()s it while generating); -1 = none */
    const char *client;          /* client address for the log, or NULL */
    const struct timespec *began; /* CLOCK_MONOTONIC time its deadline started (the connection's
                                    opening or the end of its previous answer), from which the
                                    log times a timed-out request; NULL = when handled */
} df_http_request;

/* A streamed answer (Server-Sent Events). */
typedef struct df_server_stream df_server_stream;

/* The answer. Free with df_http_response_free. */
typedef struct df_http_response {
    int status;                  /* HTTP status */
    char *body;                  /* malloc'd text (NUL-terminated), body_len bytes; NULL for a
                                    stream (or when out of memory) */
    size_t body_len;
    df_server_stream *stream;    /* non-NULL: the body is read with df_server_stream_read and
                                    the stream must be closed with df_server_stream_close */
    const char *content_type;    /* static string */
    const char *allow;           /* for 405: the allowed methods (static), else NULL */
    const char *x_dflash;        /* decode mode header value (static), or NULL */
    int retry_after;             /* > 0: send Retry-After (seconds) */
    int www_authenticate;        /* 401: send WWW-Authenticate: Bearer */
    const char *cors_origin;     /* send Access-Control-Allow-Origin with this value, or NULL */
    const char *cors_methods;    /* a preflight's answer: Access-Control-Allow-Methods (static), with
                                    cors_headers as Access-Control-Allow-Headers and a Max-Age */
    char cors_headers[1024];
    int no_answer;               /* the client closed the connection (status 499, logged as such):
                                    send nothing, close the connection */
} df_http_response;

/* Answers one request; for a non-streamed completion this blocks until it is generated.
 * Never fails: every problem becomes an error response (status 500 when out of memory), except
 * that a completion whose client closed the connection gets none (resp->no_answer).
 * One log line per request: at the end (and one more on arrival for completions). */
void df_server_handle(df_server *srv, const df_http_request *req, df_http_response *resp);
void df_http_response_free(df_http_response *resp);

/* 1 when df_server_handle refuses req by its method, path and headers alone (401 without the
 * right key, 405 for a completion route's wrong method, 415 for a completion body with a
 * Content-Encoding), whatever its body: a transport may answer it before the body (without
 * "100 Continue"). 0 otherwise (the body decides). */
int df_server_refuses_by_headers(df_server *srv, const df_http_request *req);

/* Copies up to cap bytes of the stream into buf, waiting until some are ready. Returns the
 * number of bytes (> 0), or 0 at the end of the stream. */
size_t df_server_stream_read(df_server_stream *s, char *buf, size_t cap);
/* Ends a stream: a generation still running for it is cancelled (the client went away).
 * Logs the request's end line. */
void df_server_stream_close(df_server_stream *s);

#ifdef __cplusplus
}
#endif
#endif
