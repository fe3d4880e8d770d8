/* The compute backend interface: every op the target and the drafter run.
 *
 * The model code (src/model) calls these ops and never branches on the device. A backend
 * owns its memory: activation buffers come from alloc and are passed back to its ops;
 * weights are the pack's df_linear / df_vecf (host memory), which a device backend
 * resolves to its own copies.
 *
 * Exactness contract (ENGINEERING.md): every op that takes M rows computes row m with
 * exactly the arithmetic it would use for that row alone (M = 1): reductions have a fixed
 * order that depends only on the reduction length; threads split output elements, never
 * a reduction; results do not depend on the thread count.
 */
#ifndef DFLASH_BACKEND_H
#define DFLASH_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "dflash/pack.h"
#include "dflash/status.h"

/* Rows per op call: the verify block size limit and the prefill chunk. */
#define DF_MAX_ROWS 16

typedef struct df_backend df_backend;

/* Geometry of a gated-attention layer (MODEL.md §1). */
typedef struct df_attn_shape {
    int n_heads, n_kv_heads, head_dim;
    int rot_dims;           /* rotary dims (head_dim * partial_rotary_factor), even */
    int mrope_section[3];   /* interleaved M-RoPE sections (text: all axes equal) */
    float rope_theta;
    float eps;              /* q_norm / k_norm epsilon */
    int gated;              /* 1: q_proj gives [q | gate] per head (target); 0: plain q (drafter) */
    int causal;             /* 1: row m sees cache positions <= its own; 0: all rows of the call */
    int sliding_window;     /* > 0 (non-causal drafter blocks): row m sees only the cache entries
                             * before pos0 at index > pos0 + m - sliding_window (the context is
                             * contiguous and ends right before the block), plus the block */
} df_attn_shape;

/* Geometry of a Gated DeltaNet layer. */
typedef struct df_gdn_shape {
    int n_k_heads, n_v_heads, k_head_dim, v_head_dim;
    int conv_kernel;        /* K */
    float eps;              /* gated RMSNorm epsilon */
} df_gdn_shape;

/* One layer of the gdn_states op: as the arguments of `gdn` (backend memory but for the
 * weights, which are the pack's). */
typedef struct df_gdn_layer {
    const float *qkv, *z, *a, *b;
    const float *conv_w, *A_log, *dt_bias, *norm_w;
    float *conv_state, *S;
} df_gdn_layer;

/* A draw from the k best logits of a row (sample_top_dev, df_sample_top_list): 1 <= k <= 64,
 * temperature > 0, top_p and min_p as in df_sampling_params (off: top_p >= 1 or <= 0, min_p <=
 * 0). */
typedef struct df_top_draw {
    int k;
    float temperature, top_p, min_p;
} df_top_draw;

