/* dflash generate: one prompt in, generated text out (streamed, or one JSON object), plainly or
 * with a DFlash drafter (speculative decoding, greedy only). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdio_ext.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli/cli.h"
#include "dflash/chat.h"
#include "dflash/engine.h"
#include "dflash/generate.h"
#include "dflash/speculative.h"
#include "server/openai.h"
#include "server/prompt.h"
#include "text/jinja_internal.h"

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig) {
    (void)sig;
    interrupted = 1;
}

typedef struct stream_ctx {
    int print;          /* stream text to stdout */
    size_t printed;     /* bytes written */
    char last;          /* last byte written */
    int werr;           /* errno of the write that failed (0: none) */
} stream_ctx;

/* Streams each piece of text; stops the generation at Ctrl-C or at the first write that fails
 * (a closed pipe, a full disk: its errno is kept, the unwritten output dropped, and the command
 * reports the error and exits 1). */
static int on_text(void *user, int32_t id, const char *text, size_t len) {
    (void)id;
    stream_ctx *s = user;
    if (s->print && len) {
        errno = 0;
        if (fwrite(text, 1, len, stdout) != len || fflush(stdout) != 0) {
            s->werr = errno ? errno : EIO;
            __fpurge(stdout);
            clearerr(stdout);
            return 1;
        }
        s->printed += len;
        s->last = text[len - 1];
    }
    return interrupted != 0;
}

/* df_gen_params.should_stop: Ctrl-C also stops a long prefill. */
static int prefill_interrupted(void *user) {
    (void)user;
    return interrupted != 0;
}

static json_t *id_array(const int32_t *ids, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

typedef struct gen_output {
    const int32_t *prompt;
    size_t n_prompt;
    const df_gen_result *res;
    int drafter;               /* a drafter was loaded: add the draft counts */
    json_t *message;           /* chat: the parsed assistant message, or NULL */
    int draft_quant;           /* 0, or the bits of --draft-quant */
} gen_output;

static int print_json(const gen_output *g) {
    const df_gen_result *res = g->res;
    json_t *text = json_stringn(res->text ? res->text : "", res->text_len);
    if (!text) {
        fprintf(stderr, "dflash generate: the generated text is not valid UTF-8\n");
        return CLI_EXIT_FAIL;
    }
    json_t *o = json_pack("{s:o, s:o, s:o, s:s, s:f, s:f}", "prompt_ids", id_array(g->prompt, g->n_prompt), "ids",
                          id_array(res->ids, (size_t)res->n_ids), "text", text, "finish_reason",
                          df_finish_reason_name(res->finish), "prompt_ms", res->prompt_ms, "decode_ms",
                          res->decode_ms);
    if (o && g->drafter) {
        json_object_set_new(o, "draft_rounds", json_integer(res->draft_rounds));
        json_object_set_new(o, "draft_n", json_integer(res->draft_n));
        json_object_set_new(o, "draft_n_accepted", json_integer(res->draft_n_accepted));
        json_object_set_new(o, "plain_steps", json_integer(res->plain_steps));
        json_object_set_new(o, "draft_ms", json_real(res->draft_ms));
        json_object_set_new(o, "verify_ms", json_real(res->verify_ms));
        json_object_set_new(o, "draft_quant_bits", json_integer(g->draft_quant));
    }
    if (o && g->message) json_object_set(o, "message", g->message);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) {
        fprintf(stderr, "dflash generate: out of memory\n");
        return CLI_EXIT_FAIL;
    }
    puts(s);
    free(s);
    return CLI_EXIT_OK;
}

/* The assistant message parsed from a chat output (reasoning, content, tool calls). */
static json_t *parse_message(const df_chat_built *built, const df_api_request *req, const df_gen_result *res) {
    df_chat_parse_options po = {.thinking_open = built->thinking_open,
                                .parse_tool_calls = req->tools && req->tool_choice != DF_TOOL_CHOICE_NONE,
                                .tools = req->tools,
                                .id_seed = req->gen.sampling.has_seed ? req->gen.sampling.seed : 0};
    jbuf all = {0};
    df_chat_message m = {0};
    df_error err = {0};
    json_t *msg = NULL;
    if (!jbuf_puts(&all, built->prefix) && !jbuf_put(&all, res->text ? res->text : "", res->text_len) &&
        df_chat_parse(all.p, all.n, &po, &m, &err) == DF_OK)
        msg = df_chat_message_to_json(&m);
    df_chat_message_free(&m);
    jbuf_free(&all);
    return msg;
}

