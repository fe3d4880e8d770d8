/* The CUDA kernels of the CUDA backend (cuda_kernels.cu) behind a plain C interface, so that
 * the backend's bookkeeping (cuda_backend.c) stays C11.
 *
 * Every launcher enqueues its kernels on the legacy default stream and returns 0 or the CUDA
 * error code of the launch (cudaGetLastError). Pointers are device pointers unless a parameter
 * says "host". Arithmetic rules (ENGINEERING.md exactness): compiled with --fmad=false (no
 * implicit FMA contraction), no fast-math; every reduction has a fixed order that depends only
 * on its length; threads and blocks split output elements (or a K range fixed by the weight's
 * shape), never a reduction in an M-dependent way; no atomics.
 */
#ifndef DFLASH_CUDA_KERNELS_H
#define DFLASH_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DFK_MAX_ROWS 16

/* Weight formats of the tensor-core linear (dfk_linear_mma). */
enum { DFK_MMA_Q2 = 2, DFK_MMA_Q4 = 4, DFK_MMA_Q8 = 8, DFK_MMA_BF16 = 16 };

/* Stream of every op launcher (a cudaStream_t; NULL = the legacy default stream). */
void dfk_set_stream(void *stream);
/* Multiprocessor count (sizes the persistent decode grid of dfk_linear_mma). */
void dfk_set_sm_count(int n);
/* 1: dfk_linear_mma uses its shared-memory decode kernel for M <= 2 (an experiment: slower on
 * the H200 so far; same bits). */
void dfk_set_use_dec(int v);
/* Resident CTAs per SM the one/two-token linear instances are compiled for (2 or 3; default 2). */
void dfk_set_occupancy(int v);

/* ---- weights: device-side repacking (run once at upload) ------------------------------- */

/* Repacks MLX affine codes (raw: uint32 [rows, cols*bits/32], scales/biases: 16-bit
 * [rows, cols/gs]) into the tensor-core fragment layout of dfk_linear_mma: per 16-row tile and
 * group, lane (g, t) of a warp holds the codes of rows g, g+8 at columns 2t, 2t+1, 2t+8, 2t+9
 * of each 16-column block, b bits each, placed for a shift-and-mask conversion to bf16 (see
 * cuda_kernels.cu); scales/biases become one uint32 (scale | bias << 16) per (tile, group,
 * row), rows g and g+8 adjacent. Rows are padded to a multiple of 16 with zero codes/scales.
 * bits in {2, 4, 8}, gs in {64, 128}. codes: uint32 [tiles*ng*32*bits*gs/64]; sb: uint32
 * [tiles*ng*16]. */
int dfk_repack_quant(const uint32_t *raw, const uint16_t *scales, const uint16_t *biases, int rows, int cols,
                     int bits, int gs, uint32_t *codes, uint32_t *sb);

/* Repacks a dense bf16 matrix [rows, cols] (cols % 64 == 0) into A fragments: per (tile,
 * 16-column block, lane) one uint4 = the four bf16x2 registers of mma.m16n8k16. */
int dfk_repack_bf16(const uint16_t *raw, int rows, int cols, uint32_t *out);

/* ---- linear -------------------------------------------------------------------------------- */

/* Input preparation of a linear for M rows x[M, cols]: optional Hadamard rotation
 * x' = Hn(signs ⊙ x) per hb-wide block (float32 butterflies in the order of
 * df_hadamard_inplace, then the 1/sqrt(hb) scale hscale), written to xf [M, cols] (float32);
 * group sums xs[M, cols/gs] of x' (gs > 0; fixed order); and when xb != NULL the bf16 B
 * fragments of the tensor-core linear: x' = hi + mid + lo split exactly into three bf16
 * values, n-tile nt holding rows 2nt (columns 0-2 = hi, mid, lo) and 2nt+1 (columns 3-5):
 * xb uint2 [ceil(M/2), cols/16, 32]. seg = the columns one block handles (a multiple of hb
 * and gs dividing cols, <= 8192). */
int dfk_prep(const float *x, int M, int cols, const float *signs, int hb, float hscale, int gs, int seg, float *xf,
             float *xs, uint32_t *xb);

/* y[M, rows] = W x' on the tensor cores (mma.sync m16n8k16 bf16 -> f32). Per group of gs
 * columns D = Σ codes·(hi + mid + lo) exactly represented operands, y += s·D + b·Σx'
 * (groups of a warp in order, then the KW K-slices summed in order 0..KW-1). KW is a
 * function of the weight's shape only, so every row gets the same bits for any M; TR (tiles
 * per warp) only distributes work. mode: DFK_MMA_*; gs: 64/128 (quant) or 64 (bf16). */
