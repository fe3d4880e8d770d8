/* Generated-token bookkeeping shared by the plain and speculative loops: the id list,
 * UTF-8-safe incremental detokenisation, stop strings (matched across token boundaries,
 * never emitted), the caller's text callback and the finish reason. */
#ifndef DFLASH_DECODE_TEXTOUT_H
#define DFLASH_DECODE_TEXTOUT_H

#include "dflash/generate.h"

typedef struct df_textout {
    const df_tokenizer *tok;
    const df_gen_params *params;
    df_gen_callback cb;
    void *user;
    int32_t *ids;
    int n_ids, cap_ids;
    unsigned char pend[8]; /* bytes of an unfinished UTF-8 sequence */
    int n_pend;
    char *held;            /* decoded text not yet emitted (could start a stop string) */
    size_t n_held, cap_held;
    char *text;            /* emitted text */
    size_t n_text, cap_text;
    df_finish_reason finish;
    int stop_cut;          /* a stop string matched: text and logprobs end where it begins */
    df_token_info *info;   /* [n_info] per-token logprobs when the params ask for them */
    size_t *info_at;       /* [n_info] where each token's text begins in the text (bytes) */
    int n_info, cap_info;
    int n_released;        /* info[0..n_released) went to params->on_token */
} df_textout;

void df_textout_init(df_textout *o, const df_tokenizer *tok, const df_gen_params *params, df_gen_callback cb,
                     void *user);
/* Records one generated id. is_eos: the id ends generation (finish "stop", no text).
 * Sets o->finish when a stop string matched or the callback cancelled. Errors: DF_ERR_NOMEM. */
df_status df_textout_push(df_textout *o, int32_t id, int is_eos, df_error *err);
/* Records the logprobs of the token about to be pushed. They reach params->on_token once
 * text from that token on is emitted (just before the text callback that carries it), or at
 * the end; the tokens of a matched stop string (text from the cut on) never do, and are left
 * out of the result's token_info. A non-zero on_token return sets finish "cancelled".
 * Errors: DF_ERR_NOMEM. */
df_status df_textout_token_info(df_textout *o, const df_token_info *info, df_error *err);

/* Emits what is held (unless a stop string ended generation), hands the remaining logprobs
 * to on_token (not after a stop string or a cancellation) and moves ids/text/logprobs into
 * res (res->finish = o->finish, or "length" when none was set). */
void df_textout_finish(df_textout *o, df_gen_result *res);

/* Appends n bytes of possibly partial UTF-8 to dst, replacing invalid sequences by U+FFFD
 * and holding an unfinished trailing sequence in pend (*n_pend bytes). dst must have room
 * for 3*(n + *n_pend) bytes. Returns the bytes written. */
size_t df_utf8_sanitize(const unsigned char *src, size_t n, unsigned char pend[8], int *n_pend, int final,
                        char *dst);

/* The error of a token whose logits were not finite (df_argmax / df_sampler_sample gave -1):
 * DF_ERR_NUMERIC naming the generated token's index. */
df_status df_gen_non_finite(df_error *err, int index);

/* 1 if id ends generation: an EOS id of the pack or one of p->stop_ids. */
int df_gen_is_stop_id(const df_engine *eng, const df_gen_params *p, int32_t id);

#endif
