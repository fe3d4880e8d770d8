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
 * after timeout_s. A client that keeps sending, but too slowly, has request_timeout_s to
 * deliver a whole request, counted from the connection's opening (or the end of its previous
 * answer): a body still arriving past that gets 408 (checked as its bytes come in, and the
 * connection is closed with the answer); headers still arriving past it (libmicrohttpd calls
 * nothing before they are complete) are cut off by a watch thread that shuts the socket down,
 * and so is a kept-alive connection that stays idle that long after its previous answer. A body
 * that stops arriving altogether (no bytes, so nothing is called) is answered 408 by the watch
 * thread, which then shuts the socket down.
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
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

/* How long df_server_stop waits for requests in progress to be answered. */
#define STOP_GRACE_MS 10000

/* Set by answer_timed_out_body in the connection's thread: libmicrohttpd's next log line
 * there ("Application reported internal error") is that deliberate close, not an error. */
static _Thread_local int g_closing_on_purpose;

typedef struct conn_ctx {
    char *body;
    size_t len, cap;
    size_t received;        /* all body bytes seen, kept or not */
    int too_large;
    int timed_out;          /* the request was not received within request_timeout_s */
    struct timespec since;    /* when request_timeout_s started for this request */
    struct timespec deadline; /* when request_timeout_s runs out for this request */
    int timeout_off;        /* the idle timeout is suspended while the answer is produced */
    struct MHD_Connection *conn;
} conn_ctx;

/* ---- request deadlines ----------------------------------------------------------------- */

/* One connection, from its opening to its close (libmicrohttpd's socket context), on the
 * watch list while it is open. */
typedef struct sock_ctx {
    struct sock_ctx *prev, *next;
    int fd;
    struct timespec since;  /* the connection's opening, or the end of its previous answer */
    int in_request;         /* a request's headers are in: its body and answer are the handler's */
    int answering;          /* the connection's thread answers the request (claim_answer) */
    int shut;               /* the watch shut it down */
    unsigned long answers;  /* requests answered on the connection so far */
    /* the request in progress, for the watch's 408 */
    char method[16], path[256], client[64];
} sock_ctx;

typedef struct conn_watch {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    sock_ctx *head;
    int stop;
    int quiet_reads;        /* libmicrohttpd's read errors still to come from stalled bodies shut down */
    pthread_t thread;
} conn_watch;

static struct timespec deadline_after(const struct timespec *t0, unsigned s) {
    struct timespec d = *t0;
    d.tv_sec += (time_t)s;
    return d;
}

static int passed(const struct timespec *deadline) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec > deadline->tv_sec || (now.tv_sec == deadline->tv_sec && now.tv_nsec >= deadline->tv_nsec);
}

static void send_all(int fd, const char *p, size_t n);

/* The CORS headers of answer r (df_http_response.cors_origin, cors_methods): up to 6 name/value
 * pairs into name, value; returns how many. The one list for both ways an answer is sent. */
static int cors_header_list(const df_http_response *r, const char *name[6], const char *value[6]) {
    int n = 0;
    if (r->cors_origin) {
        name[n] = "Access-Control-Allow-Origin", value[n++] = r->cors_origin;
        if (strcmp(r->cors_origin, "*") != 0) name[n] = "Vary", value[n++] = "Origin";
        /* the answer headers a script on another origin may read */
        name[n] = "Access-Control-Expose-Headers", value[n++] = "x-dflash, Retry-After";
    }
    if (r->cors_methods) {
        name[n] = "Access-Control-Allow-Methods", value[n++] = r->cors_methods;
        name[n] = "Access-Control-Allow-Headers", value[n++] = r->cors_headers;
        name[n] = "Access-Control-Max-Age", value[n++] = "86400";
    }
    return n;
}

