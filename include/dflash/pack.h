/* dflash: a model pack (config + tensors) bound to the Qwen3.5 hybrid architecture.
 *
 * A pack is a folder: config.json, *.safetensors (+ model.safetensors.index.json when
 * sharded), tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json.
 * df_pack_load parses config.json (model_type "qwen3_5" or "prism_hadamard_qwen35"; text
 * fields under "text_config" or at top level; layer_types or full_attention_interval),
 * maps the tensors, and binds every tensor the architecture needs (mlx-vlm names,
 * MODEL.md §2) into df_pack, checking presence, dtype and shape, the quantization of each
 * module (MLX affine, bits 2/3/4/5/6/8, group 32/64/128, per-module overrides in
 * "quantization", `false` = not quantized; a module is quantized iff `.scales` exists) and
 * the Hadamard manifest ("modules": path, block, embedding, signs). A tensor no part of the
 * architecture uses is an error naming it ("vision_tower.*" tensors are accepted and
 * left unbound: the vision tower is a separate module).
 *
 * Also accepted: model_type "qwen3_5_text" (a text-only HF config), "quantization_config"
 * as the name of "quantization", rope fields under "rope_scaling", HF conv layout
 * [C, 1, K]. Defaults when absent: head_dim = hidden/heads, conv kernel 4, rms_norm_eps 1e-6,
 * max_position_embeddings 32768, rope_theta 1e7, partial_rotary_factor 0.25,
 * mrope_section {rot/2, 0, 0} (plain partial RoPE), full_attention_interval 4. in_proj_a/b
 * must be dense; Hadamard signs must be exactly +1/-1.
 */
#ifndef DFLASH_PACK_H
#define DFLASH_PACK_H

#include <stdint.h>

#include "dflash/safetensors.h"
#include "dflash/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A linear map y = W x, W of shape [rows(out), cols(in)].
 * Quantized (bits > 0, MLX affine): w is uint32 [rows, cols*bits/32]; element e of a
 *   little-endian word occupies bits [bits*e, bits*e+bits) (values straddle words for 3/5/6
 *   bits: the packed stream is a little-endian bit stream per row); scales/biases are
 *   F16 or BF16 [rows, cols/group_size]; w = scale*q + bias per group.
 * Dense (bits == 0): w is F16/BF16/F32 [rows, cols] (dtype in wdtype).
 * Hadamard (hadamard_block > 0): the input is rotated first, x' = Hn(signs ⊙ x) with a
 *   Sylvester Walsh–Hadamard transform on each hadamard_block-wide chunk scaled by
 *   1/sqrt(block) (MODEL.md §2; kept in float32, which is what the reference outputs match). signs: float32 [cols]. */
typedef struct df_linear {
    const char *name;      /* module path, e.g. "language_model.model.layers.0.mlp.up_proj" */
    int rows, cols;
    int bits;              /* 0 = dense */
    int group_size;        /* quantized only */
    df_dtype wdtype;       /* DF_DTYPE_U32 when quantized */
    const void *w;
    df_dtype sdtype;       /* dtype of scales and biases (F16 or BF16) */
    const void *scales;    /* [rows, cols/group_size] */
    const void *biases;    /* [rows, cols/group_size] */
    int hadamard_block;    /* 0 = no rotation */
    const float *signs;    /* [cols] when hadamard_block > 0 */
} df_linear;

/* 1 when L is quantized with 16-bit scales and every bias is its scale with the sign bit
 * flipped, bit for bit (w = s·q − s: the ternary codes of MODEL.md §2, w ∈ {−s, 0, s}), so that
 * the biases need not be stored or read; 0 otherwise. Reads every scale and bias (host memory,
 * rows·cols/group_size each). */
int df_linear_biases_negate_scales(const df_linear *L);

/* A small vector (norm weights, A_log, dt_bias, conv weights) converted to float32 at load
 * (exact for f16/bf16). Owned by the pack. */
typedef struct df_vecf {
    float *data;
    int64_t n;
} df_vecf;

typedef enum df_layer_kind { DF_LAYER_LINEAR_ATTENTION = 0, DF_LAYER_FULL_ATTENTION = 1 } df_layer_kind;

