/* dflash serve: the OpenAI-compatible HTTP server. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "dflash/speculative.h"
#ifdef DFLASH_WITH_SERVER
#include "dflash/server.h"
#endif

#ifdef DFLASH_WITH_SERVER
/* Log lines to stderr with a UTC timestamp (stdio locks each call: thread-safe). */
static void log_line(void *user, const char *line) {
    (void)user;
    char ts[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
    fprintf(stderr, "%s %s\n", ts, line);
}

/* While the server stops: a second SIGINT or SIGTERM ends the process at once. */
typedef struct second_signal {
    const sigset_t *sigs;
    atomic_int done; /* the stop is over: the thread returns */
} second_signal;

static void *second_signal_main(void *arg) {
    second_signal *s = arg;
    while (!atomic_load(&s->done)) {
        struct timespec tick = {0, 50 * 1000 * 1000};
        int sig = sigtimedwait(s->sigs, NULL, &tick);
        if (sig == SIGINT || sig == SIGTERM) {
            log_line(NULL, sig == SIGINT ? "SIGINT again: exiting without waiting for requests in progress"
                                         : "SIGTERM again: exiting without waiting for requests in progress");
            _exit(CLI_EXIT_FAIL);
        }
    }
    return NULL;
}

/* Serves until SIGINT or SIGTERM (or until loading the model fails). The signals are
 * blocked in every thread (the server's threads inherit the mask) and taken here with
 * sigtimedwait, so shutdown runs in plain code. */
static int serve(df_server_options *so) {
    df_error err = {0};
    df_server *srv = NULL;
    int rc = CLI_EXIT_FAIL;
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    so->log = log_line;
    if (df_server_init(&srv, so, &err) != DF_OK || df_server_listen(srv, &err) != DF_OK) {
        cli_error("serve", "%s", err.msg);
        goto done;
    }
    char line[512]; /* (df_server_listen logged where it listens) */
    int announced = 0;
    for (;;) {
        struct timespec tick = {0, 50 * 1000 * 1000};
        int sig = sigtimedwait(&sigs, NULL, &tick);
        if (sig == SIGINT || sig == SIGTERM) {
            log_line(NULL, sig == SIGINT ? "SIGINT: shutting down" : "SIGTERM: shutting down");
            rc = CLI_EXIT_OK;
            break;
        }
        df_server_state st = df_server_get_state(srv);
        if (st == DF_SERVER_FAILED) {
            cli_error("serve", "%s", df_server_load_error_full(srv));
            break;
        }
        if (st == DF_SERVER_READY && !announced) {
            announced = 1;
            snprintf(line, sizeof line, "serving model '%s' on port %d", so->model_id, df_server_port(srv));
            log_line(NULL, line);
        }
    }
done:;
    second_signal second = {.sigs = &sigs};
    atomic_init(&second.done, 0);
    pthread_t second_thread;
    const int watching = rc == CLI_EXIT_OK && pthread_create(&second_thread, NULL, second_signal_main, &second) == 0;
    df_server_free(srv);
    if (watching) {
        atomic_store(&second.done, 1);
        pthread_join(second_thread, NULL);
    }
    if (rc == CLI_EXIT_OK) log_line(NULL, "stopped");
    return rc;
}
#endif

int cmd_serve(int argc, char **argv) {
    const char *model = NULL, *host = "127.0.0.1", *model_id = NULL, *api_key = NULL, *drafter = NULL;
    int port = 8080, threads = 0, ctx_size = 0, max_tokens = 0, queue = 16, top_k = 20, thinking = 0;
    const char *device = "cpu";
    int window = 2048, no_draft = 0, draft_quant = 0, test_hooks = 0, timeout = 30, max_conn = 64;
    int request_timeout = 60;
    const char *cors = "*";
    size_t max_body = (size_t)8 << 20, max_header = (size_t)32 << 10;
    df_spec_params spec = df_spec_params_default();
    cli_opt opts[] = {
        {"model", "DIR", CLI_STR, &model, "$DFLASH_MODEL, else the embedded demo model", "model pack folder", 0, 0, 0},
        {"host", "ADDR", CLI_STR, &host, "127.0.0.1", "address to listen on; a non-loopback one requires --api-key", 0, 0, 0},
        {"port", "N", CLI_INT, &port, "8080", "TCP port (0 = any free port)", 0, 65535, 0},
        {"model-id", "ID", CLI_STR, &model_id, "the model folder's name", "model name in the API", 0, 0, 0},
        {"api-key", "KEY", CLI_STR, &api_key, "$DFLASH_API_KEY, else none", "require 'Authorization: Bearer KEY' (not on /health)", 0, 0, 0},
        {"threads", "N", CLI_INT, &threads, "0 (all CPUs)", "compute threads", 0, 4096, 0},
        {"device", "cpu|cuda", CLI_STR, &device, "cpu", "compute backend (cuda: the first NVIDIA GPU)", 0, 0, 0},
        {"ctx-size", "N", CLI_INT, &ctx_size, "0 (the model's context, at most 32768)", "context positions per request (prompt + completion)", 0, 32768, 0},
        {"max-tokens", "N", CLI_INT, &max_tokens, "0 (until the context is full)", "default and upper limit of completion tokens per request", 0, 1 << 30, 0},
        {"enable-thinking", NULL, CLI_FLAG, &thinking, "off", "thinking on for chat requests that do not set enable_thinking", 0, 0, 0},
        {"top-logprobs-k", "N", CLI_INT, &top_k, "20", "largest top_logprobs a request may ask for", 0, 20, 0},
        {"queue", "N", CLI_INT, &queue, "16", "requests that may wait while one generates; more get 503", 0, 1 << 20, 0},
        CLI_DRAFT_OPTIONS(drafter, spec, window, no_draft, draft_quant),
        {"max-body", "BYTES", CLI_SIZE, &max_body, "8388608 (8 MiB)", "largest request body; larger ones get 413", 1024, 1073741824.0, 0},
        {"max-header", "BYTES", CLI_SIZE, &max_header, "32768 (32 KiB)", "memory for a request's line and headers; larger ones get 431", 4096, 1 << 24, 0},
        {"max-connections", "N", CLI_INT, &max_conn, "64", "concurrent connections", 1, 1 << 16, 0},
        {"timeout", "S", CLI_INT, &timeout, "30", "seconds an idle connection (or a client that stops sending) is kept", 1, 86400, 0},
        {"request-timeout", "S", CLI_INT, &request_timeout, "60", "seconds a client has to send a whole request (headers and body) from the connection's opening or its previous answer; a slower or stalled one gets 408, or is closed while its headers are still arriving (an idle kept-alive connection too)", 1, 86400, 0},
        {"cors-origin", "ORIGIN", CLI_STR, &cors, "*", "Access-Control-Allow-Origin of every answer, for browsers calling from other origins (OPTIONS preflights answered 204, without a key): *, null or one origin scheme://host[:port]; 'none': no CORS headers", 0, 0, 0},
        {"test-hooks", NULL, CLI_FLAG, &test_hooks, "off", "testing only: honour the request fields dflash_forced_output (its tokens replace the sampled ones) and dflash_delay_ms (a sleep at each token and prefill chunk)", 0, 0, 0},
    };
    cli_command cmd = {"serve", "[options]",
                       "Serves the model over an OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions\n"
                       "(streaming and not), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (and OPTIONS\n"
                       "preflights for browsers, see --cors-origin). The socket opens at once and the model loads in the\n"
                       "background (/health answers 503 until it is ready). One request generates at a time; others wait in\n"
                       "a FIFO queue. SIGINT or SIGTERM shut it down cleanly.",
                       opts, (int)(sizeof opts / sizeof opts[0])};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc >= 0) return rc;
    if (strcmp(device, "cpu") != 0 && strcmp(device, "cuda") != 0)
        return cli_usage_error(&cmd, "--device must be cpu or cuda");
    if (cli_check_draft_options(&cmd, drafter, no_draft, &spec, draft_quant)) return CLI_EXIT_USAGE;
    if (ctx_size == 1) /* a request needs a prompt token and a position for what it generates */
        return cli_usage_error(&cmd, "--ctx-size must be 0 (the model's context) or from 2 to 32768 (got 1)");
#ifndef DFLASH_WITH_SERVER
    (void)model, (void)host, (void)model_id, (void)api_key, (void)port, (void)threads, (void)ctx_size;
    (void)max_tokens, (void)max_body, (void)max_header, (void)queue, (void)top_k, (void)thinking, (void)window;
    (void)no_draft, (void)test_hooks, (void)timeout, (void)max_conn, (void)request_timeout, (void)cors;
    cli_error("serve", "this dflash was built without the HTTP server (cmake -DDFLASH_SERVER=OFF)");
    return CLI_EXIT_FAIL;
#else
    if (no_draft) draft_quant = 0; /* the drafter is loaded (checked) but never runs: no need to quantize it */
    if (!api_key) api_key = getenv("DFLASH_API_KEY");
    if (api_key && !api_key[0]) api_key = NULL;
    if (!host[0]) return cli_usage_error(&cmd, "--host is empty");
    if (strcasecmp(cors, "none") == 0) cors = NULL;
    else if (!df_server_cors_origin_valid(cors))
        return cli_usage_error(&cmd, "--cors-origin '%s' is not *, null, none or one origin scheme://host[:port] "
                                     "(no path, no list)", cors);
    if (!api_key && !df_server_host_is_loopback(host))
        return cli_usage_error(&cmd, "listening on '%s' (not a loopback address) requires a non-empty --api-key "
                                     "(or $DFLASH_API_KEY)", host);
    if (model_id && !model_id[0]) return cli_usage_error(&cmd, "--model-id is empty");
    if (model_id && !df_server_model_id_valid(model_id))
        return cli_usage_error(&cmd, "--model-id must be UTF-8 text without control characters");
    char dir[4096], id[256];
    if (cli_model_dir(model, dir, sizeof dir)) return CLI_EXIT_FAIL;
    if (!model_id) {
        cli_model_id(dir, id, sizeof id);
        model_id = id;
    }
    df_server_options so = df_server_options_default();
    so.host = host;
    so.port = port;
    so.model_id = model_id;
    so.api_key = api_key;
    so.model_dir = dir;
    so.n_threads = threads;
    cli_note_threads("serve", threads);
    so.device = device;
    so.ctx_size = ctx_size;
    so.max_tokens = max_tokens;
    so.enable_thinking = thinking;
    so.top_logprobs_k = top_k;
    so.queue = queue;
    so.drafter_dir = drafter;
    so.spec = spec;
    so.draft_window = window;
    so.draft_quant = draft_quant;
    so.no_draft = no_draft;
    so.max_body = max_body;
    so.max_header = max_header;
    so.max_connections = (unsigned)max_conn;
    so.timeout_s = (unsigned)timeout;
    so.request_timeout_s = (unsigned)request_timeout;
    so.test_hooks = test_hooks;
    so.cors_origin = cors;
    return serve(&so);
#endif
}
