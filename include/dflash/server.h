/* dflash: the OpenAI-compatible HTTP server.
 *
 * Two layers:
 * - df_server_handle: the API itself, transport-free. It takes one whole HTTP request
 *   (method, path, Authorization header, body) and produces the status, the JSON body and
 *   the headers of the answer. Every route, validation rule and error object lives here, so
 *   it can be driven directly (tests, fuzzing) without a socket.
 * - df_server_listen / df_server_stop: a libmicrohttpd daemon (one thread per connection)
 *   that reads requests (bodies bounded by max_body), calls df_server_handle and logs one
 *   line per request.
 *
 * Routes: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions
 * (non-streaming). Responses and errors follow the OpenAI shapes; errors are
 * {"error": {"message", "type", "code", "param"}} with 400 (invalid request), 401 (API
 * key), 404 (unknown route or model), 405 (wrong method), 413 (body above max_body),
 * 500 (engine failure), 503 (shutting down).
 *
 * Generation runs one request at a time on a single session behind a mutex; other
 * requests wait. Messages are rendered with plain ChatML framing, thinking off
 * (df_chatml_render). Sampling fields a request omits take the pack's
 * generation_config.json defaults.
 *
 * Privacy: responses never contain a local path; engine messages that reach a response or
 * the log have the pack folder replaced by the model id and $HOME / the working directory by
 * "~" / ".".
 *
 * Thread safety: df_server_handle may be called from several threads at once. The library
 * never prints and never exits; log lines go to the caller's callback.
 */
#ifndef DFLASH_SERVER_H
#define DFLASH_SERVER_H

#include <stddef.h>

#include "dflash/engine.h"
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

typedef struct df_server_options {
    const char *host;         /* address to listen on (numeric or a name); default 127.0.0.1 */
    int port;                 /* TCP port; 0 = one chosen by the system (see df_server_port) */
    const char *model_id;     /* public model name (required, non-empty) */
    const char *api_key;      /* Bearer key; NULL or "" = none, allowed only on a loopback host */
    int ctx_size;             /* positions of the session; 0 = the pack's (df_session_init) */
    int max_tokens;           /* default and upper bound of completion tokens per request;
                                 0 = until the context is full */
    size_t max_body;          /* request body limit in bytes (413 above); 0 = 8 MiB */
    unsigned max_connections; /* concurrent connections; 0 = 64 */
    unsigned timeout_s;       /* idle connection timeout in seconds; 0 = 60 */
    df_server_log_fn log;     /* NULL = no log */
    void *log_user;
} df_server_options;

df_server_options df_server_options_default(void);

/* 1 if host names a loopback address ("localhost", 127.0.0.0/8, ::1). */
int df_server_host_is_loopback(const char *host);

/* Creates a server for eng (not yet listening) with its own session of opt->ctx_size
 * positions. eng must outlive the server. Errors: DF_ERR_INVALID_ARG (no model id, a
 * non-loopback host without an API key, bad limits), errors of df_session_init. */
df_status df_server_init(df_server **out, df_engine *eng, const df_server_options *opt, df_error *err);

/* Starts listening on opt->host:opt->port in background threads and returns.
 * Errors: DF_ERR_INVALID_ARG (the host does not resolve), DF_ERR_IO (the address cannot
 * be bound). */
df_status df_server_listen(df_server *srv, df_error *err);

/* The port actually bound (after df_server_listen), else the configured one. */
int df_server_port(const df_server *srv);

/* Stops gracefully: no new connections are accepted, a generation in progress is cancelled
 * and every request already begun gets its answer (503 for cancelled ones) within a grace
 * period of 10 s; then open connections are closed and their threads joined. Safe to call
 * twice or when not listening. */
void df_server_stop(df_server *srv);

/* Stops (df_server_stop) and frees. NULL is fine. */
void df_server_free(df_server *srv);

/* One whole HTTP request, as the transport read it. */
typedef struct df_http_request {
    const char *method;          /* "GET", "POST", ... */
    const char *path;            /* URL path, without the query string */
    const char *authorization;   /* value of the Authorization header, or NULL */
    const char *body;            /* may be NULL when body_len is 0; need not be NUL-terminated */
    size_t body_len;
    int body_too_large;          /* the transport stopped keeping the body past max_body */
    /* Polled during generation; non-zero = the client went away (generation stops). */
    int (*client_gone)(void *user);
    void *client_user;
} df_http_request;

/* The answer. Free with df_http_response_free. */
typedef struct df_http_response {
    int status;                  /* HTTP status */
    char *body;                  /* malloc'd JSON text (NUL-terminated), body_len bytes;
                                    NULL only when out of memory */
    size_t body_len;
    const char *content_type;    /* static string */
    const char *allow;           /* for 405: the allowed methods (static), else NULL */
    const char *x_dflash;        /* decode mode header value (static), or NULL */
    int www_authenticate;        /* 401: send WWW-Authenticate: Bearer */
    /* for the log line */
    int prompt_tokens;           /* -1 when no generation ran */
    int completion_tokens;
    const char *finish;          /* "stop", "length", ... or NULL */
    double gen_ms;               /* prefill + decode wall time */
    char note[160];              /* short reason for an error status (already redacted) */
} df_http_response;

/* Answers one request. Never fails: every problem becomes an error response (status 500
 * when out of memory). */
void df_server_handle(df_server *srv, const df_http_request *req, df_http_response *resp);
void df_http_response_free(df_http_response *resp);

#ifdef __cplusplus
}
#endif
#endif