typedef struct df_backend_ops {
    const char *name;
    void (*destroy)(df_backend *be);
    /* Memory: alloc returns zeroed memory of the device (NULL on failure). */
    void *(*alloc)(df_backend *be, size_t bytes);
    void (*dealloc)(df_backend *be, void *p);
    void (*to_device)(df_backend *be, void *dst, const void *src, size_t bytes);
    void (*to_host)(df_backend *be, void *dst, const void *src, size_t bytes);
    void (*copy)(df_backend *be, void *dst, const void *src, size_t bytes);
    /* rows rows of row_bytes bytes: row r from src + r·src_pitch to dst + r·dst_pitch (backend
     * memory, not overlapping). Optional (NULL: a copy per row). */
    void (*copy_rows)(df_backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                      size_t row_bytes, int rows);
    void (*zero)(df_backend *be, void *dst, size_t bytes);
    /* Optional (NULL: nothing to do). on = 1: the host memory [p, p + bytes) holds weights that
     * do not change until the same call with on = 0 (a read-only file mapping), so a backend
     * that keeps device copies of host weights need not check them for changes at each use;
     * on = 0 (bytes ignored): that promise ends (before the memory is unmapped). */
    void (*host_const)(df_backend *be, const void *p, size_t bytes, int on);

    /* out[M, E->cols] = rows ids[M] (host array) of the embedding, dequantized, and
     * inverse-rotated when E->hadamard_block > 0 (signs ⊙ Hn(fp16(row)), rounded to fp16). */
    void (*embed)(df_backend *be, const df_linear *E, const int32_t *ids, int M, float *out);
    /* y[M, W->rows] = W · x[M, W->cols] (Hadamard rotation of x first when W has one). */
    void (*linear)(df_backend *be, const df_linear *W, const float *x, int M, float *y);
    /* y[r, :] = x[r, :] · rsqrt(mean(x[r,:]^2) + eps) · w   for r < rows (w may be NULL = 1). */
    void (*rmsnorm)(df_backend *be, const float *x, const float *w, int rows, int width, float eps, float *y);
    /* y[i] += x[i], i < n. */
    void (*add)(df_backend *be, float *y, const float *x, size_t n);
    /* out[r, i] = silu(gu[r, i]) · gu2[r, i] for separate gate/up buffers [rows, width]. */
    void (*swiglu)(df_backend *be, const float *gate, const float *up, size_t n, float *out);

    /* Gated attention over a KV cache, M rows at positions pos0..pos0+M-1.
     * q: [M, n_heads, (gated ? 2 : 1) * head_dim] straight from q_proj (per head q then gate);
     * k, v: [M, n_kv, head_dim] from k_proj / v_proj. q_norm/k_norm [head_dim] (NULL = none).
     * Applies the norms and partial RoPE, writes k/v rows into the cache at pos0.. (cache
     * layout [cap, n_kv, head_dim], cache_len = pos0 positions already valid), and computes
     * out[M, n_heads*head_dim] = softmax(q K^T / sqrt(d) (+ causal)) V (· sigmoid(gate)).
     * Non-causal: every row sees the cache up to pos0+M-1 (drafter block attention).
     * positions: [M] host array of RoPE positions (text: pos0+m). */
    void (*attention)(df_backend *be, const df_attn_shape *sh, float *q, float *k, const float *v,
                      const float *q_norm, const float *k_norm, const int32_t *positions, int M,
                      float *k_cache, float *v_cache, int pos0, float *out);

    /* The key/value half of `attention` alone: applies k_norm and RoPE to k [M, n_kv, head_dim]
     * (in place) and writes k, v rows into the cache at index pos0.. (drafter context rows). */
    void (*kv_append)(df_backend *be, const df_attn_shape *sh, float *k, const float *v, const float *k_norm,
                      const int32_t *positions, int M, float *k_cache, float *v_cache, int pos0);

    /* Grouped dynamic causal convolution over the M rows of a block (DFlash2, MODEL.md §5):
     * out[t, c] = Σ_{o<K} (base[o, c]·x[t-o, c] + dyn[t, o·G + c/gs]·x[t-o, c]), rows before 0
     * are zero; accumulated per o in that order. x, out: [M, H]; dyn: rows of dyn_stride floats
     * (the K·G values used start at the row's start); base: host [K, H]. out != x. */
    void (*dyn_conv)(df_backend *be, const float *x, const float *dyn, int dyn_stride, const float *base, int K,
                     int gs, int M, int H, float *out);

    /* Gated DeltaNet for M rows, in order, each with the single-token recurrence
     * (MODEL.md §1): qkv [M, 2Kd+Vd], z [M, Vd], a, b [M, nv] from the projections;
     * conv_w [C, K]; A_log, dt_bias [nv]; norm_w [dv]. Advances conv_state [K-1, C] and
     * S [nv, dk, dv] by M tokens; out [M, Vd] = GatedRMSNorm(o, z) (NULL: states only). */
    void (*gdn)(df_backend *be, const df_gdn_shape *sh, const float *qkv, const float *z, const float *a,
                const float *b, const float *conv_w, const float *A_log, const float *dt_bias,
                const float *norm_w, int M, float *conv_state, float *S, float *out);

    /* out[r] = argmax over x[r, 0..width) for r < rows (x: backend memory; out: host array);
     * the lowest index wins ties, and out[r] = -1 when the row holds a NaN or its maximum is
     * infinite, as df_argmax. Lets greedy decoding read rows ids instead of rows x width
     * logits from a device. */
    void (*argmax)(df_backend *be, const float *x, int rows, int width, int32_t *out);

    /* Optional fused ops (NULL: the model composes them from the ops above; a backend that sets
     * them computes exactly what the composition would on that backend, same bits).
     *
     * linears: n (1..4) linears of one input with an optional RMSNorm first:
     *   h = norm_w ? rmsnorm(x, norm_w, eps) : x  ([M, width]);  ys[i][M, Ws[i]->rows] = Ws[i] · h.
     * h_out, when not NULL and norm_w is given, receives h (backend memory [M, width]). */
    void (*linears)(df_backend *be, const float *x, const float *norm_w, float eps, int M, int width, int n,
                    const df_linear *const *Ws, float *const *ys, float *h_out);
    /* linear_add: y[M, W->rows] += W · a with a = up ? silu(x) ⊙ up : x ([M, W->cols]): the
     * residual add (and the SwiGLU of an MLP) fused with the linear. */
    void (*linear_add)(df_backend *be, const df_linear *W, const float *x, const float *up, int M, float *y);
    /* gdn_to: gdn reading the states from conv_in [K-1, C] and S_in [nv, dk, dv] and writing the
     * advanced states to conv_state and S (other buffers; conv_in and S_in are left as they
     * were): the bits of copying them over, then gdn. */
    void (*gdn_to)(df_backend *be, const df_gdn_shape *sh, const float *qkv, const float *z, const float *a,
                   const float *b, const float *conv_w, const float *A_log, const float *dt_bias,
                   const float *norm_w, int M, const float *conv_in, const float *S_in, float *conv_state, float *S,
                   float *out);
    /* gdn_states: `gdn` with out = NULL (the states only, advanced in place by M rows) for n
     * independent layers of one shape (layers[i]: layer i's inputs, weights and states; no two
     * share a state buffer): the bits of n `gdn` calls, which a GPU runs in a few launches
     * (speculative decoding replays the accepted rows of every GDN layer at once). */
    void (*gdn_states)(df_backend *be, const df_gdn_shape *sh, int M, int n, const df_gdn_layer *layers);

    /* The k best entries of one row x[0..width) (backend memory) into host arrays ids[k] and
     * vals[k], in rank order: value descending, the lower index first on ties; ids[0] = -1 when
     * the row holds a NaN. 1 <= k <= 64, k <= width. Optional (NULL: sampling reads the whole
     * row): lets a sampler with a small top-k read k entries instead of a vocabulary of logits. */
    void (*top_k)(df_backend *be, const float *x, int width, int k, int32_t *ids, float *vals);
    /* sample_top_dev (optional; a backend with it has the three id ops below too): the draw of
     * df_sample_top_list from the d->k best entries of x[0..width) (backend memory, as `top_k`
     * finds them) with the 53 random bits u, into out[0] in backend memory; -1 there when the
     * row holds a NaN or its maximum is infinite. Lets sampled decoding keep its tokens on the
     * device and queue each step behind the one that draws its token (df_ahead). */
    void (*sample_top_dev)(df_backend *be, const float *x, int width, const df_top_draw *d, uint64_t u,
                           int32_t *out);

    /* Token ids that stay in backend memory (optional, all three or none; NULL: ids go through
     * the host). Speculative decoding uses them to queue a round's verify pass behind its
     * drafter pass without a host round trip between them.
     * embed_dev: `embed` with ids[M] in backend memory (an id outside [0, E->rows) gives a row
     *   of zeros, as `embed`).
     * argmax_dev: `argmax` into out[rows] in backend memory, with `bad` in place of -1 for a row
     *   whose maximum is not finite.
     * submit: starts the ops recorded so far without waiting for them; the ops recorded next
     *   run after them. Results still reach the host only through to_host and argmax. */
    void (*embed_dev)(df_backend *be, const df_linear *E, const int32_t *ids, int M, float *out);
    void (*argmax_dev)(df_backend *be, const float *x, int rows, int width, int32_t *out, int32_t bad);
    void (*submit)(df_backend *be);
    /* read_ahead (optional): `to_host` without waiting for the most recently submitted ops: src
     * must hold a result of ops submitted before them (undefined if the latest submitted ops
     * write it); ops recorded and not submitted are neither run nor waited for. Lets greedy
     * decoding read step N's token while step N + 1, queued behind it, runs. */
    void (*read_ahead)(df_backend *be, void *dst, const void *src, size_t bytes);
} df_backend_ops;

