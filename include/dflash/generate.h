/* dflash: sampling and the generation loop.
 *
 * df_generate prefills a prompt into a fresh session and decodes until an EOS id of the
 * pack, a stop string, max_tokens, or cancellation by the callback. Text reaches the
 * callback in whole UTF-8 pieces; stop strings are matched across token boundaries and
 * never emitted (text that might begin a stop string is held back until it cannot).
 */
#ifndef DFLASH_GENERATE_H
#define DFLASH_GENERATE_H

#include <stddef.h>
#include <stdint.h>

#include "dflash/engine.h"
#include "dflash/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DF_MAX_STOP 16

/* An additive bias on one token's logit (OpenAI logit_bias). */
typedef struct df_logit_bias {
    int32_t id;
    float bias;
} df_logit_bias;

#define DF_MAX_LOGIT_BIAS 300
#define DF_MAX_TOP_LOGPROBS 20

typedef struct df_sampling_params {
    float temperature;   /* 0 = greedy (argmax; lowest id wins ties) */
    float top_p;         /* 1 = off */
    int top_k;           /* 0 = off */
    float min_p;         /* 0 = off */
    uint64_t seed;       /* with has_seed: same seed + same request = same output */
    int has_seed;
    /* logit processors, applied before sampling (and before greedy argmax):
     * repetition_penalty (1 = off; CTRL, Keskar et al. 2019 as in transformers: a seen
     * token's logit is divided by it when positive, multiplied when negative) over prompt
     * and generated tokens; presence_penalty / frequency_penalty (0 = off; OpenAI: minus
     * presence·[count>0] + frequency·count) over generated tokens; logit_bias added last. */
    float repetition_penalty, presence_penalty, frequency_penalty;
    const df_logit_bias *logit_bias;
    int n_logit_bias;
} df_sampling_params;

/* 1 if any logit processor of p is active (such requests cannot be decoded speculatively). */
int df_sampling_has_processors(const df_sampling_params *p);

/* Applies p's repetition/presence/frequency penalties and logit bias to logits[n_vocab]:
 * prompt[n_prompt] and gen[n_gen] are the tokens seen so far. */
void df_sampling_apply_processors(const df_sampling_params *p, float *logits, int n_vocab, const int32_t *prompt,
                                  int n_prompt, const int32_t *gen, int n_gen);

/* Sampling params with everything off (greedy). */
df_sampling_params df_sampling_default(void);

/* Log-probability of one token. */
typedef struct df_token_logprob {
    int32_t id;
    float logprob;
} df_token_logprob;

/* What one generated token had for log-probabilities: log_softmax of the processed logits
 * (after penalties and bias, before temperature and truncation), the chosen token's and the
 * n_top most likely (highest first, lower id first on ties). */
typedef struct df_token_info {
    int32_t id;
    float logprob;
    int n_top;
    df_token_logprob top[DF_MAX_TOP_LOGPROBS];
} df_token_info;

/* Fills info for token id from logits[n_vocab] with the n_top best (0..DF_MAX_TOP_LOGPROBS). */
void df_token_info_compute(df_token_info *info, const float *logits, int n_vocab, int32_t id, int n_top);

/* Histograms of the sampler's candidate selection (sampler.c). */
typedef struct df_sampler_work {
    uint32_t count[2048];
    double mass[2048];
} df_sampler_work;

/* A seeded sampler (xoshiro256** state). */
typedef struct df_sampler {
    df_sampling_params p;
    uint64_t rng[4];
    /* scratch, grown on demand */
    float *probs;
    int32_t *idx;
    df_sampler_work *work;
    int cap;
} df_sampler;