typedef struct df_layer_weights {
    df_layer_kind kind;
    df_vecf input_norm;    /* [hidden], stored as 1+w in MLX packs: multiply by it */
    df_vecf post_norm;     /* [hidden] */
    /* full attention */
    df_linear q_proj;      /* [n_heads*2*head_dim, hidden]: per head q then gate */
    df_linear k_proj;      /* [n_kv*head_dim, hidden] */
    df_linear v_proj;      /* [n_kv*head_dim, hidden] */
    df_linear o_proj;      /* [hidden, n_heads*head_dim] */
    df_vecf q_norm;        /* [head_dim] (1+w stored) */
    df_vecf k_norm;        /* [head_dim] */
    /* Gated DeltaNet */
    df_linear in_proj_qkv; /* [2*Kd+Vd, hidden] */
    df_linear in_proj_z;   /* [Vd, hidden] */
    df_linear in_proj_b;   /* [nv, hidden] (dense) */
    df_linear in_proj_a;   /* [nv, hidden] (dense) */
    df_linear out_proj;    /* [hidden, Vd] */
    df_vecf conv1d;        /* [C*K] row-major [C][K] (MLX [C,K,1] and HF [C,1,K] both give this) */
    df_vecf gdn_norm;      /* [dv], plain weight (no offset) */
    df_vecf A_log;         /* [nv] */
    df_vecf dt_bias;       /* [nv] */
    /* MLP */
    df_linear gate_proj;   /* [intermediate, hidden] */
    df_linear up_proj;     /* [intermediate, hidden] */
    df_linear down_proj;   /* [hidden, intermediate] */
} df_layer_weights;

#define DF_MAX_EOS 8

typedef struct df_text_config {
    char model_type[64];        /* "qwen3_5" or "prism_hadamard_qwen35" */
    int hidden_size;
    int n_layers;
    int n_heads, n_kv_heads, head_dim;
    int lin_n_k_heads, lin_n_v_heads, lin_k_head_dim, lin_v_head_dim;
    int conv_kernel;
    int intermediate_size;
    int vocab_size;             /* embedding rows */
    int max_position_embeddings;
    float rms_norm_eps;
    float rope_theta;
    float partial_rotary_factor;
    int mrope_section[3];
    int mrope_interleaved;
    int tie_word_embeddings;
    int n_eos;
    int32_t eos_ids[DF_MAX_EOS];  /* union of config.json and generation_config.json eos ids */
    df_layer_kind *layer_kinds;   /* [n_layers], owned */
} df_text_config;

/* Defaults from generation_config.json (has_* = 0 when absent). */
typedef struct df_generation_defaults {
    int has_temperature, has_top_p, has_top_k, has_min_p, has_repetition_penalty;
    float temperature, top_p, min_p, repetition_penalty;
    int top_k;
} df_generation_defaults;

typedef struct df_pack {
    char *dir;                     /* the folder it was loaded from */
    df_text_config cfg;
    df_generation_defaults gen;
    df_tensor_set *tensors;
    df_linear embed;               /* [vocab, hidden]; hadamard_block > 0 = inverse-rotated on lookup */
    df_layer_weights *layers;      /* [n_layers] */
    df_vecf final_norm;            /* [hidden] */
    df_linear lm_head;             /* [vocab, hidden] (== embed when tied) */
} df_pack;

/* Loads and validates a pack folder. Errors: DF_ERR_IO, DF_ERR_FORMAT (config or file),
 * DF_ERR_MODEL (tensor missing / wrong dtype / wrong shape / unexpected, quantization or
 * Hadamard manifest inconsistent), DF_ERR_UNSUPPORTED, DF_ERR_NOMEM. The message names the
 * file and the tensor or field. */
df_status df_pack_load(df_pack **out, const char *dir, df_error *err);
void df_pack_free(df_pack *pack);

/* Parses only config.json of a folder (or a JSON text) into cfg. Same errors. */
df_status df_text_config_parse(df_text_config *cfg, const char *json_text, df_error *err);
void df_text_config_free(df_text_config *cfg);

/* The model's vocabulary size (embedding rows, config.json's vocab_size) of the pack in
 * folder dir, from its config.json alone. Errors: those of df_text_config_parse, DF_ERR_IO
 * for the file. */
df_status df_pack_vocab_size(const char *dir, int *vocab, df_error *err);

/* Parses a generation_config.json text into gen (sampling defaults; has_* = 1 for each
 * field present: temperature >= 0, top_p in (0, 1], top_k >= 0, min_p in [0, 1],
 * repetition_penalty > 0). When cfg is non-NULL its eos_token_id (an id or a list) is
 * merged into cfg->eos_ids (ids must be < cfg->vocab_size). Errors: DF_ERR_FORMAT naming
 * the field. */
df_status df_generation_config_parse(df_generation_defaults *gen, df_text_config *cfg,
                                     const char *json_text, df_error *err);

#ifdef __cplusplus
}
#endif
#endif
