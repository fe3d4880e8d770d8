/* dflash server: the generation worker — model loading, the FIFO queue, generation of each
 * job (plain or speculative), the chat output parser, and the answers: one JSON body, or
 * Server-Sent Events (OpenAI chat.completion.chunk / text_completion chunks).
 *
 * One thread runs every generation on the server's single session. A job's text callback
 * checks, once per token (so within one speculative round), and its should_stop callback
 * before each prefill chunk of 16 prompt tokens, whether the server is stopping or the client
 * went away (its socket polled for a hang-up), and stops the generation if so.
 */
#include "server/server_impl.h"

#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/threads.h"
#include "dflash/speculative.h"

/* ---- loading ------------------------------------------------------------------------ */

/* On a GPU, one short greedy generation (speculative when a drafter is loaded) before the
 * server reports ready: a backend uploads a weight at its first use, so this moves the upload
 * of every weight (seconds for a large pack) and its out-of-memory errors from the first
 * request to loading. The session and drafter state are reset by every generation. */
static df_status warm_up(df_server *srv, df_error *err) {
    if (!srv->opt.device || strcmp(srv->opt.device, "cpu") == 0) return DF_OK;
    const int32_t prompt[2] = {0, 1};
    df_gen_params gp = df_gen_params_default();
    gp.max_tokens = 8;
    df_gen_result res;
    memset(&res, 0, sizeof res);
    df_status st;
    if (srv->dstate)
        st = df_generate_speculative(srv->session, srv->dstate, prompt, 2, &gp, &srv->opt.spec, NULL, NULL, &res, err);
    else
        st = df_generate(srv->session, prompt, 2, &gp, NULL, NULL, &res, err);
    df_gen_result_free(&res);
    if (st == DF_ERR_NUMERIC) { /* non-finite logits: an engine error of each request, not of loading */
        *err = (df_error){0};
        st = DF_OK;
    }
    if (st) df_error_prefix(err, "warm-up generation");
    return st;
}

static int load_model(df_server *srv) {
    df_error err = {0};
    df_engine_options eo = {.n_threads = srv->opt.n_threads, .device = srv->opt.device};
    df_status st = df_engine_load(&srv->eng, srv->model_dir, &eo, &err);
    if (!st) st = df_chat_setup_init(&srv->chat, srv->model_dir, df_engine_tokenizer(srv->eng), srv->opt.enable_thinking,
                                     &err);
    if (!st) st = df_session_init(&srv->session, srv->eng, srv->opt.ctx_size, &err);
    if (!st) srv->chat.max_ids = (size_t)df_session_max_ctx(srv->session); /* longer prompts are refused */
    if (!st && srv->drafter_dir) {
        st = df_drafter_load(&srv->drafter, srv->drafter_dir, srv->eng, &err);
        if (!st && srv->opt.draft_quant) st = df_drafter_quantize(srv->drafter, srv->opt.draft_quant, &err);
        if (st && strncmp(err.msg, "drafter", 7) != 0) df_error_prefix(&err, "drafter"); /* most say so already */
        if (!st) st = df_draft_state_init(&srv->dstate, srv->drafter, srv->opt.draft_window, &err);
    }
    if (!st) st = warm_up(srv, &err);
    if (st) {
        df_server_redact(srv, err.msg, srv->load_error, sizeof srv->load_error);
        snprintf(srv->load_error_full, sizeof srv->load_error_full, "%s", err.msg);
        atomic_store(&srv->state, DF_SERVER_FAILED);
        df_server_log(srv, "loading failed: %s", srv->load_error);
        return -1;
    }
    const df_drafter_config *dc = srv->drafter ? df_drafter_get_config(srv->drafter) : NULL;
    char spec[200] = "no drafter", quant[32] = "";
    if (dc && srv->opt.draft_quant) snprintf(quant, sizeof quant, ", weights %d-bit", srv->opt.draft_quant);
    if (dc) {
        const df_spec_params *sp = &srv->opt.spec;
        int block = sp->block ? sp->block : df_spec_default_block(dc);
        if (sp->adaptive)
            snprintf(spec, sizeof spec, "drafter loaded: adaptive block %d in %d..%d, window %d%s%s", block,
                     sp->block_min, sp->block_max, srv->opt.draft_window, quant,
                     srv->opt.no_draft ? ", speculation disabled" : "");
        else
            snprintf(spec, sizeof spec, "drafter loaded: block %d, window %d%s%s", block, srv->opt.draft_window, quant,
                     srv->opt.no_draft ? ", speculation disabled" : "");
    }
    df_server_log(srv, "model '%s' ready: context %d, chat template %s, %s, peak RSS %.1f MiB", srv->model_id,
                  df_session_max_ctx(srv->session), srv->chat.builtin ? "built-in ChatML" : "from the pack", spec,
                  df_peak_rss_mib());
    atomic_store(&srv->state, DF_SERVER_READY);
    return 0;
}