/* Initialises a sampler; without has_seed the seed comes from the clock. */
void df_sampler_init(df_sampler *s, const df_sampling_params *p);
void df_sampler_free(df_sampler *s);
/* Picks a token from logits[n_vocab] (logits are not modified). Greedy when temperature
 * is 0. Order of filters: top-k (the k best by logit, lower id first on ties), then softmax
 * with temperature over them, then top-p (the fewest best candidates whose probabilities sum to
 * at least top_p of theirs), then min-p (those with at least min_p times the best one's
 * probability). O(n_vocab) time, plus a sort of the few candidates that share a 22-bit
 * prefix of their logit with the last one each filter keeps. With 0 < top_k <= 64 (< n_vocab)
 * everything after the top-k is df_sample_top_list (backend.h), as a device computes it.
 * Returns -1 when the logits are not usable (a NaN among them, or an infinite maximum: a
 * broken pack or computation), as df_argmax. */
int32_t df_sampler_sample(df_sampler *s, float *logits, int n_vocab);
/* The largest top_k for which a sampler can draw from the top_k best candidates alone
 * (df_sampler_sample_top). */
#define DF_SAMPLE_TOP_MAX 64

/* 1 when s draws from the top_k best logits alone: temperature > 0, 0 < top_k <=
 * DF_SAMPLE_TOP_MAX, top_k < n_vocab, and no logit processors (penalties, bias) to apply first. */
int df_sampler_top_k_only(const df_sampler *s, int n_vocab);
/* df_sampler_sample from the k = top_k best candidates of a vocabulary of n_vocab (as a device
 * finds them, backend.h `top_k`): ids[0..k) and their logits vals[0..k) in rank order (logit
 * descending, lower id first on ties): the same token as df_sampler_sample on the full logits, for
 * the same sampler state. Requires df_sampler_top_k_only(s, n_vocab) and k == top_k. Returns -1
 * when ids[0] is -1 (the logits held a NaN), the best logit is infinite, or the list is not such
 * a list (an id outside the vocabulary, a NaN, values out of order). */
int32_t df_sampler_sample_top(df_sampler *s, const int32_t *ids, const float *vals, int k, int n_vocab);
/* The sampler's next 53 random bits (the uniform u·2^-53 of a draw): one per token drawn, as
 * df_sampler_sample and df_sampler_sample_top take them; for a device that draws the token
 * itself from the same stream (df_sample_top_list, backend.h sample_top_dev). */
uint64_t df_sampler_draw_bits(df_sampler *s);
/* argmax over logits[n]; lowest index wins ties. -1 when a logit is NaN or the maximum is
 * infinite (checked during the same scan). */
int32_t df_argmax(const float *logits, int n);

typedef enum df_finish_reason {
    DF_FINISH_NONE = 0,
    DF_FINISH_STOP,      /* EOS id or stop string */
    DF_FINISH_LENGTH,    /* max_tokens or context full */
    DF_FINISH_CANCELLED  /* the callback asked to stop */
} df_finish_reason;

const char *df_finish_reason_name(df_finish_reason r); /* "stop", "length", "cancelled" */

typedef struct df_gen_params {
    df_sampling_params sampling;
    int max_tokens;                   /* <= 0: until the context is full */
    const char *stop[DF_MAX_STOP];    /* stop strings (not emitted) */
    int n_stop;
    int skip_special;                 /* drop special tokens from the text (default 1) */
    int32_t stop_ids[DF_MAX_STOP];    /* extra token ids that end generation like EOS */
    int n_stop_ids;
    /* 1: compute df_token_info for the generated tokens whose text is (at least partly) in the
     * returned text: every token, except that a matched stop string's tokens (those whose
     * text begins where the stop string does, or later) are left out, as llama.cpp does */
    int logprobs;
    int top_logprobs;                 /* 0..DF_MAX_TOP_LOGPROBS alternatives per token */
    /* called with those token infos, in order, when logprobs is on: just before the text
     * callback that carries text from the token on (a token whose text is held back because
     * it might begin a stop string waits for it), or at the end for tokens without text (EOS);
     * a non-zero return stops generation like the text callback */
    int (*on_token)(void *user, const df_token_info *info);
    /* Test hook (the server's --test-hooks): the first n_forced_ids generated tokens are these
     * ids instead of the sampled ones; the model still runs every step and everything after
     * the choice (logprobs, detokenisation, stop strings, EOS) is unchanged. NULL/0 = off.
     * Plain decoding only (df_generate_speculative rejects it). */
    const int32_t *forced_ids;
    int n_forced_ids;
    /* Polled with the text callback's user pointer before each prefill chunk of up to 16
     * prompt tokens (the rows of one forward pass), so that a long prompt can be abandoned
     * within one chunk: a non-zero return ends the generation before its first token
     * (finish_reason "cancelled", no ids). During decoding the text callback's return value
     * serves the same purpose. NULL = prefill the whole prompt. */
    int (*should_stop)(void *user);
} df_gen_params;

