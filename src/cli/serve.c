/* dflash serve: the OpenAI-compatible HTTP server on a loaded model. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "dflash/engine.h"
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

/* Serves until SIGINT or SIGTERM. The signals are blocked in every thread (the server's
 * threads inherit the mask) and taken here with sigwait, so shutdown runs in plain code. */
static int serve(const char *dir, df_server_options *so, int threads) {
    df_error err = {0};
    df_engine *eng = NULL;
    df_server *srv = NULL;
    int rc = CLI_EXIT_FAIL;
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    char line[512];
    snprintf(line, sizeof line, "loading model '%s'", so->model_id);
    log_line(NULL, line);
    df_engine_options eo = {.n_threads = threads};
    if (df_engine_load(&eng, dir, &eo, &err) != DF_OK) {
        cli_error("serve", "%s", err.msg);
        goto done;
    }
    so->log = log_line;
    if (df_server_init(&srv, eng, so, &err) != DF_OK || df_server_listen(srv, &err) != DF_OK) {
        cli_error("serve", "%s", err.msg);
        goto done;
    }
    snprintf(line, sizeof line, "serving model '%s' on http://%s%s%s:%d (threads %d%s)", so->model_id,
             strchr(so->host, ':') ? "[" : "", so->host, strchr(so->host, ':') ? "]" : "", df_server_port(srv),
             df_engine_n_threads(eng), so->api_key ? ", API key required" : "");
    log_line(NULL, line);
    int sig = 0;
    sigwait(&sigs, &sig);
    log_line(NULL, sig == SIGINT ? "SIGINT: shutting down" : "SIGTERM: shutting down");
    rc = CLI_EXIT_OK;
done:
    df_server_free(srv);
    df_engine_free(eng);
    if (rc == CLI_EXIT_OK) log_line(NULL, "stopped");
    return rc;
}
#endif

int cmd_serve(int argc, char **argv) {
    const char *model = NULL, *host = "127.0.0.1", *model_id = NULL, *api_key = NULL;
    int port = 8080, threads = 0, ctx_size = 0, max_tokens = 0;
    size_t max_body = (size_t)8 << 20;
    cli_opt opts[] = {
        {"model", "DIR", CLI_STR, &model, "$DFLASH_MODEL, else the embedded demo model", "model pack folder", 0, 0, 0},
        {"host", "ADDR", CLI_STR, &host, "127.0.0.1", "address to listen on; a non-loopback one requires --api-key", 0, 0, 0},
        {"port", "N", CLI_INT, &port, "8080", "TCP port (0 = any free port)", 0, 65535, 0},
        {"model-id", "ID", CLI_STR, &model_id, "the model folder's name", "model name in the API", 0, 0, 0},
        {"threads", "N", CLI_INT, &threads, "0 (all CPUs)", "compute threads", 0, 4096, 0},
        {"ctx-size", "N", CLI_INT, &ctx_size, "0 (the model's context, at most 32768)", "context positions per request (prompt + completion)", 0, 1 << 30, 0},
        {"max-tokens", "N", CLI_INT, &max_tokens, "0 (until the context is full)", "default and upper limit of completion tokens per request", 0, 1 << 30, 0},
        {"max-body", "BYTES", CLI_SIZE, &max_body, "8388608 (8 MiB)", "largest request body; larger ones get 413", 1024, 1073741824.0, 0},
        {"api-key", "KEY", CLI_STR, &api_key, "$DFLASH_API_KEY, else none", "require 'Authorization: Bearer KEY' (not on /health)", 0, 0, 0},
    };
    cli_command cmd = {"serve", "[options]",
                       "Serves the model over an OpenAI-compatible HTTP API: GET /v1/models, POST /v1/chat/completions,\n"
                       "GET /health. One request generates at a time; SIGINT or SIGTERM shut it down cleanly.",
                       opts, (int)(sizeof opts / sizeof opts[0])};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc >= 0) return rc;
#ifndef DFLASH_WITH_SERVER
    (void)model, (void)host, (void)model_id, (void)api_key, (void)port, (void)threads, (void)ctx_size;
    (void)max_tokens, (void)max_body;
    cli_error("serve", "this dflash was built without the HTTP server (cmake -DDFLASH_SERVER=OFF)");
    return CLI_EXIT_FAIL;
#else
    if (!api_key) api_key = getenv("DFLASH_API_KEY");
    if (api_key && !api_key[0]) api_key = NULL;
    if (!host[0]) return cli_usage_error(&cmd, "--host is empty");
    if (!api_key && !df_server_host_is_loopback(host))
        return cli_usage_error(&cmd, "listening on '%s' (not a loopback address) requires --api-key", host);
    if (model_id && !model_id[0]) return cli_usage_error(&cmd, "--model-id is empty");
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
    so.ctx_size = ctx_size;
    so.max_tokens = max_tokens;
    so.max_body = max_body;
    return serve(dir, &so, threads);
#endif
}
