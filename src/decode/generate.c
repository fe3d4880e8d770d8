/* The plain generation loop (include/dflash/generate.h): prefill (polling params->should_stop
 * between chunks), then one decode step per token, with incremental UTF-8-safe detokenisation
 * and stop strings that are matched across token boundaries and never emitted. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threads.h"
#include "decode/textout.h"
#include "dflash/generate.h"
#include "model/target.h"

df_gen_params df_gen_params_default(void) {
    df_gen_params p;
    memset(&p, 0, sizeof p);
    p.sampling = df_sampling_default();
    p.max_tokens = 256;
    p.skip_special = 1;
    return p;
}

int df_gen_is_stop_id(const df_engine *eng, const df_gen_params *p, int32_t id) {
    if (df_engine_is_eos(eng, id)) return 1;
    for (int i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] == id) return 1;
    return 0;
}

double df_decode_tokens_per_second(int tokens_after_first, double decode_ms) {
    return tokens_after_first > 0 && decode_ms > 0 ? tokens_after_first * 1000.0 / decode_ms : 0.0;
}

df_status df_gen_non_finite(df_error *err, int index) {
    char at[64];
    if (index == 0) snprintf(at, sizeof at, "at the first generated token");
    else snprintf(at, sizeof at, "at generated token %d (0-based position)", index);
    return df_error_set(err, DF_ERR_NUMERIC,
                        "the model produced non-finite logits (NaN or infinity) %s: the pack's weights or the "
                        "computation are broken",
                        at);
}

const char *df_finish_reason_name(df_finish_reason r) {
    switch (r) {
    case DF_FINISH_STOP: return "stop";
    case DF_FINISH_LENGTH: return "length";
    case DF_FINISH_CANCELLED: return "cancelled";
    case DF_FINISH_NONE: break;
    }
    return "none";
}

void df_gen_result_free(df_gen_result *r) {
    if (!r) return;
    free(r->ids);
    free(r->text);
    free(r->token_info);
    memset(r, 0, sizeof *r);
}

df_status df_generate(df_session *s, const int32_t *prompt, int n_prompt, const df_gen_params *params,
                      df_gen_callback cb, void *user, df_gen_result *res, df_error *err) {
    memset(res, 0, sizeof *res);
    res->n_prompt = n_prompt;
    df_engine *eng = s->eng;
    const int V = eng->pack->cfg.vocab_size;
    if (n_prompt <= 0) return df_error_set(err, DF_ERR_INVALID_ARG, "empty prompt");
    if (n_prompt >= s->max_ctx)
        return df_error_set(err, DF_ERR_RANGE, "prompt of %d tokens does not fit the context of %d", n_prompt,
                            s->max_ctx);
    for (int i = 0; i < params->n_stop; i++)
        if (!params->stop[i] || !params->stop[i][0])
            return df_error_set(err, DF_ERR_INVALID_ARG, "stop string %d is empty", i);
    float *logits = malloc((size_t)V * sizeof(float));
    if (!logits) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    df_textout out;
    df_textout_init(&out, eng->tok, params, cb, user);
    df_sampler sm;
    df_sampler_init(&sm, &params->sampling);
    df_session_reset(s);

    double t0 = df_now_ms();
    int stopped = 0;
    df_status st = df_target_prefill(s, prompt, n_prompt, logits, params->should_stop, user, &stopped, err);
    if (stopped) out.finish = DF_FINISH_CANCELLED;
    double t1 = df_now_ms();
    res->prompt_ms = t1 - t0;
    int cap_tokens = s->max_ctx - n_prompt;
    int max_tokens = params->max_tokens > 0 && params->max_tokens < cap_tokens ? params->max_tokens : cap_tokens;
    const int processors = df_sampling_has_processors(&params->sampling);
    /* greedy without logprobs needs no logits on the host: each step's token comes from the
     * backend's argmax (the same token as df_argmax of the logits: backend.h), 4 bytes read
     * back instead of the vocabulary's logits */
    const int backend_argmax = !(params->sampling.temperature > 0.0f) && !processors && !params->logprobs;
    /* likewise a sampler with a small top-k and nothing else to apply to the logits first draws
     * from the k best, which the backend finds (the same token: df_sampler_sample_top) */
    const int backend_top_k = !backend_argmax && !params->logprobs && s->be->ops->top_k &&
                              df_sampler_top_k_only(&sm, V);
    /* and when no forced id can replace a token, each step is queued before the token of the
     * step before it is read (df_ahead): greedy, or sampled where the backend draws the token
     * itself (the same token again: df_sample_top_list) */
    const df_backend_ops *ops = s->be->ops;
    const int ahead = params->n_forced_ids == 0 &&
                      (backend_argmax || (backend_top_k && ops->sample_top_dev && ops->embed_dev && ops->read_ahead));
    df_ahead gr;
    int ahead_on = 0;
    const int K = params->sampling.top_k;
    int32_t next = -1; /* backend_argmax: the token of the last decode step */
    int32_t top_ids[DF_SAMPLE_TOP_MAX];
    float top_vals[DF_SAMPLE_TOP_MAX];
    int have_next = 0, have_top = 0;
    while (st == DF_OK && out.finish == DF_FINISH_NONE) {
        int32_t id;
        if (ahead_on) {
            st = df_ahead_next(s, &gr, out.n_ids + 1 < max_tokens, &id, err);
            if (st != DF_OK) break;
        } else if (have_next) {
            id = next;
        } else if (have_top) {
            id = df_sampler_sample_top(&sm, top_ids, top_vals, K, V);
        } else {
            if (processors)
                df_sampling_apply_processors(&params->sampling, logits, V, prompt, n_prompt, out.ids, out.n_ids);
            id = df_sampler_sample(&sm, logits, V);
        }
        if (id < 0) {
            st = df_gen_non_finite(err, out.n_ids);
            break;
        }
        if (out.n_ids < params->n_forced_ids && params->forced_ids[out.n_ids] >= 0 &&
            params->forced_ids[out.n_ids] < V)
            id = params->forced_ids[out.n_ids];
        if (params->logprobs) {
            df_token_info info;
            df_token_info_compute(&info, logits, V, id, params->top_logprobs);
            st = df_textout_token_info(&out, &info, err);
            if (st != DF_OK) break;
        }
        st = df_textout_push(&out, id, df_gen_is_stop_id(eng, params, id), err);
        if (st != DF_OK || out.finish != DF_FINISH_NONE) break;
        if (out.n_ids >= max_tokens) {
            out.finish = DF_FINISH_LENGTH;
            break;
        }
        if (ahead) {
            if (!ahead_on) st = df_ahead_begin(s, &gr, id, backend_argmax ? NULL : &sm, err); /* then df_ahead_next */
            ahead_on = 1;
        } else if (backend_argmax) {
            st = df_target_forward_argmax(s, &id, 1, &next, err);
            have_next = 1;
        } else if (backend_top_k) {
            st = df_target_forward_top_k(s, id, K, top_ids, top_vals, err);
            have_top = 1;
        } else {
            st = df_session_decode(s, id, logits, err);
        }
    }
    if (ahead_on) df_ahead_end(s, &gr);
    res->decode_ms = df_now_ms() - t1;
    df_textout_finish(&out, res);
    df_sampler_free(&sm);
    free(logits);
    return st;
}

char *df_chatml_render(const char *const *roles, const char *const *contents, int n, int enable_thinking) {
    size_t len = 64;
    for (int i = 0; i < n; i++) len += strlen(roles[i]) + strlen(contents[i]) + 32;
    char *p = malloc(len), *w = p;
    if (!p) return NULL;
    for (int i = 0; i < n; i++) w += sprintf(w, "<|im_start|>%s\n%s<|im_end|>\n", roles[i], contents[i]);
    w += sprintf(w, "<|im_start|>assistant\n%s", enable_thinking ? "<think>\n" : "<think>\n\n</think>\n\n");
    return p;
}