df_gen_params df_gen_params_default(void);

/* Called for each piece of new text (may be empty when a token produced no whole text).
 * id: the token just generated. Return non-zero to stop (finish_reason "cancelled"). */
typedef int (*df_gen_callback)(void *user, int32_t id, const char *text, size_t len);

typedef struct df_gen_result {
    int32_t *ids;         /* generated ids (malloc'd; free with df_gen_result_free) */
    int n_ids;
    char *text;           /* generated text, NUL-terminated (stop strings removed) */
    size_t text_len;
    int n_prompt;
    df_finish_reason finish;
    double prompt_ms;     /* prefill wall time */
    double decode_ms;     /* wall time from the first decode to the end */
    /* speculative decoding statistics (0 for plain decoding) */
    int draft_rounds;     /* verify passes */
    int draft_n;          /* drafted tokens proposed */
    int draft_n_accepted; /* drafted tokens accepted (bonus tokens excluded) */
    int plain_steps;      /* rounds decoded as plain steps (the fallback's, and a last one-token step) */
    /* wall time of the rounds' phases, ms: drafter pass, verify pass, GDN state settling,
     * drafter context update (with df_spec_params.phase_sync off, work still queued on the
     * device at a phase's end is counted in the next phase) */
    double draft_ms, verify_ms, settle_ms, context_ms;
    /* [n_token_info] when params->logprobs, else NULL: the tokens of ids whose text is in
     * text (all of ids[0..n_token_info), which is n_ids unless a stop string matched) */
    df_token_info *token_info;
    int n_token_info;
} df_gen_result;

void df_gen_result_free(df_gen_result *r);

/* Decode speed in tokens per second: the tokens generated after the first of each
 * generation (the first comes from the prefill's logits and costs no decode step) over
 * decode_ms (df_gen_result.decode_ms, summed likewise); 0 when there are none. For one
 * result: df_decode_tokens_per_second(r->n_ids - 1, r->decode_ms). */
double df_decode_tokens_per_second(int tokens_after_first, double decode_ms);

/* Generates from prompt ids with a session of eng (the session is reset first). Greedy
 * decoding without logprobs or forced ids queues each step before the previous token is read,
 * so after a stop the session may hold one position past the last token: start the next
 * generation with df_generate again. Errors: DF_ERR_RANGE when the prompt does not fit the
 * session's context, DF_ERR_INVALID_ARG for bad ids or params, DF_ERR_NUMERIC when the model's
 * logits for a token are not finite (NaN, infinite maximum); the result is filled even when
 * stopped early. */
df_status df_generate(df_session *s, const int32_t *prompt, int n_prompt, const df_gen_params *params,
                      df_gen_callback cb, void *user, df_gen_result *res, df_error *err);

/* Renders OpenAI-style messages with plain ChatML framing (thinking off):
 * "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per message then
 * "<|im_start|>assistant\n<think>\n\n</think>\n\n". roles/contents: n entries.
 * Returns a malloc'd string. (The pack's Jinja template replaces this in issue 3.) */
char *df_chatml_render(const char *const *roles, const char *const *contents, int n, int enable_thinking);

#ifdef __cplusplus
}
#endif
#endif