int dfk_linear_mma(int mode, int gs, const uint32_t *codes, const uint32_t *sb, int sb_bf16, int rows, int cols,
                   const uint32_t *xb, const float *xs, int M, int KW, int TR, float *y);

/* Largest TR (tiles per warp) dfk_linear_mma accepts for a mode, gs and M. */
int dfk_linear_mma_max_tr(int mode, int gs, int M);

/* y[M, rows] = W x' on CUDA cores for any format: quantized (MLX layout, bits 1..8, any
 * group size; w = s·q + b) or dense F16/BF16/F32 (wdtype: 0 = F16, 1 = BF16, 2 = F32).
 * One warp per output row, lanes over columns, fixed xor-tree reduction. */
int dfk_linear_simple(const void *w, int wdtype, const uint16_t *scales, const uint16_t *biases, int sb_bf16,
                      int bits, int gs, int rows, int cols, const float *xf, int M, float *y);

/* ---- fixed-point linear (cuda_qlin.cu) -------------------------------------------------------
 *
 * Quantized weights (2/4/8-bit MLX affine codes, groups of 64 or 128) times activations held
 * as 16-bit fixed point per group (an exponent per (row, group) and two int8 planes), on the
 * integer tensor cores: the dot product of a group is exact, so a row's bits do not depend on
 * M. The arithmetic, its order and its error bound are in the comment at the top of
 * cuda_qlin.cu. */

#define DFK_QMAX 4                /* linears per dfk_qprep / dfk_linear_q / dfk_linear_dense call */

/* One linear of a dfk_linear_mma_multi launch: repacked codes and scales (dfk_repack), rows,
 * its K-slice count KW (1, 2, 4, 8: a function of the weight's shape) and its output y [M, rows]. */
typedef struct dfk_mlin {
    const uint32_t *codes, *sb;
    int rows, KW;
    int add; /* 1: y += W·x' (y + the product, one float add: the bits of dfk_add after it) */
    float *y;
} dfk_mlin;

/* n (1..DFK_QMAX) linears of one format and one prepared input (xb, xs of dfk_prep: cols
 * columns, M rows) in one launch of dfk_linear_mma's kernel: each linear's rows get exactly
 * dfk_linear_mma's bits (the same blocks, laid end to end), added to y where asked. Returns 0 or a CUDA error
 * (cudaErrorInvalidValue for a shape it does not take). */
int dfk_linear_mma_multi(int mode, int gs, int sb_bf16, int cols, const uint32_t *xb, const float *xs, int M, int TR,
                         int n, const dfk_mlin *lins);
#define DFK_QPREP_MAX_SEG 24576   /* columns one dfk_qprep block holds (float32 in shared memory) */

/* One quantized input of dfk_qprep: the rotation of its linear (signs: device [cols], NULL
 * when hb = 0; hscale = 1/sqrt(hb)), its group size gs (64 or 128), and the outputs:
 * xq: uint32 [M, 2, cols/gs, 4, gs/32, 2] (B fragments of the two planes), xe, xsx: float
 * [M, cols/gs] (2^(E + xe_shift) and S·2^E per group; xe_shift: dfk_q_xe_shift of the linear's
 * bits). xq == NULL: no quantized output. */
typedef struct dfk_qout {
    const float *signs;
    int hb;
    float hscale;
    int gs, xe_shift;
    uint32_t *xq;
    float *xe, *xsx;
} dfk_qout;

/* Activation preparation for up to DFK_QMAX linears that share one input, M rows:
 * v = up ? silu(x)·up : x (elementwise, float32); when norm_w != NULL, v = RMSNorm(v)·norm_w
 * (mean of squares over the whole row in the order of dfk_rmsnorm, then (v·rsqrt)·w: the same
 * bits as dfk_rmsnorm); h (when not NULL) receives v [M, cols], and xb (when not NULL: see
 * dfk_qprep_takes_xb) its bf16 B fragments; then per output its rotation
 * and quantization. seg: the columns of one block (a multiple of every output's hb and gs
 * dividing cols, <= DFK_QPREP_MAX_SEG); grid: M x cols/seg x n blocks. */
int dfk_qprep(const float *x, const float *up, const float *norm_w, float eps, int M, int cols, int seg, float *h,
              uint32_t *xb, int n, const dfk_qout *outs);