struct df_backend {
    const df_backend_ops *ops;
    int n_threads;
    int failed;   /* sticky: an op could not get scratch memory; the caller reports DF_ERR_NOMEM */
};

/* The CPU backend with n_threads threads (0 = all online CPUs).
 * Errors: DF_ERR_NOMEM, DF_ERR_INTERNAL. */
df_status df_backend_cpu_create(df_backend **out, int n_threads, df_error *err);

/* The CUDA backend on device `device` (0 = the first GPU); see src/backend/cuda/cuda_backend.h.
 * Defined only in builds with the CUDA backend (DFLASH_WITH_CUDA). Weights stay host
 * pointers in the interface: the backend uploads each on first use. Errors: DF_ERR_UNSUPPORTED
 * (no usable device), DF_ERR_NOMEM. */
df_status df_backend_cuda_create(df_backend **out, int device, df_error *err);

/* Hadamard helpers shared by backends and tests: in-place Sylvester Walsh–Hadamard transform
 * of each `block`-wide chunk of x[n] scaled by 1/sqrt(block) (float32 butterflies, fixed order). */
void df_hadamard_inplace(float *x, int n, int block);
/* backend.h `top_k` on host memory (a NaN scan, then df_top_k_insert). */
void df_top_k_host(const float *x, int width, int k, int32_t *ids, float *vals);
/* The k (>= 1) best of x[0..width) into ids[0..n) and vals[0..n), n = min(k, width), in rank
 * order (value descending, the lower index first on ties): a bounded insertion pass in index
 * order, O(width · k) at worst, for small k; returns n. No NaN check (a NaN never enters). */
