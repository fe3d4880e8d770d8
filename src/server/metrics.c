/* dflash server: counters and the Prometheus text exposition of GET /metrics. */
#include "server/server_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void df_metrics_request(df_metrics *m, df_route_label route, int status) {
    pthread_mutex_lock(&m->lock);
    for (int i = 0; i < DF_METRIC_STATUSES; i++) {
        if (m->requests[route][i].n == 0) m->requests[route][i].status = status;
        if (m->requests[route][i].status == status) {
            m->requests[route][i].n++;
            break;
        }
    }
    pthread_mutex_unlock(&m->lock);
}

static const char *const route_labels[DF_ROUTE_COUNT] = {
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{id}", "/health", "/metrics", "other"};

#define HELP(b, name, type, help) jbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type)

char *df_metrics_render(df_server *srv) {
    df_metrics m;
    pthread_mutex_lock(&srv->metrics.lock);
    m = srv->metrics;
    pthread_mutex_unlock(&srv->metrics.lock);
    pthread_mutex_lock(&srv->qlock);
    int waiting = srv->n_waiting, generating = srv->running != NULL;
    pthread_mutex_unlock(&srv->qlock);

    jbuf b = {0};
    int bad = HELP(&b, "dflash_requests_total", "counter", "HTTP requests answered, by route and status.");
    for (int r = 0; r < DF_ROUTE_COUNT; r++)
        for (int i = 0; i < DF_METRIC_STATUSES && m.requests[r][i].n; i++)
            bad |= jbuf_printf(&b, "dflash_requests_total{route=\"%s\",status=\"%d\"} %llu\n", route_labels[r],
                               m.requests[r][i].status, (unsigned long long)m.requests[r][i].n);
    struct {
        const char *name, *type, *help;
        double v;
    } rows[] = {
        {"dflash_errors_total", "counter",
         "Answers with an error status (4xx/5xx; client hang-ups and /health's not-ready 503 excluded) and streams ended by an error event.",
         (double)m.errors},
        {"dflash_cancelled_total", "counter", "Generations stopped because the client went away.", (double)m.cancelled},
        {"dflash_prompt_tokens_total", "counter", "Prompt tokens prefilled.", (double)m.prompt_tokens},
        {"dflash_generated_tokens_total", "counter", "Completion tokens generated.", (double)m.generated_tokens},
        {"dflash_generation_seconds_total", "counter", "Wall time spent prefilling and decoding.", m.gen_seconds},
        {"dflash_tokens_per_second", "gauge", "Decode speed of the last generation of 2 tokens or more (tokens after the first per second).", m.last_tps},
        {"dflash_speculative_requests_total", "counter", "Generations decoded speculatively.", (double)m.speculative},
        {"dflash_plain_requests_total", "counter", "Generations decoded plainly.", (double)m.plain},
        {"dflash_draft_rounds_total", "counter", "Speculative verify rounds.", (double)m.draft_rounds},
        {"dflash_draft_tokens_total", "counter", "Tokens proposed by the drafter.", (double)m.draft_n},
        {"dflash_draft_tokens_accepted_total", "counter", "Drafted tokens accepted by the target.",
         (double)m.draft_accepted},
        {"dflash_plain_steps_total", "counter",
         "Speculative generations' rounds decoded as plain steps (the fallback when drafting is slower).",
         (double)m.plain_steps},
        {"dflash_draft_seconds_total", "counter", "Wall time of the speculative rounds' drafter passes.",
         m.draft_seconds},
        {"dflash_verify_seconds_total", "counter", "Wall time of the speculative rounds' verify passes.",
         m.verify_seconds},
        {"dflash_queue_depth", "gauge", "Requests waiting for the generator.", (double)waiting},
        {"dflash_generating", "gauge", "1 while a generation runs.", (double)generating},
        {"dflash_model_loaded", "gauge", "1 once the model is loaded and serving.",
         (double)(atomic_load(&srv->state) == DF_SERVER_READY)},
        {"dflash_peak_rss_bytes", "gauge", "Peak resident memory of the process.", df_peak_rss_mib() * 1048576.0},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        bad |= HELP(&b, rows[i].name, rows[i].type, rows[i].help);
        bad |= jbuf_printf(&b, "%s %.15g\n", rows[i].name, rows[i].v);
    }
    if (bad) {
        jbuf_free(&b);
        return NULL;
    }
    return jbuf_take(&b, NULL);
}