/* 1 when dfk_qprep can also write xb for cols and seg: the bf16 B fragments of v (dfk_prep's
 * xb layout and bits, v unrotated) for the bf16 tensor-core linears of the same input. */
int dfk_qprep_takes_xb(int cols, int seg);

/* The exponent offset of the 2^E values that dfk_linear_q takes for bits-bit weights: −4 below
 * 8 bits (its codes are read as 16 times their values in half of the k-blocks), else 0. */
int dfk_q_xe_shift(int bits);

/* Code words of a repacked weight [rows, cols]. */
size_t dfk_q_code_words(int rows, int cols, int bits, int gs);
/* Words of its sb table: ceil(rows/16)·(cols/gs)·16, or ·8 with scales only (dfk_repack_q). */
size_t dfk_q_sb_words(int rows, int cols, int gs, int scales_only);

/* Repacks MLX codes (uint32 [rows, cols·bits/32]) and 16-bit scales/biases [rows, cols/gs] into
 * the m16n8k32 fragment layout of dfk_linear_q (rows padded to 16 with zeros), a tile's groups
 * stored K-slice by K-slice for KW slices (the KW that dfk_linear_q is then given for this
 * weight). bits 2, 4, 8; gs 64, 128; KW 1, 2, 4, 8 and <= cols/gs. scales_only = 1 (2-bit
 * codes only): the weight's every bias is its scale negated (bit for bit: the ternary packs of
 * MODEL.md §2), so only the scales are stored (biases may be NULL) and dfk_linear_q is given
 * a format with 2 added (sbf); the kernels take b = −s, which is the stored bias's value, so the same bits.
 * sb: dfk_q_sb_words words. Returns 0 or a CUDA error (cudaErrorInvalidValue for a shape or
 * format it does not take). */
int dfk_repack_q(const uint32_t *raw, const uint16_t *scales, const uint16_t *biases, int rows, int cols, int bits,
                 int gs, int KW, int scales_only, uint32_t *codes, uint32_t *sb);

/* One linear of dfk_linear_q: y[M, rows] (+)= W · x' from the prepared input (xq, xe, xsx of
 * dfk_qprep with this linear's rotation and gs). KW: K-slices (1, 2, 4, 8), from the weight's
 * shape only. add: 1 = y += W·x' (the residual add fused; same bits as a separate add). */
typedef struct dfk_qlin {
    const uint32_t *codes, *sb;
    int rows, cols, KW, add;
    const uint32_t *xq;
    const float *xe, *xsx;
    float *y;
} dfk_qlin;

/* How dfk_linear_q distributes its work (never its bits). ring: 0 = codes loaded in batches
 * into registers, TR 16-row tiles per warp (capped at dfk_linear_q_max_tr(M)), one CTA per
 * work unit (k_lin_q); 1 = one tile per warp, each warp streaming its steps through a ring in
 * shared memory filled by cp.async, on a persistent grid of `ctas` CTAs (0: as many as fit on
 * the device at once) (k_lin_qr, or k_lin_qb with bulk). */
typedef struct dfk_qsched {
    int TR, ring, ctas;
    int ring_max_m; /* > 0: the ring kernel only up to this many rows, k_lin_q above */
    int bulk;       /* ring: 1 = each warp's records streamed by bulk copies (k_lin_qb) where the
                       prepared input fits in shared memory, up to 4 rows; 2 = up to 8 rows;
                       0 = per-lane cp.async (k_lin_qr) */
    int split_rows;  /* > 0: at most this many rows per launch (M rows in launches of nearly
                        equal size); 0 = no limit */
    int split_bytes; /* > 0: fewer rows per launch where the prepared input of the launch's rows
                        would take more than this many bytes of shared memory. The same bits
                        either way (a row's result never depends on the other rows). */
} dfk_qsched;

/* A dense 16-bit linear (dfk_linear_dense). */
typedef struct dfk_dlin {
    const void *w;
    int wdtype, rows, cols, add;
    const float *x;
    float *y;
} dfk_dlin;

/* Up to DFK_QMAX linears of the same format (bits, gs, scale format sbf: 1 for bf16
 * scales (else fp16), plus 2 for scales only (dfk_repack_q's scales_only; 2-bit codes only)) and the same M in one
 * launch, with nd (0..DFK_QMAX) dense linears of M rows riding along (dfk_linear_dense's bits:
 * the bulk-copy ring computes their rows after its units, saving their launch; other kernels
 * launch them first). */
