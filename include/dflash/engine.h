/* dflash: the engine — a loaded pack with its tokenizer, and sessions that prefill and
 * decode on it.
 *
 * df_engine owns the pack (weights), the tokenizer and the compute backend (thread pool).
 * df_session owns one sequence's state: the attention KV cache and the Gated DeltaNet
 * conv/recurrent states. A session is used by one thread at a time; an engine may serve
 * several sessions (one at a time in this version).
 */
#ifndef DFLASH_ENGINE_H
#define DFLASH_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "dflash/pack.h"
#include "dflash/status.h"
#include "dflash/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct df_engine df_engine;
typedef struct df_session df_session;

typedef struct df_engine_options {
    int n_threads;      /* 0 = number of online CPUs */
    const char *device; /* compute backend: NULL or "cpu" (default), "cuda" (the first GPU; needs a
                           build with the CUDA backend, else df_engine_load fails with
                           DF_ERR_UNSUPPORTED) */
} df_engine_options;

/* Loads the pack in dir (df_pack_load) and its tokenizer.json, and starts the backend named
 * by opt->device. Errors as df_pack_load and df_tokenizer_load, prefixed with the file;
 * DF_ERR_INVALID_ARG for an unknown device name; DF_ERR_UNSUPPORTED for "cuda" in a build
 * without the CUDA backend or on a machine without a GPU. */
df_status df_engine_load(df_engine **out, const char *dir, const df_engine_options *opt, df_error *err);
void df_engine_free(df_engine *eng);

const df_pack *df_engine_pack(const df_engine *eng);
const df_tokenizer *df_engine_tokenizer(const df_engine *eng);
int df_engine_vocab_size(const df_engine *eng);   /* logits width (embedding rows) */
int df_engine_n_threads(const df_engine *eng);
/* 1 if id is one of the pack's EOS ids. */
int df_engine_is_eos(const df_engine *eng, int32_t id);

/* A session with room for max_ctx positions (0 = the pack's max_position_embeddings,
 * capped at 32768). Errors: DF_ERR_NOMEM, DF_ERR_INVALID_ARG. */
df_status df_session_init(df_session **out, df_engine *eng, int max_ctx, df_error *err);
void df_session_free(df_session *s);
/* Forgets the sequence (position 0, zero states). */
void df_session_reset(df_session *s);
/* Current number of positions in the cache. */
int df_session_pos(const df_session *s);
int df_session_max_ctx(const df_session *s);

/* Runs n tokens at positions pos..pos+n-1 (prefill path). If logits != NULL it receives
 * the logits of the last token [vocab] (float32). Errors: DF_ERR_RANGE past max_ctx,
 * DF_ERR_INVALID_ARG for an id outside [0, vocab). */
df_status df_session_prefill(df_session *s, const int32_t *ids, int n, float *logits, df_error *err);

/* As df_session_prefill but returns the logits of every token: logits [n, vocab]. */
df_status df_session_prefill_all(df_session *s, const int32_t *ids, int n, float *logits, df_error *err);

/* One decode step: token id at the current position; logits [vocab]. */
df_status df_session_decode(df_session *s, int32_t id, float *logits, df_error *err);

/* Test hook: capture the hidden states of the next prefill. hidden must hold
 * (n_layers + 2) planes of [n, hidden] float32: plane 0 = embeddings, plane i (1..n_layers)
 * = residual stream after layer i-1, plane n_layers+1 = after the final norm. Pass NULL to
 * stop capturing. The buffer must stay valid through the prefill. */
void df_session_capture_hidden(df_session *s, float *hidden);

#ifdef __cplusplus
}
#endif
#endif