int cmd_generate(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *chat = NULL, *messages = NULL, *prompt_ids = NULL, *drafter_dir = NULL;
    df_sampling_params sp = df_sampling_default();
    int max_tokens = 256, threads = 0, json = 0, thinking = 0, stats = 0, no_draft = 0, window = 2048, draft_quant = 0;
    const char *device = "cpu";
    df_spec_params spec = df_spec_params_default();
    const char *stops[DF_MAX_STOP];
    cli_list stop = {stops, 0, DF_MAX_STOP};
    cli_opt opts[] = {
        {"model", "DIR", CLI_STR, &model, "$DFLASH_MODEL, else the embedded demo model", "model pack folder", 0, 0, 0},
        {"prompt", "TEXT", CLI_STR, &prompt, "none", "raw prompt; special tokens like <|im_start|> are recognised", 0, 0, 0},
        {"chat", "TEXT", CLI_STR, &chat, "none", "a user message, rendered with the pack's chat template", 0, 0, 0},
        {"messages", "FILE", CLI_STR, &messages, "none", "a chat request (JSON: a request body with messages, tools, ..., or a list of messages)", 0, 0, 0},
        {"prompt-ids", "IDS", CLI_STR, &prompt_ids, "none", "prompt as comma-separated token ids (1,2,3)", 0, 0, 0},
        {"enable-thinking", NULL, CLI_FLAG, &thinking, "off", "with --chat / --messages: thinking on unless the request says otherwise", 0, 0, 0},
        {"temperature", "F", CLI_FLOAT, &sp.temperature, "0 (greedy)", "sampling temperature, 0 = greedy", 0, 2, 0},
        {"top-p", "F", CLI_FLOAT_GT, &sp.top_p, "the pack's generation_config.json, else 1 (off)", "nucleus sampling mass, in (0, 1]", 0, 1, 0},
        {"top-k", "N", CLI_INT, &sp.top_k, "the pack's generation_config.json, else 0 (off)", "keep the N most likely tokens, 0 or -1 = off (as the server's top_k)", -1, 1 << 30, 0},
        {"min-p", "F", CLI_FLOAT, &sp.min_p, "the pack's generation_config.json, else 0 (off)", "drop tokens below F x the top probability", 0, 1, 0},
        {"seed", "N", CLI_U64, &sp.seed, "from the clock", "random seed (same seed, same output); a negative N is taken modulo 2^64 (-1: the fixed seed 2^64-1)", 0, 0, 0},
        {"max-tokens", "N", CLI_INT, &max_tokens, "256", "most tokens to generate, 0 = until the context is full", 0, 1 << 30, 0},
        {"stop", "S", CLI_LIST, &stop, "none", "stop string, not printed (up to 16)", 0, 0, 0},
        {"threads", "N", CLI_INT, &threads, "0 (all CPUs)", "compute threads", 0, 4096, 0},
        {"device", "cpu|cuda", CLI_STR, &device, "cpu", "compute backend (cuda: the first NVIDIA GPU)", 0, 0, 0},
        CLI_DRAFT_OPTIONS(drafter_dir, spec, window, no_draft, draft_quant),
        {"stats", NULL, CLI_FLAG, &stats, "off", "print draft_rounds, draft_n, draft_n_accepted, tokens/round, acceptance, plain_steps and each phase's time per round to stderr", 0, 0, 0},
        {"json", NULL, CLI_FLAG, &json, "off", "print one JSON object {prompt_ids, ids, text, finish_reason, ...} instead of streaming", 0, 0, 0},
    };
    cli_command cmd = {"generate", "(--prompt TEXT | --chat TEXT | --messages FILE | --prompt-ids IDS) [options]",
                       "Generates a continuation of a prompt and streams it to stdout (statistics go to stderr).\n"
                       "Chat prompts (--chat, --messages) are rendered with the pack's chat template.",
                       opts, (int)(sizeof opts / sizeof opts[0])};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc >= 0) return rc;
    if (strcmp(device, "cpu") != 0 && strcmp(device, "cuda") != 0)
        return cli_usage_error(&cmd, "--device must be cpu or cuda");
    for (int i = 0; i < stop.n; i++) {
        if (!stop.items[i][0]) return cli_usage_error(&cmd, "--stop: a stop string cannot be empty");
        if (cli_check_utf8(&cmd, "--stop", stop.items[i])) return CLI_EXIT_USAGE;
    }
    if (prompt && cli_check_utf8(&cmd, "--prompt", prompt)) return CLI_EXIT_USAGE;
    if (chat && cli_check_utf8(&cmd, "--chat", chat)) return CLI_EXIT_USAGE;
    if (!!prompt + !!chat + !!messages + !!prompt_ids != 1)
        return cli_usage_error(&cmd, "give exactly one of --prompt, --chat, --messages and --prompt-ids");
    if (cli_check_draft_options(&cmd, drafter_dir, no_draft, &spec, draft_quant)) return CLI_EXIT_USAGE;
    if (thinking && !chat && !messages)
        return cli_usage_error(&cmd, "--enable-thinking applies to --chat and --messages only");

    char dir[4096], id[256];
    if (cli_model_dir(model, dir, sizeof dir)) return CLI_EXIT_FAIL;
    cli_model_id(dir, id, sizeof id);
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (prompt_ids && cli_parse_ids(&cmd, "--prompt-ids", prompt_ids, &ids, &n_ids)) return CLI_EXIT_USAGE;

    df_error err = {0};
    df_engine *eng = NULL;
    df_session *sess = NULL;
    df_drafter *drafter = NULL;
    df_draft_state *ds = NULL;
    df_chat_setup cs = {0};
    df_api_request req = {0};
    df_chat_built built = {0};
    json_t *message = NULL;
    df_gen_result res = {0};
    rc = CLI_EXIT_FAIL;
    cli_note_threads("generate", threads);
    df_engine_options eo = {.n_threads = threads, .device = device};
    if (df_engine_load(&eng, dir, &eo, &err) != DF_OK) {
        cli_error("generate", "%s", err.msg);
        goto done;
    }
    if (prompt_ids) { /* prompt ids must be the model's (as the server checks) */
        const int lim = df_engine_vocab_size(eng);
        for (size_t i = 0; i < n_ids; i++)
            if (ids[i] < 0 || ids[i] >= lim) {
                cli_error("generate", "--prompt-ids: token id %d is outside 0..%d (the model's vocabulary)", (int)ids[i],
                          lim - 1);
                rc = CLI_EXIT_USAGE;
                goto done;
            }
    }
    if (chat || messages) {
        if (df_chat_setup_init(&cs, dir, df_engine_tokenizer(eng), thinking, &err)) {
            cli_error("generate", "%s", err.msg);
            goto done;
        }
        if (messages) {
            if (cli_read_chat_request("generate", messages, id, df_engine_vocab_size(eng), &req)) goto done;
        } else {
            req.root = json_pack("{s:[{s:s, s:s}]}", "messages", "role", "user", "content", chat);
            if (!req.root) {
                cli_error("generate", "--chat: the text is not valid UTF-8");
                rc = CLI_EXIT_USAGE;
                goto done;
            }
        }
        if (df_chat_build(&cs, req.root, req.tool_choice, req.tool_name, 1, &built, &err)) {
            cli_error("generate", "%s", err.msg);
            goto done;
        }
        if (built.n_ids == 0) { /* a broken pack, not a bad option */
            cli_error("generate", "the pack's chat template rendered an empty prompt");
            goto done;
        }
        ids = built.ids;
        n_ids = built.n_ids;
        built.ids = NULL;
    } else if (!ids) {
        if (df_tokenizer_encode(df_engine_tokenizer(eng), prompt, strlen(prompt), 1, &ids, &n_ids, &err) != DF_OK) {
            cli_error("generate", "%s", err.msg);
            goto done;
        }
    }
    if (n_ids == 0) { /* an empty --prompt or --prompt-ids: nothing to continue */
        rc = cli_usage_error(&cmd, "%s: the prompt is empty (it has no tokens)", prompt_ids ? "--prompt-ids" : "--prompt");
        goto done;
    }

    /* Fields not given take the pack's defaults; the temperature stays 0 unless given. */
    const df_generation_defaults *gd = &df_engine_pack(eng)->gen;
    if (!cli_find(&cmd, "top-p")->given && gd->has_top_p) sp.top_p = gd->top_p;
    if (!cli_find(&cmd, "top-k")->given && gd->has_top_k) sp.top_k = gd->top_k;
    if (!cli_find(&cmd, "min-p")->given && gd->has_min_p) sp.min_p = gd->min_p;
    sp.has_seed = cli_find(&cmd, "seed")->given;
    if (messages && req.root) {
        /* The request file's sampling fields (validated like the server's) apply where the
         * command line did not set the same option. */
        json_t *v;
        if (!cli_find(&cmd, "temperature")->given && json_is_number(v = json_object_get(req.root, "temperature")))
            sp.temperature = (float)json_number_value(v);
        if (!cli_find(&cmd, "top-p")->given && json_is_number(v = json_object_get(req.root, "top_p")))
            sp.top_p = (float)json_number_value(v);
        if (!cli_find(&cmd, "top-k")->given && json_is_integer(v = json_object_get(req.root, "top_k")))
            sp.top_k = (int)json_integer_value(v);
        if (!cli_find(&cmd, "min-p")->given && json_is_number(v = json_object_get(req.root, "min_p")))
            sp.min_p = (float)json_number_value(v);
        if (!sp.has_seed && json_is_integer(v = json_object_get(req.root, "seed"))) {
            sp.seed = (uint64_t)json_integer_value(v);
            sp.has_seed = 1;
        }
        if (!cli_find(&cmd, "max-tokens")->given &&
            (json_is_integer(v = json_object_get(req.root, "max_completion_tokens")) ||
             json_is_integer(v = json_object_get(req.root, "max_tokens"))))
            max_tokens = (int)json_integer_value(v);
        /* the logit processors (no command-line options): as the request sets them */
        if (json_object_get(req.root, "repetition_penalty")) sp.repetition_penalty = req.gen.sampling.repetition_penalty;
        if (json_object_get(req.root, "presence_penalty")) sp.presence_penalty = req.gen.sampling.presence_penalty;
        if (json_object_get(req.root, "frequency_penalty")) sp.frequency_penalty = req.gen.sampling.frequency_penalty;
        if (req.gen.sampling.n_logit_bias > 0) {
            sp.logit_bias = req.gen.sampling.logit_bias; /* owned by req, freed at the end */
            sp.n_logit_bias = req.gen.sampling.n_logit_bias;
        }
        cli_note_ignored_fields("generate", messages, req.root);
        if (!cli_find(&cmd, "stop")->given) {
            v = json_object_get(req.root, "stop");
            if (json_is_string(v) && json_string_length(v) > 0 && stop.n < DF_MAX_STOP)
                stop.items[stop.n++] = json_string_value(v);
            for (size_t i = 0; json_is_array(v) && i < json_array_size(v) && stop.n < DF_MAX_STOP; i++)
                if (json_is_string(json_array_get(v, i)) && json_string_length(json_array_get(v, i)) > 0)
                    stop.items[stop.n++] = json_string_value(json_array_get(v, i));
        }
    }

    /* A session just large enough for the prompt and the tokens asked for. */
    int ctx = 0;
    long long need = (long long)n_ids + max_tokens;
    if (max_tokens > 0 && need <= df_engine_pack(eng)->cfg.max_position_embeddings && need <= 32768) ctx = (int)need;
    if (df_session_init(&sess, eng, ctx, &err) != DF_OK) {
        cli_error("generate", "%s", err.msg);
        goto done;
    }
    if (no_draft) draft_quant = 0; /* the drafter is loaded (checked) but never runs: no need to quantize it */
    if (drafter_dir && (df_drafter_load(&drafter, drafter_dir, eng, &err) != DF_OK ||
                        (draft_quant && df_drafter_quantize(drafter, draft_quant, &err) != DF_OK) ||
                        df_draft_state_init(&ds, drafter, window, &err) != DF_OK)) {
        cli_error("generate", "%s%s", strncmp(err.msg, "drafter", 7) != 0 ? "drafter: " : "", err.msg);
        goto done;
    }
    df_gen_params gp = df_gen_params_default();
    gp.sampling = sp;
    gp.max_tokens = max_tokens;
    for (int i = 0; i < stop.n; i++) gp.stop[i] = stop.items[i];
    gp.n_stop = stop.n;
    gp.should_stop = prefill_interrupted;
    if (sp.temperature == 0.0f) { /* sampling options given for a greedy run: say that they do nothing */
        const char *opts[4] = {"top-p", "top-k", "min-p", "seed"};
        char given[64] = "";
        for (int i = 0; i < 4; i++)
            if (cli_find(&cmd, opts[i])->given)
                snprintf(given + strlen(given), sizeof given - strlen(given), "%s--%s", given[0] ? ", " : "", opts[i]);
        if (given[0])
            fprintf(stderr, "dflash generate: %s: no effect at temperature 0 (greedy decoding); --temperature F samples\n",
                    given);
    }
    int speculative = ds && !no_draft && sp.temperature == 0.0f && !df_sampling_has_processors(&sp);
    if (ds && !no_draft && !speculative)
        fprintf(stderr, "dflash generate: %s is decoded plainly; speculative decoding is greedy only\n",
                sp.temperature != 0.0f ? "sampling (temperature > 0)" : "a request with logit processors (penalties, logit_bias)");

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
    stream_ctx sc = {!json, 0, '\n', 0};
    df_status st = speculative ? df_generate_speculative(sess, ds, ids, (int)n_ids, &gp, &spec, on_text, &sc, &res, &err)
                               : df_generate(sess, ids, (int)n_ids, &gp, on_text, &sc, &res, &err);
    if (sc.werr) { /* the output's reader left (or its disk is full): no more output */
        cli_error("generate", "cannot write the output: %s", strerror(sc.werr));
        rc = CLI_EXIT_FAIL;
        goto done;
    }
    if (st != DF_OK) {
        if (sc.printed && sc.last != '\n') putchar('\n');
        cli_error("generate", "%s", err.msg);
        /* the input (ids out of range; a prompt the context cannot hold: a value only the loaded
         * model can check) */
        if ((st == DF_ERR_INVALID_ARG || st == DF_ERR_RANGE) && !sc.printed) rc = CLI_EXIT_USAGE;
        goto done;
    }
    if (req.root) message = parse_message(&built, &req, &res);
    if (json) {
        gen_output g = {ids, n_ids, &res, ds != NULL, message, draft_quant};
        rc = print_json(&g);
    } else {
        if (sc.printed && sc.last != '\n') putchar('\n');
        fflush(stdout);
        double pms = res.prompt_ms, dms = res.decode_ms;
        if (res.finish == DF_FINISH_CANCELLED && res.n_ids == 0) /* during the prefill: part of the prompt */
            fprintf(stderr, "dflash: prompt of %d token%s: prefill cancelled after %.1f ms; generated 0 tokens; finish: %s%s\n",
                    res.n_prompt, res.n_prompt == 1 ? "" : "s", pms, df_finish_reason_name(res.finish),
                    speculative ? " (speculative)" : "");
        else
            fprintf(stderr,
                    "dflash: prompt %d token%s in %.1f ms (%.1f tok/s); generated %d token%s in %.1f ms (%.1f tok/s); "
                    "finish: %s%s\n",
                    res.n_prompt, res.n_prompt == 1 ? "" : "s", pms, pms > 0 ? res.n_prompt * 1e3 / pms : 0.0,
                    res.n_ids, res.n_ids == 1 ? "" : "s", dms, df_decode_tokens_per_second(res.n_ids - 1, dms),
                    df_finish_reason_name(res.finish), speculative ? " (speculative)" : "");
        rc = CLI_EXIT_OK;
    }
    if (stats && speculative && res.draft_rounds > 0) {
        const double nr = (double)res.draft_rounds;
        fprintf(stderr, "dflash: per round: drafter pass %.3f ms, verify pass %.3f ms, GDN settle %.3f ms, drafter context "
                        "%.3f ms (wall time between the phases' ends)\n",
                res.draft_ms / nr, res.verify_ms / nr, res.settle_ms / nr, res.context_ms / nr);
    }
    if (stats)
        fprintf(stderr,
                "dflash: draft_rounds %d, draft_n %d, draft_n_accepted %d, tokens/round %.2f, acceptance %.3f, plain_steps "
                "%d%s%s\n",
                res.draft_rounds, res.draft_n, res.draft_n_accepted,
                res.draft_rounds ? (double)(res.draft_n_accepted + res.draft_rounds) / res.draft_rounds : 0.0,
                res.draft_n ? (double)res.draft_n_accepted / res.draft_n : 0.0, res.plain_steps,
                draft_quant == 8 ? ", drafter weights 8-bit" : (draft_quant == 4 ? ", drafter weights 4-bit" : ""),
                speculative ? "" : " (plain decoding)");
    if (res.finish == DF_FINISH_CANCELLED) rc = 130;
done:
    json_decref(message);
    df_gen_result_free(&res);
    df_chat_built_free(&built);
    df_api_request_free(&req);
    df_chat_setup_free(&cs);
    free(ids);
    df_draft_state_free(ds);
    df_drafter_free(drafter);
    df_session_free(sess);
    df_engine_free(eng);
    return rc;
}