/* ---- queue -------------------------------------------------------------------------- */

int df_queue_retry_after(double avg_s, double running_s, int n_waiting) {
    double wait = avg_s * (double)(n_waiting + 1);
    if (running_s >= 0) wait += running_s < avg_s ? avg_s - running_s : running_s;
    return wait < 1 ? 1 : wait > 60 ? 60 : (int)ceil(wait);
}

int df_job_enqueue(df_server *srv, df_job *j, df_api_error *e) {
    df_queue_prune(srv); /* clients that left while waiting free their places first */
    pthread_mutex_lock(&srv->qlock);
    int rc = 0;
    if (atomic_load(&srv->stopping)) {
        rc = df_api_error_set(e, 503, "server_error", "shutting_down", NULL, "The server is shutting down.");
    } else if (srv->n_waiting >= srv->opt.queue && (srv->running || srv->n_waiting > 0)) {
        pthread_mutex_lock(&srv->metrics.lock);
        double avg = srv->metrics.avg_job_s;
        pthread_mutex_unlock(&srv->metrics.lock);
        const double running = srv->running ? (df_now_ms() - srv->running->run_ms) / 1000.0 : -1.0;
        j->retry_after = df_queue_retry_after(avg, running, srv->n_waiting);
        rc = df_api_error_set(e, 503, "server_error", "queue_full", NULL,
                              "The server is busy: %d request%s waiting (the limit). Retry after %d s.",
                              srv->n_waiting, srv->n_waiting == 1 ? " is" : "s are", j->retry_after);
    } else {
        /* its number in the log: taken here, so that a request answered at once (an error,
         * a full queue) has only the number of its one log line */
        j->seq = atomic_fetch_add(&srv->seq, 1) + 1;
        atomic_fetch_add(&j->refs, 1);
        j->next = NULL;
        if (srv->qtail) srv->qtail->next = j;
        else srv->qhead = j;
        srv->qtail = j;
        srv->n_waiting++;
        pthread_cond_signal(&srv->qcond);
    }
    pthread_mutex_unlock(&srv->qlock);
    return rc;
}

static df_job *dequeue(df_server *srv) {
    pthread_mutex_lock(&srv->qlock);
    while (!srv->qhead && !atomic_load(&srv->stopping)) pthread_cond_wait(&srv->qcond, &srv->qlock);
    df_job *j = srv->qhead;
    if (j) {
        srv->qhead = j->next;
        if (!srv->qhead) srv->qtail = NULL;
        srv->n_waiting--;
        j->run_ms = df_now_ms();
        srv->running = j;
    }
    pthread_mutex_unlock(&srv->qlock);
    return j;
}

/* ---- output ------------------------------------------------------------------------- */

static void out_put(df_job *j, const char *s, size_t n) {
    pthread_mutex_lock(&j->lock);
    if (jbuf_put(&j->out, s, n)) atomic_store(&j->cancelled, 1); /* out of memory: give up */
    pthread_cond_broadcast(&j->cond);
    pthread_mutex_unlock(&j->lock);
}