int dfk_linear_q(int bits, int gs, int sbf, int M, dfk_qsched sched, int n, const dfk_qlin *lins, int nd,
                 const dfk_dlin *dense);
int dfk_linear_q_max_tr(int M);

/* Dense 16-bit linears on CUDA cores: y[M, rows] (+)= W x for W f16 (wdtype 0) or bf16 (1)
 * [rows, cols], cols % 8 == 0, x float32 [M, cols]; one block per output row, fixed order. */
int dfk_linear_dense(int M, int n, const dfk_dlin *lins);

/* Multiprocessor count (sizes the persistent grid of dfk_linear_q). */
void dfk_set_q_sm_count(int n);
/* 1: dfk_linear_q runs a persistent grid (an experiment; default 0: one CTA per work unit). */
void dfk_set_q_persistent(int on);
/* 1: each warp of dfk_linear_q prefetches its next batch of codes into L2 (default). */
void dfk_set_q_prefetch(int on);
/* 1: dfk_linear_q copies the prepared input into shared memory when it fits (default). */
void dfk_set_qsmem(int on);
/* The ring kernels copy the prepared input into shared memory only up to this many bytes
 * (above: B fragments read through L2); default: whenever it fits. The same bits either way. */
void dfk_set_qsmem_max(size_t bytes);
/* 1: launch the linears' and preparations' kernels (cuda_qlin.cu) and the attention and Gated
 * DeltaNet kernels with programmatic dependent launch (default); 2: the first group only (an
 * experiment); 0: none. */
void dfk_set_pdl(int on);
/* Grid shape of the fixed-point linears' persistent launches: 1 (default) every CTA the device
 * holds at once, units split as evenly as they go; 0 the fewest CTAs that give each the same
 * number of units. Which CTA runs a unit never changes its bits. */
void dfk_set_q_full_grid(int on);
/* The ring shape of k_lin_qb (scheduling only, never the bits): 0 = the first of its shapes that
 * keeps two CTAs per SM, or the most any gives (default); 1, 2, 3 = that shape where it fits (one
 * n-tile: 8 x 2, 6 x 2, 2 x 3 records per stage x stages; two n-tiles: 4 x 2, 2 x 3, 2 x 2);
 * 10·a + b: a for one n-tile (1..4 rows), b for two (5..8 rows). */
void dfk_set_q_stage(int which);
/* Experiments of the bulk-copy fixed-point linear (0 = none, the default): 2 and 4 skip the
 * arithmetic and the scale/bias copies (wrong outputs: timing only); 8 stages the prepared
 * input by every thread's loads instead of bulk copies (the same bits). */
void dfk_set_q_diag(int bits);
/* 1: the fixed-point linear's bulk-copy kernel computes the rows of the dense linears riding
 * along right after its input is ready, before its units; 0 (default): after them. The same
 * bits either way. */
void dfk_set_ride_first(int on);
/* The dfk_set_pdl setting. */
int dfk_pdl_on(void);
/* The stream of the launchers (dfk_set_stream). */
void *dfk_get_stream(void);

/* ---- elementwise and norms ------------------------------------------------------------------ */

/* out[m, :] = embedding row ids[m] (ids: device int32 [M]): dequantized (MLX layout,
 * rounded to fp16) or dense (wdtype as dfk_linear_simple), then when hb > 0:
 * fp16(signs ⊙ Hn(row)). Ids outside [0, rows) give zeros. */
int dfk_embed(const uint32_t *codes, const uint16_t *scales, const uint16_t *biases, int sb_bf16, int bits, int gs,
              const void *dense, int wdtype, int rows, int cols, const float *signs, int hb, float hscale,
              const int32_t *ids, int M, float *out);

int dfk_rmsnorm(const float *x, const float *w, int rows, int width, float eps, float *y);
int dfk_add(float *y, const float *x, size_t n);
int dfk_swiglu(const float *gate, const float *up, size_t n, float *out);

/* out[r] = argmax of x[r, 0..width) (lowest index on ties; `bad` when the row holds a NaN or its
 * maximum is infinite: -1 for df_argmax's rule) into out (device int32 [rows]). */
int dfk_argmax(const float *x, int rows, int width, int32_t *out, int32_t bad);

/* The k (1..64) best entries of one row x[0..width) (value descending, the lower index first on
 * ties) into ids[k], vals[k] (device memory); ids[0] = -1 when the row holds a NaN. width up to
 * dfk_top_k_max_width() (262144); cudaErrorInvalidValue beyond, or for k outside 1..min(64,
 * width). */
