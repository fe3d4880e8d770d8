/* dflash server: the HTTP transport (libmicrohttpd, one thread per connection).
 *
 * Reads each request's body into memory up to max_body. Past the limit the rest is read
 * and dropped (so a client that sends a large body without waiting still gets its 413),
 * up to a drain limit after which the connection is answered and closed at once. A client
 * that sends "Expect: 100-continue" with a Content-Length above the limit gets its 413
 * before sending the body. Each request then goes to df_server_handle; a streamed answer is
 * a chunked response whose reader blocks (in the connection's own thread) on the stream.
 * Request headers are bounded by the connection's memory limit (max_header): larger ones
 * get 431 from libmicrohttpd. Idle connections (a slow client sending nothing) are closed
 * after timeout_s.
 */
#include "server/server_impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>

/* How long df_server_stop waits for requests in progress to be answered. */
#define STOP_GRACE_MS 10000

typedef struct conn_ctx {
    char *body;
    size_t len, cap;
    size_t received;        /* all body bytes seen, kept or not */
    int too_large;
    int timeout_off;        /* the idle timeout is suspended while the answer is produced */
    struct MHD_Connection *conn;
} conn_ctx;

/* Bytes read and dropped past max_body before the connection is closed instead. */
static size_t drain_limit(const df_server *srv) {
    size_t lim = srv->opt.max_body * 4;
    return lim < ((size_t)32 << 20) ? ((size_t)32 << 20) : lim;
}

static void client_address(struct MHD_Connection *conn, char *out, size_t cap) {
    snprintf(out, cap, "-");
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (!ci || !ci->client_addr) return;
    const struct sockaddr *sa = ci->client_addr;
    if (sa->sa_family == AF_INET)
        inet_ntop(AF_INET, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, out, (socklen_t)cap);
    else if (sa->sa_family == AF_INET6)
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, out, (socklen_t)cap);
}

/* Streamed bodies: the SSE bytes of a df_server_stream. Runs in the connection's own thread,
 * where blocking until the generator produced more is allowed. */
static ssize_t read_stream(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    size_t n = df_server_stream_read(cls, buf, max);
    return n ? (ssize_t)n : MHD_CONTENT_READER_END_OF_STREAM;
}

static void close_stream(void *cls) { df_server_stream_close(cls); }

static enum MHD_Result send_response(conn_ctx *ctx, df_http_response *r) {
    struct MHD_Response *resp;
    if (r->stream) {
        resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, read_stream, r->stream, close_stream);
        if (resp) r->stream = NULL; /* owned by MHD now: closed by close_stream */
    } else if (r->body) {
        resp = MHD_create_response_from_buffer(r->body_len, r->body, MHD_RESPMEM_MUST_FREE);
        if (resp) r->body = NULL;   /* owned by MHD now */
    } else {
        resp = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    }
    const char *ctype = r->content_type ? r->content_type : "application/json";
    int is_stream = resp && !r->body && strncmp(ctype, "text/event-stream", 17) == 0;
    df_http_response_free(r);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (is_stream) MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    if (r->allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, r->allow);
    if (r->x_dflash) MHD_add_response_header(resp, "x-dflash", r->x_dflash);
    if (r->www_authenticate) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (r->retry_after > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", r->retry_after);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, v);
    }
    enum MHD_Result ret = MHD_queue_response(ctx->conn, (unsigned)r->status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result answer(df_server *srv, conn_ctx *ctx, const char *url, const char *method) {
    char client[64];
    client_address(ctx->conn, client, sizeof client);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(ctx->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    df_http_request req = {
        .method = method,
        .path = url,
        .authorization = MHD_lookup_connection_value(ctx->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION),
        .body = ctx->body,
        .body_len = ctx->len,
        .body_too_large = ctx->too_large,
        .client_fd = ci ? ci->connect_fd : -1,
        .client = client,
    };
    /* The idle timeout guards against slow clients while a request is being read; while its
     * answer is generated (or waits in the queue) the connection is silent on purpose, so the
     * timeout is off until the request completes (on_completed turns it back on). */
    MHD_set_connection_option(ctx->conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    ctx->timeout_off = 1;
    df_http_response r;
    df_server_handle(srv, &req, &r);
    return send_response(ctx, &r);
}

static void keep_body(df_server *srv, conn_ctx *ctx, const char *data, size_t n) {
    ctx->received += n;
    if (ctx->too_large) return;
    if (n > srv->opt.max_body - ctx->len) {
        ctx->too_large = 1;
        free(ctx->body);
        ctx->body = NULL;
        ctx->len = ctx->cap = 0;
        return;
    }
    if (ctx->len + n > ctx->cap) {
        size_t cap = ctx->cap ? ctx->cap : 4096;
        while (cap < ctx->len + n) cap *= 2;
        if (cap > srv->opt.max_body) cap = srv->opt.max_body;
        char *p = realloc(ctx->body, cap);
        if (!p) {   /* answered as too large: the client can retry smaller */
            ctx->too_large = 1;
            free(ctx->body);
            ctx->body = NULL;
            ctx->len = ctx->cap = 0;
            return;
        }
        ctx->body = p;
        ctx->cap = cap;
    }
    memcpy(ctx->body + ctx->len, data, n);
    ctx->len += n;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
    (void)version;
    df_server *srv = cls;
    conn_ctx *ctx = *con_cls;
    if (!ctx) {
        ctx = calloc(1, sizeof *ctx);
        if (!ctx) return MHD_NO;
        ctx->conn = conn;
        atomic_fetch_add(&srv->in_flight, 1);
        *con_cls = ctx;
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(cl, &end, 10);
            if (errno == 0 && end != cl && n > srv->opt.max_body) {
                ctx->too_large = 1;
                const char *expect = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
                if ((expect && strcasecmp(expect, "100-continue") == 0) || n > drain_limit(srv))
                    return answer(srv, ctx, url, method);
            }
        }
        return MHD_YES;
    }
    if (*upload_data_size) {
        keep_body(srv, ctx, upload_data, *upload_data_size);
        *upload_data_size = 0;
        if (ctx->too_large && ctx->received > drain_limit(srv)) return answer(srv, ctx, url, method);
        return MHD_YES;
    }
    return answer(srv, ctx, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    df_server *srv = cls;
    conn_ctx *ctx = *con_cls;
    if (ctx) {
        if (ctx->timeout_off && toe == MHD_REQUEST_TERMINATED_COMPLETED_OK)
            MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, srv->opt.timeout_s);
        atomic_fetch_sub(&srv->in_flight, 1);
        free(ctx->body);
        free(ctx);
    }
    *con_cls = NULL;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
    df_server_log(cls, "http: %s", line);
}

/* A listening socket for host:port (the first address that binds). */
static int open_listener(const df_server *srv, int *family, int *port, df_error *err) {
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", srv->opt.port);
    int rc = getaddrinfo(srv->host, portstr, &hints, &ai);
    if (rc != 0) {
        df_error_set(err, DF_ERR_INVALID_ARG, "server: cannot resolve host '%s': %s", srv->host, gai_strerror(rc));
        return -1;
    }
    int fd = -1, last_errno = 0;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
            last_errno = errno;
            close(fd);
            fd = -1;
            continue;
        }
        *family = a->ai_family;
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        *port = srv->opt.port;
        if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
            *port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                   : ((struct sockaddr_in *)&ss)->sin_port);
    }
    freeaddrinfo(ai);
    if (fd < 0)
        df_error_set(err, DF_ERR_IO, "server: cannot listen on %s:%d: %s", srv->host, srv->opt.port,
                     strerror(last_errno));
    return fd;
}