/* Writes the 408 answer r (no more than that: the connection closes after it) to socket fd. */
static void send_timeout_answer(int fd, const df_http_response *r) {
    char head[2048], cors[1536] = "";
    const char *name[6], *value[6];
    size_t cn = 0;
    for (int i = 0, n = cors_header_list(r, name, value); i < n && cn < sizeof cors; i++) {
        const int k = snprintf(cors + cn, sizeof cors - cn, "%s: %s\r\n", name[i], value[i]);
        if (k < 0) return;
        cn += (size_t)k;
    }
    if (cn >= sizeof cors) return;
    int hn = snprintf(head, sizeof head,
                      "HTTP/1.1 %d Request Timeout\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                      "Connection: close\r\n\r\n",
                      r->status, r->content_type ? r->content_type : "application/json", r->body_len, cors);
    if (hn < 0 || (size_t)hn >= sizeof head) return;
    send_all(fd, head, (size_t)hn);
    send_all(fd, r->body, r->body_len);
}

/* The watch's answer to c's request, whose body stopped arriving before its deadline: 408
 * (logged as every answer is), then the socket is shut down. Called with the list lock held
 * (the descriptor is still c's own), after the connection's thread had not claimed the answer
 * (that thread, blocked reading the body, writes nothing meanwhile; claim_answer then fails). */
static void answer_stalled_body(df_server *srv, sock_ctx *c) {
    df_http_request req = {
        .method = c->method, .path = c->path, .timed_out = 1, .client_fd = -1, .client = c->client, .began = &c->since};
    df_http_response r;
    df_server_handle(srv, &req, &r);
    if (r.body) send_timeout_answer(c->fd, &r);
    df_http_response_free(&r);
    shutdown(c->fd, SHUT_RDWR);
}

/* The watch thread: every quarter second, shuts down the connections whose request is not in
 * past request_timeout_s: those still waiting for a request's headers, kept-alive ones idle
 * since their previous answer (libmicrohttpd then closes them as if the client had), and those
 * whose body stopped arriving (answered 408 first). The list lock is held while shutting a
 * socket down, and a connection leaves the list (on_connection, "closed") before libmicrohttpd
 * closes its socket, so the descriptor is still the connection's own. */
static void *watch_main(void *arg) {
    df_server *srv = arg;
    conn_watch *w = srv->watch;
    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        int fresh = 0, kept = 0, body = 0;
        for (sock_ctx *c = w->head; c; c = c->next) {
            struct timespec d = deadline_after(&c->since, srv->opt.request_timeout_s);
            if (c->shut || c->answering || !passed(&d)) continue;
            if (c->in_request) {
                answer_stalled_body(srv, c);
                w->quiet_reads++;
                body++;
            } else {
                shutdown(c->fd, SHUT_RDWR);
                if (c->answers) kept++;
                else fresh++;
            }
            c->shut = 1;
        }
        pthread_mutex_unlock(&w->lock);
        const unsigned rt = srv->opt.request_timeout_s;
        if (fresh)
            df_server_log(srv, "http: closed %d connection%s that sent no complete request headers within %u s", fresh,
                          fresh > 1 ? "s" : "", rt);
        if (kept)
            df_server_log(srv,
                          "http: closed %d kept-alive connection%s with no complete new request (idle, or headers "
                          "incomplete) within %u s of the previous answer",
                          kept, kept > 1 ? "s" : "", rt);
        if (body)
            df_server_log(srv, "http: answered 408 and closed %d connection%s whose request body was incomplete after %u s",
                          body, body > 1 ? "s" : "", rt);
        pthread_mutex_lock(&w->lock);
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 250 * 1000 * 1000;
        if (t.tv_nsec >= 1000 * 1000 * 1000) {
            t.tv_sec++;
            t.tv_nsec -= 1000 * 1000 * 1000;
        }
        if (!w->stop) pthread_cond_timedwait(&w->cond, &w->lock, &t);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    df_server *srv = cls;
    conn_watch *w = srv->watch;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        sock_ctx *c = ci ? calloc(1, sizeof *c) : NULL;
        if (!c) return; /* not watched: the idle timeout still applies */
        c->fd = ci->connect_fd;
        clock_gettime(CLOCK_MONOTONIC, &c->since);
        pthread_mutex_lock(&w->lock);
        c->next = w->head;
        if (w->head) w->head->prev = c;
        w->head = c;
        pthread_mutex_unlock(&w->lock);
        *socket_context = c;
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED && *socket_context) {
        sock_ctx *c = *socket_context;
        pthread_mutex_lock(&w->lock);
        if (c->prev) c->prev->next = c->next;
        else w->head = c->next;
        if (c->next) c->next->prev = c->prev;
        pthread_mutex_unlock(&w->lock);
        free(c);
        *socket_context = NULL;
    }
}