int dfk_top_k(const float *x, int width, int k, int32_t *ids, float *vals);
int dfk_top_k_max_width(void);

/* A token drawn from the top k (dfk_top_k_draw): backend.h df_top_draw's filters, the 53 random
 * bits as two words in device memory (u[0] low, u[1] high: a step's parameter block), the token
 * id written to out[0] (device int32; -1 when the row holds a NaN or its maximum is infinite). */
typedef struct dfk_draw {
    float temperature, top_p, min_p;
    const uint32_t *u;
    int32_t *out;
} dfk_draw;

/* dfk_top_k, then the draw of df_sample_top_list (backend.h) from the k best with d: the same
 * float32 and double operations in the same order, so the same token. */
int dfk_top_k_draw(const float *x, int width, int k, int32_t *ids, float *vals, const dfk_draw *d);

/* ---- attention ------------------------------------------------------------------------------ */

/* Per row m and head: q heads (when q != NULL) RMSNorm (q_norm) + partial RoPE in place;
 * k heads RMSNorm (k_norm) + RoPE in place, then k and v rows stored in the cache at index
 * pos0 + m. positions: device int32 [DFK_MAX_ROWS + 1]: the RoPE positions of the rows, then
 * pos0 at index DFK_MAX_ROWS (device memory, so that a replayed graph reads new values). Norm
 * weights may be NULL. */
int dfk_qk_prep(float *q, int qstride, int nh, float *k, const float *v, int nkv, int hd, const float *q_norm,
                const float *k_norm, int rot, float theta, float eps, const int32_t *positions, int M, float *k_cache,
                float *v_cache);

/* Attention of M rows over the cache in chunks of dfk_attn_chunk() positions: row m sees
 * len_m = causal ? pos0+m+1 : pos0+M positions; the chunking depends on len_m alone.
 * pos0: device int32 [2] in the step's parameter block (written before the step's first kernel):
 * pos0, then `stable`, the first cache row that a kernel since the last host synchronization
 * writes (rows below it are read before waiting for the previous kernel); nchunk: any bound >=
 * the chunks needed (blocks past a row's length exit). part: scratch float [M, nh, nchunk, hd + 2]; out [M, nh*hd]
 * (· sigmoid(gate) when gated). Two launches: k_attn_tile (a block per group of rows, chunk and
 * KV head; each row's bits independent of M and of the other rows) and k_attn_combine. Returns -1
 * for an unsupported shape (head_dim other than 64, 128 or 256; more than 16 query heads per KV
 * head). */
/* 1 when dfk_attention takes the shape: head_dim 64, 128 or 256, at most 16 query heads per KV
 * head (nh a multiple of nkv > 0). */
int dfk_attention_shape_ok(int nh, int nkv, int hd);
int dfk_attention(const float *q, int qstride, int gated, int nh, int nkv, int hd, const float *k_cache,
                  const float *v_cache, int causal, const int32_t *pos0, int M, int nchunk, float *part, float *out);

/* ---- DFlash2 ---------------------------------------------------------------------------------- */

/* Grouped dynamic causal convolution of backend.h `dyn_conv` (base: device [K, H]); the CPU
 * backend's arithmetic and order, one thread per output element. */
int dfk_dyn_conv(const float *x, const float *dyn, int dyn_stride, const float *base, int K, int gs, int M, int H,
                 float *out);

/* ---- Gated DeltaNet ----------------------------------------------------------------------- */

/* Causal depthwise conv + SiLU over M rows in order (MODEL.md §1): conv_out [M, C]. Reads the
 * state [K-1, C] from state_in and writes the advanced state to conv_state (the same buffer,
 * or another: state_in is then unchanged). */
int dfk_gdn_conv(const float *qkv, const float *conv_w, int C, int K, int M, const float *state_in,
                 float *conv_state, float *conv_out);

/* The recurrence for M rows in order, one block per value head; out may be NULL (states
 * only). Reads S [nv, dk, dv] from S_in and writes the advanced S to S (the same buffer, or
 * another). Supported key head dims: 32, 64, 128 (value head dim <= 256). Returns -1 for an
 * unsupported shape. */
int dfk_gdn_recurrence(const float *conv_out, const float *z, const float *a, const float *b, const float *A_log,
                       const float *dt_bias, const float *norm_w, int nk, int nv, int dk, int dv, float eps, int M,
                       const float *S_in, float *S, float *out);