df_status df_server_listen(df_server *srv, df_error *err) {
    if (srv->daemon) return df_error_set(err, DF_ERR_INVALID_ARG, "server: already listening");
    int family = AF_INET, port = 0;
    int fd = open_listener(srv, &family, &port, err);
    if (fd < 0) return err ? err->code : DF_ERR_IO;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                     MHD_USE_ITC | MHD_USE_ERROR_LOG;
    if (family == AF_INET6) flags |= MHD_USE_IPv6;
    atomic_store(&srv->stopping, 0);
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, (uint16_t)port, NULL, NULL, on_request, srv, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, srv,
        MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_CONNECTION_LIMIT, srv->opt.max_connections,
        MHD_OPTION_CONNECTION_TIMEOUT, srv->opt.timeout_s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, srv->opt.max_header, MHD_OPTION_END);
    if (!d) {
        close(fd);
        return df_error_set(err, DF_ERR_IO, "server: cannot start the HTTP daemon on %s:%d", srv->host, port);
    }
    srv->daemon = d;
    srv->bound_port = port;
    /* the socket is up: load the model and serve the queue in the background */
    if (pthread_create(&srv->worker, NULL, df_worker_main, srv) != 0) {
        MHD_stop_daemon(d);
        srv->daemon = NULL;
        return df_error_set(err, DF_ERR_NOMEM, "server: cannot start the generation thread");
    }
    srv->worker_started = 1;
    return DF_OK;
}

/* Graceful stop: no new connections; a generation in progress is cancelled and, like every
 * request already begun, gets its answer (up to a grace period); then connections close. */
void df_server_stop(df_server *srv) {
    if (!srv || !srv->daemon) return;
    atomic_store(&srv->stopping, 1);   /* cancels a generation in progress; new requests get 503 */
    MHD_socket listener = MHD_quiesce_daemon(srv->daemon);
    if (srv->worker_started) {         /* waiting requests are answered 503; the running one stops */
        pthread_mutex_lock(&srv->qlock);
        pthread_cond_broadcast(&srv->qcond);
        pthread_mutex_unlock(&srv->qlock);
        pthread_join(srv->worker, NULL);
        srv->worker_started = 0;
    }
    for (int waited_ms = 0; atomic_load(&srv->in_flight) > 0 && waited_ms < STOP_GRACE_MS; waited_ms += 10) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    MHD_stop_daemon(srv->daemon);      /* closes connections, joins their threads */
    if (listener != MHD_INVALID_SOCKET) close(listener);
    srv->daemon = NULL;
}
