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
} df_spec_params;

/* Defaults: block 0 (= df_spec_default_block), fixed, range 2..16 when adaptive. */
df_spec_params df_spec_params_default(void);

/* The block size used when none is given: 4, or the drafter's trained block size when that is
 * smaller. A block of B rows costs one verify pass of B rows plus a drafter pass; measured on
 * the H200 (docs/PERFORMANCE.md) a verify pass of 4 rows costs 1.22x one decode step and one of
 * 16 rows 3.8x, so at the acceptance rates this drafter reaches (2.7 to 4.5 tokens per round
 * with block 16) block 4 is the fastest fixed choice: 1.75x / 2.62x plain, where block 8 is
 * 1.15x / 1.90x and block 16 0.63x / 1.02x. */
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
