/* dflash: DFlash speculative decoding, token-identical to plain greedy decoding
 * (MODEL.md §6).
 *
 * A round: the drafter proposes d_1..d_{B-1} after the last committed token b (at position
 * p0); the target verifies [b, d_1..d_{B-1}] in one pass whose every row is computed with the
 * arithmetic of a single-token decode step; with t_i the target's argmax after row i, the
 * longest prefix with d_k == t_{k-1} is accepted and t_a is committed after it. Rollback:
 * the attention KV cache is trimmed to p0+a+1 positions; each Gated DeltaNet layer's conv and
 * recurrent states are restored from a start-of-round snapshot and the accepted rows 0..a
 * are replayed from the projections recorded during the verify pass (same op, same bits).
 * Memory for rollback: one copy of the GDN states (conv (K-1)·C + nv·dk·dv floats per GDN
 * layer) plus B rows of projections (C + Vd + 2·nv floats per GDN layer).
 */
#ifndef DFLASH_SPECULATIVE_H
#define DFLASH_SPECULATIVE_H

#include "dflash/drafter.h"
#include "dflash/generate.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Replaces the drafter's proposals (tests and speed-at-given-acceptance measurements): called
 * after the drafter ran, with n_generated tokens committed so far (the bonus b included) and
 * drafts[B-1] holding the drafter's argmax proposals, which it may overwrite. */
typedef void (*df_propose_override_fn)(void *user, int n_generated, int32_t bonus, int B, int32_t *drafts);

typedef struct df_spec_params {
    int block;          /* fixed block size (2..16), or the starting size when adaptive; 0 = drafter's */
    int adaptive;       /* 1: grow on full hits, shrink on low acceptance, within [block_min, block_max] */
    int block_min, block_max;
    df_propose_override_fn override;
    void *override_user;
    int phase_sync;     /* 1: wait for the device at each phase's end, so that the result's phase
                         * times (draft_ms ...) are each phase's own (benchmarks; slightly slower) */
    int no_fallback;    /* 1: draft every round. 0 (default): when the drafted rounds are measured
                         * slower per token than plain decoding steps, decode plainly for a while
                         * (df_spec_fallback) and then try drafting again; the output is the same */
} df_spec_params;

/* The plain-step fallback of df_generate_speculative (df_spec_params.no_fallback = 0). Its
 * state is per generation; times are wall milliseconds per committed token of each round.
 * Drafting loses when 4 drafted rounds in a row commit one token each (no draft accepted: each
 * cost a drafter pass and a verify pass of several rows for one token), or when the mean time
 * per token of the last 4 drafted rounds exceeds the fastest plain step seen (the first 2
 * drafted rounds, which warm graphs and caches, are not timed; 2 plain steps are timed once,
 * after the first 4 timed rounds). When drafting loses, the next `hold` rounds are plain steps
 * (hold starts at 8 and doubles, up to 256, each time drafting loses again; it is reset to 8
 * when a timed window wins), then drafting is tried afresh. A plain step here is a verify pass
 * of one row; the drafter's context still follows every token. */
typedef struct df_spec_fallback {
    double plain_best;        /* fastest plain step, ms per token (< 0: none timed yet) */
    double recent[4];         /* the last drafted rounds, ms per token */
    int n_recent, warm, plain_left, hold, zero_run;
} df_spec_fallback;

/* A fresh fallback state. */
void df_spec_fallback_init(df_spec_fallback *f);
/* 1 when the next round should draft, 0 for a plain step. */
int df_spec_fallback_draft(const df_spec_fallback *f);
/* Records a round: drafted (1) or plain (0), its wall time in ms and the tokens it committed. */
void df_spec_fallback_record(df_spec_fallback *f, int drafted, double ms, int tokens);

/* Defaults: block 0 (= df_spec_default_block), fixed, range 2..16 when adaptive. */
df_spec_params df_spec_params_default(void);

/* The block size used when none is given: 4, or the drafter's trained block size when that is
 * smaller. A block of B rows costs one verify pass of B rows plus a drafter pass; measured on
 * the H200 (docs/PERFORMANCE.md) a verify pass of 4 rows costs 1.22x one decode step and one of
 * 16 rows 3.8x, so at the acceptance rates this drafter reaches (2.7 to 4.5 tokens per round
 * with block 16) block 4 is the fastest fixed choice: 1.79x / 2.47x plain, where block 8 is
 * 1.07x / 1.84x and block 16 below 1x (0.63x / 1.02x when last measured). */
int df_spec_default_block(const df_drafter_config *dc);

/* Greedy generation with speculative decoding. s: a session of the drafter's target engine;
 * ds: a drafter state (reset here). params->sampling must be greedy (temperature 0). The
 * result carries draft_rounds / draft_n / draft_n_accepted. Errors as df_generate, plus
 * DF_ERR_INVALID_ARG for sampled params or block sizes outside 2..16. */
df_status df_generate_speculative(df_session *s, df_draft_state *ds, const int32_t *prompt, int n_prompt,
                                  const df_gen_params *params, const df_spec_params *sp, df_gen_callback cb,
                                  void *user, df_gen_result *res, df_error *err);

#ifdef __cplusplus
}
#endif
#endif