int df_top_k_insert(const float *x, int width, int k, int32_t *ids, float *vals);
/* e^x for x <= 0 (0 below -87) as 2^n · 2^f: n = x·log2(e) rounded to nearest, |f| <= 1/2, 2^f
 * by its degree-6 Taylor polynomial (relative error below 3e-7 + 1.2e-7·|x|: the polynomial, then
 * the float32 rounding of x·log2(e)), in float32 multiplies and adds only (no fused multiply-add),
 * so that vector code and devices give the same bits. */
float df_exp_nonpos(float x);
/* The token drawn from n (1..64) candidates ids[0..n) whose logits vals[0..n) are in rank order
 * (vals[0] the largest and finite; ties: lower id first), under d and the 53 random bits u (the
 * uniform r = u·2^-53 of [0, 1)):
 *   p_j = df_exp_nonpos((vals[j] − vals[0]) / T) (float32, so p_0 = 1); S = Σ p_j (double, rank
 *   order); top-p: the shortest prefix whose running sum (double, rank order) reaches top_p·S;
 *   min-p: of those, the ones with p_j >= min_p, in order; the draw: the first kept candidate
 *   whose running sum (double, rank order) exceeds (r·Σ kept p_j), else the last kept one.
 * Each step is one IEEE float32 or double operation, compiled from one text for the host and
 * the GPU (backend/top_draw.h), so the CUDA backend's sample_top_dev gives the same token bit for
 * bit. The sampler's top-k path (generate.h) is this function. */
int32_t df_sample_top_list(const int32_t *ids, const float *vals, int n, const df_top_draw *d, uint64_t u);
/* Rounds to the nearest fp16 value (round-to-nearest-even), returned as float. */
float df_round_f16(float x);

#endif