/* Sends one SSE event "data: <json>\n\n" (takes the reference to obj). */
static void sse_json(df_job *j, json_t *obj) {
    char *s = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!s) {
        atomic_store(&j->cancelled, 1);
        return;
    }
    size_t n = strlen(s);
    pthread_mutex_lock(&j->lock);
    int bad = jbuf_put(&j->out, "data: ", 6) || jbuf_put(&j->out, s, n) || jbuf_put(&j->out, "\n\n", 2);
    if (bad) atomic_store(&j->cancelled, 1);
    pthread_cond_broadcast(&j->cond);
    pthread_mutex_unlock(&j->lock);
    free(s);
}

/* {"id", "object", "created", "model"} of a chunk or response */
static json_t *envelope(const df_job *j, const char *object) {
    json_t *o = json_pack("{s:s, s:s, s:I, s:s}", "id", j->id, "object", object, "created", (json_int_t)j->created,
                          "model", j->srv->model_id);
    if (o && j->req.stream && j->req.include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

static int is_chat(const df_job *j) { return j->req.route == DF_API_CHAT; }

/* A chunk with one choice. */
static json_t *chunk(const df_job *j, int index, json_t *delta_or_text, json_t *logprobs, const char *finish) {
    json_t *c = envelope(j, is_chat(j) ? "chat.completion.chunk" : "text_completion");
    json_t *choice = is_chat(j) ? json_pack("{s:i, s:o, s:o, s:s?}", "index", index, "delta", delta_or_text,
                                            "logprobs", logprobs ? logprobs : json_null(), "finish_reason", finish)
                                : json_pack("{s:i, s:o, s:o, s:s?}", "index", index, "text", delta_or_text,
                                            "logprobs", logprobs ? logprobs : json_null(), "finish_reason", finish);
    if (!c || !choice) {
        json_decref(c);
        json_decref(choice);
        return NULL;
    }
    json_object_set_new(c, "choices", json_pack("[o]", choice));
    return c;
}

/* ---- generation --------------------------------------------------------------------- */

typedef struct gen_ctx {
    df_job *j;
    int index;                /* prompt / choice index */
    df_chat_parser *parser;   /* chat stream */
    df_chat_deltas deltas;
    df_token_info *pending;   /* stream with logprobs: token infos not yet sent */
    int n_pending, cap_pending;
    df_api_text_offset offset; /* completions stream: the legacy text_offset of the next token */
    int client_gone;
} gen_ctx;

static int should_stop(gen_ctx *c) {
    df_job *j = c->j;
    if (atomic_load(&j->srv->stopping)) return 1;
    if (atomic_load(&j->cancelled)) return c->client_gone = 1;
    if (j->client_fd >= 0) {
        struct pollfd p = {.fd = j->client_fd, .events = POLLRDHUP};
        if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) {
            atomic_store(&j->cancelled, 1);
            return c->client_gone = 1;
        }
    }
    return 0;
}

/* The running generation's stop check (per token, per prefill chunk), which also looks for
 * queued clients that left every 250 ms: their places are freed and they are logged 499
 * "while waiting" then, not when their turn comes. */
static int run_should_stop(gen_ctx *c) {
    df_server *srv = c->j->srv;
    if (c->j->req.delay_ms > 0) { /* the test hook "dflash_delay_ms" */
        const struct timespec ts = {.tv_sec = c->j->req.delay_ms / 1000, .tv_nsec = c->j->req.delay_ms % 1000 * 1000000L};
        nanosleep(&ts, NULL);
    }
    const double now = df_now_ms();
    if (now - srv->prune_ms >= 250.0) {
        srv->prune_ms = now;
        df_queue_prune(srv);
    }
    return should_stop(c);
}

/* df_gen_params.should_stop: polled between prefill chunks. */
static int prefill_should_stop(void *user) { return run_should_stop(user); }

/* The pending token infos as a chunk's logprobs (and clears them), or NULL when none. */
static json_t *take_logprobs(gen_ctx *c) {
    if (!c->j->req.gen.logprobs || c->n_pending == 0) return NULL;
    const df_tokenizer *tok = df_engine_tokenizer(c->j->srv->eng);
    json_t *lp;
    if (is_chat(c->j)) {
        json_t *content = json_array();
        for (int i = 0; content && i < c->n_pending; i++)
            json_array_append_new(content, df_api_logprob_entry(tok, &c->pending[i]));
        lp = json_pack("{s:o*}", "content", content);
    } else {
        lp = df_api_completion_logprobs(tok, c->pending, c->n_pending, &c->offset);
    }
    c->n_pending = 0;
    return lp;
}

static json_t *delta_object(const df_chat_delta *d) {
    switch (d->kind) {
    case DF_CHAT_DELTA_REASONING: return json_pack("{s:s%}", "reasoning_content", d->text, d->len);
    case DF_CHAT_DELTA_CONTENT: return json_pack("{s:s%}", "content", d->text, d->len);
    case DF_CHAT_DELTA_TOOL_START:
        return json_pack("{s:[{s:i, s:s, s:s, s:{s:s, s:s}}]}", "tool_calls", "index", d->tool_index, "id", d->id,
                         "type", "function", "function", "name", d->name, "arguments", "");
    case DF_CHAT_DELTA_TOOL_ARGS:
        return json_pack("{s:[{s:i, s:{s:s%}}]}", "tool_calls", "index", d->tool_index, "function", "arguments",
                         d->text, d->len);
    }
    return NULL;
}

static void send_deltas(gen_ctx *c) {
    for (size_t i = 0; i < c->deltas.n; i++) {
        json_t *d = delta_object(&c->deltas.items[i]);
        sse_json(c->j, d ? chunk(c->j, c->index, d, take_logprobs(c), NULL) : NULL);
    }
    df_chat_deltas_reset(&c->deltas);
}

static int on_token_info(void *user, const df_token_info *info) {
    gen_ctx *c = user;
    if (!c->j->req.stream) return run_should_stop(c);
    if (c->n_pending == c->cap_pending) {
        int cap = c->cap_pending ? c->cap_pending * 2 : 16;
        df_token_info *p = realloc(c->pending, (size_t)cap * sizeof *p);
        if (!p) return 1;
        c->pending = p;
        c->cap_pending = cap;
    }
    c->pending[c->n_pending++] = *info;
    return run_should_stop(c);
}

static int on_text(void *user, int32_t id, const char *text, size_t len) {
    (void)id;
    gen_ctx *c = user;
    if (run_should_stop(c)) return 1;
    df_job *j = c->j;
    if (!j->req.stream) return 0;
    if (is_chat(j)) {
        df_error err = {0};
        if (len && df_chat_parser_feed(c->parser, text, len, &c->deltas, &err)) return 1;
        send_deltas(c);
    } else if (len) {
        json_t *t = df_json_text(text, len);
        json_t *lp = take_logprobs(c);
        sse_json(j, t ? chunk(j, c->index, t, lp, NULL) : NULL);
    }
    return atomic_load(&j->cancelled);
}

/* The OpenAI finish_reason: "length" whenever the token limit (max_tokens, the context) cut
 * the output, even after complete tool calls; else "tool_calls" when there are some. */
static const char *finish_name(const df_gen_result *res, int tool_calls) {
    if (res->finish == DF_FINISH_LENGTH) return "length";
    return tool_calls > 0 ? "tool_calls" : "stop";
}

/* The seed of a chat job's tool-call ids: with a request seed, that seed and the prompt's
 * tokens (FNV-1a over them), so that a request repeated gives the same ids while the turns of
 * one conversation (each prompt holding the calls before it) give new ones; without, the
 * server's random seed and the job's number. */
static uint64_t tool_id_seed(const df_job *j) {
    if (!j->req.gen.sampling.has_seed) return j->srv->id_seed ^ j->seq;
    uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t)j->req.gen.sampling.seed;
    for (int i = 0; i < j->n_ids[0]; i++) {
        h ^= (uint64_t)(uint32_t)j->ids[0][i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static df_status new_parser(const df_job *j, df_chat_parser **p, df_error *err) {
    df_chat_parse_options po = {
        .thinking_open = j->chat.thinking_open,
        .parse_tool_calls = j->req.tools && j->req.tool_choice != DF_TOOL_CHOICE_NONE,
        .tools = j->req.tools,
        .id_seed = tool_id_seed(j),
    };
    return df_chat_parser_new(&po, p, err);
}

/* The non-streamed assistant message of a chat job: the parser over prefix + text. */
static json_t *chat_message(const df_job *j, const df_gen_result *res, int *n_calls) {
    df_chat_parser *p = NULL;
    df_chat_deltas d = {0};
    df_chat_message m = {0};
    df_error err = {0};
    json_t *msg = NULL;
    if (new_parser(j, &p, &err) == DF_OK && df_chat_parser_feed(p, j->chat.prefix, strlen(j->chat.prefix), &d, &err) == DF_OK &&
        df_chat_parser_feed(p, res->text ? res->text : "", res->text_len, &d, &err) == DF_OK &&
        df_chat_parser_finish(p, &d, &err) == DF_OK && df_chat_message_apply(&m, &d, &err) == DF_OK) {
        msg = df_chat_message_to_json(&m);
        *n_calls = (int)m.n_tool_calls;
    }
    df_chat_message_free(&m);
    df_chat_deltas_free(&d);
    df_chat_parser_free(p);
    return msg;
}

/* Ends a job: its result is complete (or its stream), the end line is logged. */
static void finish_job(df_job *j, int status) {
    df_job_log_end(j, status);
    pthread_mutex_lock(&j->lock);
    j->status = status;
    j->finished = 1;
    pthread_cond_broadcast(&j->cond);
    pthread_mutex_unlock(&j->lock);
}

/* Ends a job with an error: a JSON error body (with its HTTP status), or an error event in a
 * stream that has started (its 200 went out: the log and the metrics say 200, with the error's
 * status in the note, and count the error). */
static void fail_job(df_job *j, int status, const char *type, const char *code, const char *msg) {
    df_api_error e;
    df_api_error_set(&e, status, type, code, NULL, "%s", msg);
    if (j->req.stream && j->started) {
        snprintf(j->note, sizeof j->note, "error event %d: %s", status, msg);
        j->stream_error = status;
        sse_json(j, df_api_error_json(&e));
        finish_job(j, 200);
        return;
    }
    snprintf(j->note, sizeof j->note, "%s", msg);
    json_decref(j->body);
    j->body = df_api_error_json(&e);
    if (status == 503) j->retry_after = 1;
    finish_job(j, status);
}

static void add_result(df_job *j, const df_gen_result *res) {
    j->prompt_tokens += res->n_prompt;
    j->completion_tokens += res->n_ids;
    if (res->n_ids > 1) j->decoded_tokens += res->n_ids - 1;
    j->prompt_ms += res->prompt_ms;
    j->decode_ms += res->decode_ms;
    j->draft_rounds += res->draft_rounds;
    j->draft_n += res->draft_n;
    j->draft_accepted += res->draft_n_accepted;
    j->plain_steps += res->plain_steps;
    j->draft_ms += res->draft_ms;
    j->verify_ms += res->verify_ms;
}

/* Timings of the whole job (all prompts). */
static json_t *job_timings(const df_job *j) {
    df_gen_result sum;
    memset(&sum, 0, sizeof sum);
    sum.n_ids = j->completion_tokens;
    sum.prompt_ms = j->prompt_ms;
    sum.decode_ms = j->decode_ms;
    sum.draft_rounds = j->draft_rounds;
    sum.draft_n = j->draft_n;
    sum.draft_n_accepted = j->draft_accepted;
    sum.plain_steps = j->plain_steps;
    sum.draft_ms = j->draft_ms;
    sum.verify_ms = j->verify_ms;
    return df_api_timings(&sum, j->prompt_tokens, j->decoded_tokens, j->speculative);
}

static void run_job(df_job *j) {
    df_server *srv = j->srv;
    const int stream = j->req.stream, chat = is_chat(j);
    pthread_mutex_lock(&j->lock); /* admitted: a stream's answer is a 200 stream from now on */
    j->started = 1;
    pthread_cond_broadcast(&j->cond);
    pthread_mutex_unlock(&j->lock);
    const df_tokenizer *tok = df_engine_tokenizer(srv->eng);
    json_t *choices = json_array();
    gen_ctx c;
    memset(&c, 0, sizeof c);
    c.j = j;
    df_error err = {0};
    df_status st = DF_OK;
    if (stream && chat)
        sse_json(j, chunk(j, 0, json_pack("{s:s, s:s}", "role", "assistant", "content", ""), NULL, NULL));
    for (int i = 0; i < j->n_prompts && st == DF_OK; i++) {
        c.index = i;
        df_api_text_offset_init(&c.offset, j->echo[i], j->echo[i] ? strlen(j->echo[i]) : 0, j->req.gen.skip_special);
        c.n_pending = 0;
        if (stream && chat) {
            st = new_parser(j, &c.parser, &err);
            if (!st) st = df_chat_parser_feed(c.parser, j->chat.prefix, strlen(j->chat.prefix), &c.deltas, &err);
            if (st) break;
            send_deltas(&c);
        }
        if (stream && !chat && j->echo[i])
            sse_json(j, chunk(j, i, df_json_text(j->echo[i], strlen(j->echo[i])), NULL, NULL));
        df_gen_params gp = j->req.gen;
        gp.max_tokens = j->max_tokens;
        gp.forced_ids = j->forced;
        gp.n_forced_ids = j->n_forced;
        gp.on_token = gp.logprobs ? on_token_info : NULL;
        gp.should_stop = prefill_should_stop;
        df_gen_result res;
        memset(&res, 0, sizeof res);
        if (j->speculative)
            st = df_generate_speculative(srv->session, srv->dstate, j->ids[i], j->n_ids[i], &gp, &srv->opt.spec,
                                         on_text, &c, &res, &err);
        else
            st = df_generate(srv->session, j->ids[i], j->n_ids[i], &gp, on_text, &c, &res, &err);
        add_result(j, &res);
        if (st == DF_OK && res.finish == DF_FINISH_CANCELLED) st = DF_ERR_CANCELLED;
        j->finish = res.finish == DF_FINISH_LENGTH ? "length" : res.finish == DF_FINISH_STOP ? "stop" : NULL;
        if (st == DF_OK && stream) {
            int calls = 0;
            if (chat) {
                if (df_chat_parser_finish(c.parser, &c.deltas, &err)) st = err.code;
                send_deltas(&c);
                calls = df_chat_parser_tool_calls(c.parser);
            }
            json_t *last = chunk(j, i, chat ? json_object() : json_string(""), take_logprobs(&c), finish_name(&res, calls));
            if (last && i == j->n_prompts - 1) json_object_set_new(last, "timings", job_timings(j));
            sse_json(j, last);
        } else if (st == DF_OK) {
            int calls = 0;
            json_t *choice;
            if (chat) {
                json_t *msg = chat_message(j, &res, &calls);
                json_t *lp = NULL;
                if (res.token_info) {
                    json_t *content = json_array();
                    for (int k = 0; content && k < res.n_token_info; k++)
                        json_array_append_new(content, df_api_logprob_entry(tok, &res.token_info[k]));
                    lp = json_pack("{s:o*}", "content", content);
                }
                choice = msg ? json_pack("{s:i, s:o, s:o, s:s}", "index", i, "message", msg, "logprobs",
                                         lp ? lp : json_null(), "finish_reason", finish_name(&res, calls))
                             : NULL;
            } else {
                df_api_text_offset off;
                df_api_text_offset_init(&off, j->echo[i], j->echo[i] ? strlen(j->echo[i]) : 0, j->req.gen.skip_special);
                json_t *lp = res.token_info ? df_api_completion_logprobs(tok, res.token_info, res.n_token_info, &off) : NULL;
                jbuf t = {0};
                if (jbuf_puts(&t, j->echo[i] ? j->echo[i] : "") || jbuf_put(&t, res.text ? res.text : "", res.text_len))
                    choice = NULL;
                else
                    choice = json_pack("{s:i, s:o, s:o, s:s}", "index", i, "text", df_json_text(t.p ? t.p : "", t.n),
                                       "logprobs", lp ? lp : json_null(), "finish_reason", finish_name(&res, 0));
                jbuf_free(&t);
            }
            if (!choice || json_array_append_new(choices, choice)) st = DF_ERR_NOMEM;
        }
        df_gen_result_free(&res);
        df_chat_parser_free(c.parser);
        c.parser = NULL;
        df_chat_deltas_free(&c.deltas);
    }
    free(c.pending);

    if (st == DF_ERR_CANCELLED || atomic_load(&srv->stopping)) {
        json_decref(choices);
        j->finish = "cancelled";
        if (c.client_gone || atomic_load(&j->cancelled)) {
            snprintf(j->note, sizeof j->note, "the client closed the connection");
            j->body = NULL;
            finish_job(j, 499);
        } else {
            fail_job(j, 503, "server_error", "shutting_down", "The server is shutting down.");
        }
        return;
    }
    if (st != DF_OK) {
        json_decref(choices);
        j->finish = "error";
        char msg[DF_ERROR_MSG_MAX];
        df_server_redact(srv, err.msg[0] ? err.msg : "out of memory", msg, sizeof msg);
        if (st == DF_ERR_RANGE || st == DF_ERR_INVALID_ARG)
            fail_job(j, 400, "invalid_request_error", "invalid_value", msg);
        else
            fail_job(j, 500, "server_error", st == DF_ERR_NUMERIC ? "non_finite_logits" : NULL, msg);
        return;
    }
    if (stream) {
        if (j->req.include_usage) {
            json_t *u = envelope(j, chat ? "chat.completion.chunk" : "text_completion");
            if (u) {
                json_object_set_new(u, "choices", json_array());
                json_object_set_new(u, "usage", df_api_usage(j->prompt_tokens, j->completion_tokens));
            }
            sse_json(j, u);
        }
        out_put(j, "data: [DONE]\n\n", 14);
        json_decref(choices);
        finish_job(j, 200);
        return;
    }
    json_t *body = envelope(j, chat ? "chat.completion" : "text_completion");
    if (body) {
        json_object_set_new(body, "choices", choices);
        json_object_set_new(body, "usage", df_api_usage(j->prompt_tokens, j->completion_tokens));
        json_object_set_new(body, "timings", job_timings(j));
        j->body = body;
        finish_job(j, 200);
    } else {
        json_decref(choices);
        fail_job(j, 500, "server_error", NULL, "out of memory");
    }
}

int df_queue_prune(df_server *srv) {
    df_job *gone = NULL;
    pthread_mutex_lock(&srv->qlock);
    if (!atomic_load(&srv->stopping)) {
        df_job **pp = &srv->qhead, *prev = NULL;
        while (*pp) {
            df_job *j = *pp;
            gen_ctx probe = {.j = j};
            if (should_stop(&probe)) {
                *pp = j->next;
                if (srv->qtail == j) srv->qtail = prev;
                srv->n_waiting--;
                j->next = gone;
                gone = j;
            } else {
                prev = j;
                pp = &j->next;
            }
        }
    }
    pthread_mutex_unlock(&srv->qlock);
    int n = 0;
    while (gone) {
        df_job *j = gone;
        gone = j->next;
        snprintf(j->note, sizeof j->note, "the client closed the connection while waiting");
        finish_job(j, 499);
        df_job_unref(j);
        n++;
    }
    return n;
}

void *df_worker_main(void *arg) {
    df_server *srv = arg;
    int loaded = load_model(srv) == 0;
    for (;;) {
        df_job *j = dequeue(srv);
        if (!j) break; /* stopping, nothing left */
        if (!loaded || atomic_load(&srv->stopping)) {
            fail_job(j, 503, "server_error", "shutting_down", "The server is shutting down.");
        } else {
            gen_ctx probe = {.j = j};
            if (should_stop(&probe)) { /* the client left while waiting */
                snprintf(j->note, sizeof j->note, "the client closed the connection while waiting");
                finish_job(j, 499);
            } else {
                run_job(j);
            }
        }
        pthread_mutex_lock(&srv->qlock);
        srv->running = NULL;
        pthread_mutex_unlock(&srv->qlock);
        df_job_unref(j);
    }
    return NULL;
}

/* ---- end of a job: log line and metrics ------------------------------------------------ */

void df_job_log_end(df_job *j, int status) {
    df_server *srv = j->srv;
    double total_ms = df_ms_since(&j->t0);
    double tps = df_decode_tokens_per_second(j->decoded_tokens, j->decode_ms);
    df_metrics *m = &srv->metrics;
    df_metrics_request(m, j->route, status);
    pthread_mutex_lock(&m->lock);
    m->prompt_tokens += (uint64_t)j->prompt_tokens;
    m->generated_tokens += (uint64_t)j->completion_tokens;
    m->draft_rounds += (uint64_t)j->draft_rounds;
    m->draft_n += (uint64_t)j->draft_n;
    m->draft_accepted += (uint64_t)j->draft_accepted;
    m->plain_steps += (uint64_t)j->plain_steps;
    m->draft_seconds += j->draft_ms / 1000.0;
    m->verify_seconds += j->verify_ms / 1000.0;
    if (j->started) { /* generations: not the requests turned away or given up while waiting */
        if (j->speculative) m->speculative++;
        else m->plain++;
        if (status == 499) m->cancelled++;
    }
    if ((status >= 400 && status != 499) || j->stream_error) m->errors++;
    if (j->decoded_tokens > 0) m->last_tps = tps;
    m->gen_seconds += (j->prompt_ms + j->decode_ms) / 1000.0;
    m->avg_job_s = m->avg_job_s > 0 ? 0.8 * m->avg_job_s + 0.2 * total_ms / 1000.0 : total_ms / 1000.0;
    pthread_mutex_unlock(&m->lock);

    int prompt = j->prompt_tokens; /* the tokens processed; a job that never started: its prompt's, as on arrival */
    if (!j->started)
        for (int i = 0; i < j->n_prompts; i++) prompt += j->n_ids[i];
    char accept[96] = "";
    if (j->speculative && j->draft_n > 0)
        snprintf(accept, sizeof accept, " accept=%.2f (%d/%d, %.2f tok/round)", (double)j->draft_accepted / j->draft_n,
                 j->draft_accepted, j->draft_n,
                 j->draft_rounds ? (double)(j->draft_accepted + j->draft_rounds) / j->draft_rounds : 0.0);
    df_server_log(srv, "#%llu %s POST %s %d %.1fms prompt=%d completion=%d%s%s %.1f tok/s%s peak_rss=%.1fMiB%s%s",
                  (unsigned long long)j->seq, j->client,
                  j->route == DF_ROUTE_CHAT ? "/v1/chat/completions" : "/v1/completions", status, total_ms,
                  prompt, j->completion_tokens, j->finish ? " finish=" : "", j->finish ? j->finish : "", tps,
                  accept, df_peak_rss_mib(), j->note[0] ? " : " : "", j->note);
}