static sock_ctx *sock_of(struct MHD_Connection *conn) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

static void client_address(struct MHD_Connection *conn, char *out, size_t cap);

/* A request's headers are in: its deadline (request_timeout_s after the connection's opening
 * or previous answer) is the handler's to check as body bytes come in, and the watch's while
 * none do. */
static void request_begins(df_server *srv, conn_ctx *ctx, const char *url, const char *method) {
    conn_watch *w = srv->watch;
    sock_ctx *c = sock_of(ctx->conn);
    struct timespec since;
    clock_gettime(CLOCK_MONOTONIC, &since);
    if (c) {
        char client[64];
        client_address(ctx->conn, client, sizeof client);
        pthread_mutex_lock(&w->lock);
        c->in_request = 1;
        c->answering = 0;
        snprintf(c->method, sizeof c->method, "%s", method ? method : "");
        snprintf(c->path, sizeof c->path, "%s", url ? url : "");
        memcpy(c->client, client, sizeof c->client);
        since = c->since;
        pthread_mutex_unlock(&w->lock);
    }
    ctx->since = since;
    ctx->deadline = deadline_after(&since, srv->opt.request_timeout_s);
}

/* The connection's thread is about to answer the request: 1, or 0 when the watch answered it
 * already (the connection is then to be closed: MHD_NO). */
static int claim_answer(df_server *srv, conn_ctx *ctx) {
    conn_watch *w = srv->watch;
    sock_ctx *c = sock_of(ctx->conn);
    if (!c) return 1;
    pthread_mutex_lock(&w->lock);
    int ok = !c->shut;
    if (ok) c->answering = 1;
    pthread_mutex_unlock(&w->lock);
    if (!ok) g_closing_on_purpose = 1;
    return ok;
}

/* The answer is over: the next request on the connection has request_timeout_s from now. */
static void request_ends(df_server *srv, struct MHD_Connection *conn) {
    conn_watch *w = srv->watch;
    sock_ctx *c = sock_of(conn);
    if (!c) return;
    pthread_mutex_lock(&w->lock);
    c->in_request = 0;
    c->answering = 0;
    c->answers++;
    clock_gettime(CLOCK_MONOTONIC, &c->since);
    pthread_mutex_unlock(&w->lock);
}

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
    if (r->no_answer) { /* the client went away: the connection closes with nothing sent */
        df_http_response_free(r);
        g_closing_on_purpose = 1;
        return MHD_NO;
    }
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
    if (r->status != 204) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (is_stream) MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    if (r->allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, r->allow);
    if (r->x_dflash) MHD_add_response_header(resp, "x-dflash", r->x_dflash);
    if (r->www_authenticate) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    const char *cname[6], *cvalue[6];
    for (int i = 0, n = cors_header_list(r, cname, cvalue); i < n; i++) MHD_add_response_header(resp, cname[i], cvalue[i]);
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
    if (!claim_answer(srv, ctx)) return MHD_NO;
    char client[64];
    client_address(ctx->conn, client, sizeof client);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(ctx->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    df_http_request req = {
        .method = method,
        .path = url,
        .authorization = MHD_lookup_connection_value(ctx->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION),
        .content_encoding = MHD_lookup_connection_value(ctx->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_ENCODING),
        .acr_headers = MHD_lookup_connection_value(ctx->conn, MHD_HEADER_KIND, "Access-Control-Request-Headers"),
        .body = ctx->body,
        .body_len = ctx->len,
        .body_too_large = ctx->too_large,
        .timed_out = ctx->timed_out,
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

/* Writes n bytes to the (non-blocking) socket fd, waiting up to a second in all for room. */
static void send_all(int fd, const char *p, size_t n) {
    for (int waited_ms = 0; n > 0 && waited_ms < 1000;) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
        } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            poll(&pf, 1, 50);
            waited_ms += 50;
        } else {
            return;
        }
    }
}