/* dfk_gdn_conv then dfk_gdn_recurrence in one kernel (block j convolves its head's q, k and v
 * channels into shared memory: the same bits as the two calls); no conv_out scratch. pre = 1:
 * the states S_in and conv_in are read before waiting for the previous kernel (programmatic
 * dependent launch), which the caller allows only where no kernel since the last host
 * synchronization wrote them. -1 for an unsupported shape (also when 2·dk + dv exceeds 4·dv,
 * nk exceeds DFK_GDN_MAX_KH, or M < 1). A key head's q/k windows are written by the last of
 * its value heads' blocks to have used them (so in place, conv_in == conv_state, no block
 * reads a window a sibling already advanced, in whatever order the blocks run). */
#define DFK_GDN_MAX_KH 1024
/* dfk_gdn_fused's instance with batches of 4 rows for up to 4 rows: 1 (default) on, 0 off
 * (DFLASH_CUDA_GDN_SMALL=0); the same bits either way. */
void dfk_set_gdn_small(int on);
int dfk_gdn_fused(const float *qkv, const float *conv_w, int K, const float *conv_in, float *conv_state,
                  const float *z, const float *a, const float *b, const float *A_log, const float *dt_bias,
                  const float *norm_w, int nk, int nv, int dk, int dv, float eps, int M, const float *S_in, float *S,
                  float *out, int pre);

/* One layer of dfk_gdn_multi (device pointers; conv_out: [M, C] scratch of its own). */
typedef struct dfk_gdn_job {
    const float *qkv, *z, *a, *b, *conv_w, *A_log, *dt_bias, *norm_w;
    float *conv_state, *S, *conv_out;
} dfk_gdn_job;

/* dfk_gdn_conv then dfk_gdn_recurrence with out = NULL, states in place, for n independent
 * layers of one shape (jobs: a device array of n jobs) in two launches; per layer the bits of
 * the two calls. -1 for an unsupported shape. */
int dfk_gdn_multi(const dfk_gdn_job *jobs, int n, int C, int K, int nk, int nv, int dk, int dv, float eps, int M);

/* The attention chunk (positions per block of dfk_attention): 32 (default) or 64 (other values
 * are ignored). Set between steps, before any attention whose bits are compared with another's:
 * the chunk is part of the arithmetic (the same for every row and every M, so never of batch
 * invariance). */
void dfk_set_attn_chunk(int chunk);
int dfk_attn_chunk(void);
/* Timing experiments only (wrong outputs): 1 = the attention copies each chunk and stops, 2 =
 * it computes without the copies; 0 (default) = neither. */
void dfk_set_attn_diag(int v);

/* ---- timeline trace (experiments: DFLASH_CUDA_TRACE) ----------------------------------------- */

/* One record of the kernel timeline (cuda_trace.cuh): the launch (%gridid), the global timer
 * (ns; 32 ns ticks on the H200) and the SM's cycle counter when it was written, the cycles since the CTA began,
 * the source line that wrote it (kernels file + 0, fixed-point file + 10000), its kind (0:
 * inputs ready, 1: end of the CTA's work), the SM and CTA, and a kernel-defined count (the
 * fixed-point linear's end: the launch's weight bytes / 1024). 40 bytes. */
typedef struct {
    uint64_t grid, gtime, clk;
    uint32_t dclk;
    uint16_t site, kind, sm, cta;
    uint32_t aux;
} dfk_trace_rec;

/* Starts recording into a ring of 2^log2_records records (device memory; log2_records 10..24)
 * in every traced kernel of both kernel files. Returns 0 or a CUDA error. */
int dfk_trace_start(int log2_records);
/* Writes the ring's records, oldest first, to `path`: a 16-byte header ("DFTRACE1", the
 * record count as uint32, the record size as uint32), then the records. Stops recording and
 * frees the ring. Returns 0, a CUDA error, or -1 when the file cannot be written. */
int dfk_trace_dump(const char *path);
/* Points the fixed-point file's copies of the trace pointers at buf/ctr (NULL: off). */
int dfk_trace_bind_qlin(dfk_trace_rec *buf, unsigned *ctr, unsigned mask);

/* ---- misc ----------------------------------------------------------------------------------- */

/* Device-to-device copy bandwidth: copies `bytes` `reps` times (after one warm-up) and
 * returns (read + written bytes) / second in *gbps (GB/s, 1e9). */
int dfk_copy_bandwidth(size_t bytes, int reps, double *gbps);

#ifdef __cplusplus
}
#endif
#endif
