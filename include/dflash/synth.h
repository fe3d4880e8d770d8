/* dflash: synthetic packs with production shapes and random weights, for speed and memory
 * measurements without the real 27B pack (never for quality).
 *
 * df_synth_pack writes, into out_dir:
 *   config.json          model_type prism_hadamard_qwen35 with the text shapes of the preset
 *                        (MODEL.md §1), quantization {bits 2, group 128, affine}, and the
 *                        Hadamard `modules` manifest (every quantized linear and lm_head with
 *                        the preset's block, plus the embedding with embedding: true)
 *   model.safetensors    ternary 2-bit codes (q in {0,1,2}, uniform over the rows), fp16
 *                        scales ~ sqrt(2/in) with biases = -scales, float32 signs ±1, fp16
 *                        norms ~1, dense fp16 in_proj_a/b, fp16 conv1d, float32 A_log
 *   tokenizer.json        (+ tokenizer_config.json, chat_template.jinja when present) copied
 *                        from tokenizer_dir: its vocabulary may be smaller than the embedding
 *                        (padded rows)
 *   drafter/             (when drafter != 0) a DFlash v1 drafter (DFlashDraftModel) with the
 *                        preset's drafter shapes, bf16 weights
 * Presets: "27b" (hidden 5120, 64 layers, 24/4 heads x 256, GDN 16/48 x 128, intermediate 17408,
 * vocab 248320, Hadamard block 1024; drafter 5 layers, 32/8 heads x 128, taps 5,19,33,47,61,
 * block 16, mask 248070: about 7.6 GB + 3.5 GB) and "tiny" (hidden 256, 4 layers; a few MB, for
 * tests). Values come from a counter-based generator seeded by `seed`, so the output does not
 * depend on the thread count.
 */
#ifndef DFLASH_SYNTH_H
#define DFLASH_SYNTH_H

#include <stdint.h>

#include "dflash/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct df_synth_options {
    const char *preset;        /* "27b" or "tiny" */
    const char *out_dir;       /* created if missing */
    const char *tokenizer_dir; /* folder holding tokenizer.json (e.g. models/demo) */
    int drafter;               /* 1: also write out_dir/drafter */
    uint64_t seed;
    int n_threads;             /* 0 = online CPUs */
    /* optional progress report (bytes written so far of total) */
    void (*progress)(void *user, const char *file, double done_bytes, double total_bytes);
    void *progress_user;
} df_synth_options;

/* Writes the pack. Errors: DF_ERR_INVALID_ARG (unknown preset, missing out_dir),
 * DF_ERR_IO (a file could not be created, written or copied; the message names it),
 * DF_ERR_NOMEM. */
df_status df_synth_pack(const df_synth_options *opt, df_error *err);

#ifdef __cplusplus
}
#endif
#endif