/* The 408 of a request whose body is still arriving past its deadline. libmicrohttpd (0.9)
 * queues no answer in the middle of a body, so it is written to the socket here (this is the
 * connection's own thread, and nothing was sent for this request yet) with "Connection:
 * close"; the socket's write side is shut and what the client still sends is read and dropped
 * for a moment (so that closing it does not reset the connection before the client reads the
 * answer); MHD_NO then closes the connection. */
static enum MHD_Result answer_timed_out_body(df_server *srv, conn_ctx *ctx, const char *url, const char *method) {
    if (!claim_answer(srv, ctx)) return MHD_NO;
    ctx->timed_out = 1;
    char client[64];
    client_address(ctx->conn, client, sizeof client);
    df_http_request req = {
        .method = method, .path = url, .timed_out = 1, .client_fd = -1, .client = client, .began = &ctx->since};
    df_http_response r;
    df_server_handle(srv, &req, &r);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(ctx->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci && r.body) {
        const int fd = ci->connect_fd;
        send_timeout_answer(fd, &r);
        shutdown(fd, SHUT_WR);
        char sink[4096];
        for (int waited_ms = 0; waited_ms < 500; waited_ms += 50) {
            struct pollfd pf = {.fd = fd, .events = POLLIN};
            if (poll(&pf, 1, 50) > 0 && recv(fd, sink, sizeof sink, 0) <= 0) break; /* the client closed */
        }
    }
    df_http_response_free(&r);
    g_closing_on_purpose = 1;
    return MHD_NO;
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

/* The path of a request target: an absolute-form target ("http://host/path", which HTTP/1.1
 * servers must accept, RFC 9112 §3.2.2) is taken as its path, "/" where it has none. */
static const char *origin_form(const char *url) {
    const char *p = NULL;
    if (!strncasecmp(url, "http://", 7)) p = url + 7;
    else if (!strncasecmp(url, "https://", 8)) p = url + 8;
    if (!p) return url;
    const char *slash = strchr(p, '/');
    return slash ? slash : "/";
}

static int hex_digit(char c) {
    return c >= '0' && c <= '9' ? c - '0' : (c >= 'a' && c <= 'f' ? c - 'a' + 10 : (c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1));
}

/* libmicrohttpd's unescaping of paths and query arguments (%HH), but for %00 and %2F, which stay
 * as they are: a NUL would cut the path short ("/v1/models/demo%00x" read as "/v1/models/demo"),
 * and an escaped slash is data, not a separator ("/v1%2Fmodels" is no route; a model id with a
 * slash is decoded by its route). */
static size_t unescape_keeping_nul_and_slash(void *cls, struct MHD_Connection *conn, char *s) {
    (void)cls;
    (void)conn;
    char *w = s;
    for (const char *r = s; *r;) {
        const int hi = r[0] == '%' ? hex_digit(r[1]) : -1, lo = hi >= 0 ? hex_digit(r[2]) : -1;
        if (lo >= 0 && (hi | lo) != 0 && !(hi == 2 && lo == 15)) {
            *w++ = (char)(hi * 16 + lo);
            r += 3;
        } else {
            *w++ = *r++;
        }
    }
    *w = 0;
    return (size_t)(w - s);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
    (void)version;
    df_server *srv = cls;
    url = origin_form(url);
    conn_ctx *ctx = *con_cls;
    if (!ctx) {
        ctx = calloc(1, sizeof *ctx);
        if (!ctx) return MHD_NO;
        ctx->conn = conn;
        atomic_fetch_add(&srv->in_flight, 1);
        *con_cls = ctx;
        request_begins(srv, ctx, url, method);
        if (passed(&ctx->deadline)) { /* the headers alone took too long */
            ctx->timed_out = 1;
            return answer(srv, ctx, url, method);
        }
        const char *expect = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
        if (expect && strcasecmp(expect, "100-continue") == 0) {
            /* refused by its headers alone (a wrong key, a compressed body): answered now,
             * before libmicrohttpd sends "100 Continue" and the client its body */
            const df_http_request hr = {
                .method = method,
                .path = url,
                .authorization = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION),
                .content_encoding =
                    MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_ENCODING),
            };
            if (df_server_refuses_by_headers(srv, &hr)) return answer(srv, ctx, url, method);
        }
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(cl, &end, 10);
            if (errno == 0 && end != cl && n > srv->opt.max_body) {
                ctx->too_large = 1;
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
        if (passed(&ctx->deadline)) /* a body trickling in: answered now, the connection closes */
            return answer_timed_out_body(srv, ctx, url, method);
        return MHD_YES;
    }
    return answer(srv, ctx, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    df_server *srv = cls;
    conn_ctx *ctx = *con_cls;
    sock_ctx *c = ctx && toe != MHD_REQUEST_TERMINATED_COMPLETED_OK ? sock_of(conn) : NULL;
    if (c) { /* a request that ends unanswered (its body never completed) gets its log line too */
        char line[512] = "";
        conn_watch *w = srv->watch;
        pthread_mutex_lock(&w->lock);
        if (c->in_request && !c->answering && !c->shut)
            snprintf(line, sizeof line, "%s %s %s: %s", c->client, c->method, c->path,
                     toe == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED
                         ? "closed unanswered: no data came for --timeout seconds"
                     : toe == MHD_REQUEST_TERMINATED_WITH_ERROR
                         ? "closed by the HTTP layer: a malformed request (which it answered 400) or a connection error"
                         : "closed unanswered: the client left before the request was complete");
        pthread_mutex_unlock(&w->lock);
        if (line[0]) df_server_log(srv, "%s", line);
    }
    request_ends(srv, conn);
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
    if (g_closing_on_purpose && strncmp(line, "Application reported internal error", 35) == 0) {
        g_closing_on_purpose = 0;
        return;
    }
    /* the read error of a connection that the watch answered 408 and shut down (logged there) */
    static const char shut_read[] = "Connection socket is closed when reading request";
    df_server *srv = cls;
    if (srv->watch && strncmp(line, shut_read, sizeof shut_read - 1) == 0) {
        conn_watch *w = srv->watch;
        pthread_mutex_lock(&w->lock);
        int quiet = w->quiet_reads > 0;
        if (quiet) w->quiet_reads--;
        pthread_mutex_unlock(&w->lock);
        if (quiet) return;
    }
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

static void watch_free(df_server *srv) {
    conn_watch *w = srv->watch;
    if (!w) return;
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->cond);
    free(w);
    srv->watch = NULL;
}

/* At shutdown: shuts down the connections whose request body is still incomplete (such a
 * request can no longer be answered); returns how many. */
static int watch_shut_incomplete(df_server *srv) {
    conn_watch *w = srv->watch;
    if (!w) return 0;
    int n = 0;
    pthread_mutex_lock(&w->lock);
    for (sock_ctx *c = w->head; c; c = c->next) {
        if (c->shut || !c->in_request || c->answering) continue;
        shutdown(c->fd, SHUT_RDWR);
        c->shut = 1;
        w->quiet_reads++;
        n++;
    }
    pthread_mutex_unlock(&w->lock);
    return n;
}

/* Stops the watch thread (after the daemon: no connection is left on its list). */
static void watch_stop(df_server *srv) {
    conn_watch *w = srv->watch;
    if (!w) return;
    pthread_mutex_lock(&w->lock);
    w->stop = 1;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    watch_free(srv);
}

df_status df_server_listen(df_server *srv, df_error *err) {
    if (srv->daemon) return df_error_set(err, DF_ERR_INVALID_ARG, "server: already listening");
    conn_watch *w = calloc(1, sizeof *w);
    if (!w) return df_error_set(err, DF_ERR_NOMEM, "server: out of memory");
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->cond, NULL);
    srv->watch = w;
    int family = AF_INET, port = 0;
    int fd = open_listener(srv, &family, &port, err);
    if (fd < 0) {
        watch_free(srv);
        return err ? err->code : DF_ERR_IO;
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                     MHD_USE_ITC | MHD_USE_ERROR_LOG;
    if (family == AF_INET6) flags |= MHD_USE_IPv6;
    atomic_store(&srv->stopping, 0);
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, (uint16_t)port, NULL, NULL, on_request, srv, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, srv,
        MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_CONNECTION_LIMIT, srv->opt.max_connections,
        MHD_OPTION_CONNECTION_TIMEOUT, srv->opt.timeout_s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, srv, MHD_OPTION_CONNECTION_MEMORY_LIMIT, srv->opt.max_header,
        MHD_OPTION_UNESCAPE_CALLBACK, unescape_keeping_nul_and_slash, NULL, MHD_OPTION_END);
    if (!d) {
        close(fd);
        watch_free(srv);
        return df_error_set(err, DF_ERR_IO, "server: cannot start the HTTP daemon on %s:%d", srv->host, port);
    }
    if (pthread_create(&w->thread, NULL, watch_main, srv) != 0) {
        MHD_stop_daemon(d);
        watch_free(srv);
        return df_error_set(err, DF_ERR_NOMEM, "server: cannot start the connection watch thread");
    }
    srv->daemon = d;
    srv->bound_port = port;
    /* logged before the loading starts, so that a loading failure's line follows it */
    const int v6 = strchr(srv->host, ':') != NULL;
    df_server_log(srv, "listening on http://%s%s%s:%d%s; loading model '%s'", v6 ? "[" : "", srv->host, v6 ? "]" : "",
                  port, srv->api_key && srv->api_key[0] ? " (API key required)" : "", srv->model_id);
    /* the socket is up: load the model and serve the queue in the background */
    if (pthread_create(&srv->worker, NULL, df_worker_main, srv) != 0) {
        MHD_stop_daemon(d);
        watch_stop(srv);
        srv->daemon = NULL;
        return df_error_set(err, DF_ERR_NOMEM, "server: cannot start the generation thread");
    }
    srv->worker_started = 1;
    return DF_OK;
}

/* Graceful stop: no new connections; a generation in progress is cancelled and, like every
 * request already received, gets its answer (up to a grace period); a request whose body is
 * still arriving is closed at once; then connections close. */
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
    int cut = 0; /* requests whose body was still arriving: never to be answered, closed at once */
    for (int waited_ms = 0; atomic_load(&srv->in_flight) > 0 && waited_ms < STOP_GRACE_MS; waited_ms += 10) {
        cut += watch_shut_incomplete(srv);
        if (atomic_load(&srv->in_flight) == 0) break;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (cut)
        df_server_log(srv, "http: closed %d connection%s whose request body was incomplete at shutdown", cut,
                      cut > 1 ? "s" : "");
    MHD_stop_daemon(srv->daemon);      /* closes connections, joins their threads */
    watch_stop(srv);
    if (listener != MHD_INVALID_SOCKET) close(listener);
    srv->daemon = NULL;
}
