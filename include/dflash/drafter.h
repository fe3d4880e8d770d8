/* dflash: the DFlash block-diffusion drafter (MODEL.md §5; z-lab/dflash `DFlashDraftModel`).
 *
 * A drafter has no embedding or head of its own: it uses the target's embed_tokens and
 * lm_head. Its context is the target's residual stream at the tap layers
 * (dflash_config.target_layer_ids), fused per position by fc + hidden_norm; each layer keeps
 * the K/V of the last `window` context positions. One pass drafts a block: the last
 * committed token followed by mask tokens, attended non-causally over context + block.
 */
#ifndef DFLASH_DRAFTER_H
#define DFLASH_DRAFTER_H

#include <stdint.h>

#include "dflash/engine.h"
#include "dflash/pack.h"
#include "dflash/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DF_DRAFT_MAX_TAPS 16

#define DF_DRAFT_MAX_LAYERS 64

typedef struct df_drafter_config {
    int version;                 /* 1: DFlashDraftModel, 2: DFlash2DraftModel */
    int vocab_size;              /* the target vocabulary it was trained for (0: not given) */
    int num_target_layers;       /* the target's layer count it was trained for (0: not given) */
    int hidden_size, n_layers, n_heads, n_kv_heads, head_dim, intermediate_size;
    int block_size;              /* the drafter's trained block size */
    int32_t mask_token_id;
    int n_taps;
    int taps[DF_DRAFT_MAX_TAPS]; /* target layer ids whose outputs form the context */
    float rms_norm_eps, rope_theta;
    /* attention pattern: a layer is sliding when layer_types says "sliding_attention"; a
     * layer is causal inside the block when is_causal says so (absent: sliding layers are) */
    int sliding[DF_DRAFT_MAX_LAYERS];
    int causal[DF_DRAFT_MAX_LAYERS];
    int sliding_window;
    /* DFlash2 only (0 / 1 otherwise) */
    int conv_kernel, conv_group_size;  /* grouped dynamic causal convolution */
    int selector_rank, selector_top_k; /* candidate selector (0: argmax drafting) */
    float output_multiplier;           /* logits *= it */
    float final_logit_softcapping;     /* > 0: logits = cap·tanh(logits/cap) */
    float input_embedding_scale;       /* embeddings *= it */
} df_drafter_config;

typedef struct df_drafter df_drafter;

/* Loads a DFlash drafter folder — config.json with architectures ["DFlashDraftModel"] (v1)
 * or ["DFlash2DraftModel"] (v2: dynamic convolutions, sliding-window layers, output multiplier
 * and softcap, candidate selector; z-lab/dflash model_mlx.py) — and its bf16/f16/f32
 * safetensors, for the target pack of eng, and checks it
 * against the target (hidden size, tap layers, mask id inside the vocabulary). Errors:
 * DF_ERR_IO, DF_ERR_FORMAT, DF_ERR_MODEL (tensor missing/wrong/unexpected), DF_ERR_UNSUPPORTED
 * (another drafter architecture). */
df_status df_drafter_load(df_drafter **out, const char *dir, df_engine *eng, df_error *err);
/* The engine a drafter was loaded for (its backend runs the drafter). */
const df_engine *df_drafter_engine(const df_drafter *d);
/* Frees the drafter (before its engine, whose backend it tells that its files are unmapped). */
void df_drafter_free(df_drafter *d);

/* Quantizes the drafter's dense linears (fc and every layer's q, k, v, o, gate, up, down) at
 * load to MLX affine `bits`-bit codes (4 or 8) in groups of 64 columns with fp16 scale and
 * bias (min/max per group, rounded to nearest): about 2x (8-bit) or 4x (4-bit) fewer weight
 * bytes per draft pass. It changes the proposals, never the output: every drafted token is
 * verified by the target. Call before df_draft_state_init. Errors: DF_ERR_INVALID_ARG (bits,
 * or already quantized), DF_ERR_NOMEM. */
df_status df_drafter_quantize(df_drafter *d, int bits, df_error *err);
/* 0, or the bits of df_drafter_quantize. */
int df_drafter_quant_bits(const df_drafter *d);
const df_drafter_config *df_drafter_get_config(const df_drafter *d);

/* Per-sequence drafter state: the context K/V window. */
typedef struct df_draft_state df_draft_state;

/* window: context positions kept (>= 1). Errors: DF_ERR_NOMEM. */
df_status df_draft_state_init(df_draft_state **out, df_drafter *d, int window, df_error *err);
void df_draft_state_free(df_draft_state *st);
/* Forgets the context. */
void df_draft_state_reset(df_draft_state *st);
/* The drafter and the window of a state. */
df_drafter *df_draft_state_drafter(const df_draft_state *st);
int df_draft_state_window(const df_draft_state *st);
/* Context positions currently held (<= window). */
int df_draft_state_len(const df_draft_state *st);

/* Appends n context rows: feats [n, n_taps*hidden] (the tap outputs concatenated in
 * target_layer_ids order) at positions first_pos .. first_pos+n-1. Only the last `window`
 * rows are kept. Errors: DF_ERR_NOMEM. */
df_status df_draft_add_context(df_draft_state *st, const float *feats, int n, int32_t first_pos, df_error *err);
/* The same with feats [n, n_taps*hidden] in the memory of the drafter's backend (no host
 * transfer): the taps the speculative loop gathers there. */
df_status df_draft_add_context_device(df_draft_state *st, const float *feats, int n, int32_t first_pos,
                                      df_error *err);

/* Drafts a block of B rows (2 <= B <= 16): row 0 = `bonus` at position p0, rows 1..B-1 =
 * mask tokens. drafts[B-1] receives the proposals for rows 1..B-1: the argmax of their
 * logits through the target's lm_head (× output_multiplier, softcapped), or for a DFlash2
 * drafter with a selector the greedy selector path: per row, among the selector_top_k
 * highest logits, the candidate c maximising logit(c) + Σ_r pred[prev]_r·p_r·succ[c]_r with
 * p = hidden_projection(h_row) and prev the previous pick (the bonus for row 1). A row whose
 * logits are not finite proposes token 0 (a draft only proposes; the target decides).
 * Optional outputs: hidden [B, hidden] (after the final norm), logits [B-1, vocab].
 * Errors: DF_ERR_INVALID_ARG (B), DF_ERR_NOMEM. */
df_status df_draft_block(df_draft_state *st, int32_t bonus, int32_t p0, int B, int32_t *drafts, float *hidden,
                         float *logits, df_error *err);

/* 1 when df_draft_block_dev can draft with st: the proposals are the plain argmax of the
 * logits (no selector, output multiplier or softcapping) and the drafter's backend keeps ids in
 * its memory (df_backend_ops.argmax_dev). */
int df_draft_device_ok(const df_draft_state *st);
/* df_draft_block's proposals written to drafts[B-1] in the memory of the drafter's backend
 * (a row whose logits are not finite proposes 0), recorded without waiting for the device.
 * Errors: DF_ERR_UNSUPPORTED (!df_draft_device_ok), DF_ERR_INVALID_ARG (B), DF_ERR_NOMEM. */
df_status df_draft_block_dev(df_draft_state *st, int32_t bonus, int32_t p0, int B, int32_t *drafts, df_error *err);

#ifdef __cplusplus
}
#endif
#endif
