/* The fixed-point linear of the CUDA backend: quantized weights (MLX affine, 2/4/8-bit codes,
 * groups of 64 or 128) times activations held as 16-bit fixed point per group, on the integer
 * tensor cores (mma.sync m16n8k32, u8 x s8 -> s32). Interface: cuda_kernels.h ("fixed-point
 * linear").
 *
 * Arithmetic (MODEL.md §2 with the activation rounding below). For a data row x' (after the
 * optional SwiGLU, RMSNorm and Hadamard rotation, all float32) and each group G of gs columns:
 *     mx = max |x'_i| over G;  E = exponent of mx (mx < 2^E') minus 14;  X_i = rint(x'_i / 2^E)
 * so |X_i| <= 2^14 and |x'_i − X_i·2^E| <= 2^(E−1) <= 2^−14 · mx. X_i = 256·a_i + b_i with
 * a_i in [−64, 64] and b_i in [−128, 127] (two int8 planes). The group's dot product with the
 * codes q_i is then an exact integer, D = 256·Σ q_i a_i + Σ q_i b_i (the tensor cores sum
 * integers exactly, in any order), and the row's output is
 *     y_r = Σ_G [ s_rG · (float(D_rG) · 2^E_G) + b_rG · (float(S_G) · 2^E_G) ],  S_G = Σ_i X_i,
 * with the float operations in exactly this order and the groups summed in a fixed order
 * (K-slices fixed by the weight's shape, see cuda_backend.c). Every quantity a row's output
 * depends on is computed from that row alone: the result is the same bits for any number of
 * rows M and any work split (backend.h exactness contract). Compared with float32 x', the
 * rounding of x' changes y by at most Σ_G (|s_rG|·Σ_i q_i + |b_rG|·gs) · 2^(E_G−1). (Below 8 bits
 * the kernels form float(16·D)·2^(E−4), the same value: q_mma_group.)
 *
 * Compiled with --fmad=false (no FMA contraction), like cuda_kernels.cu.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_rowops.cuh"
#include "backend/cuda/cuda_trace.cuh"

#define QFULL 0xffffffffu

static __device__ __forceinline__ float q_h16(uint32_t h, int bf16) {
    if (bf16) return __uint_as_float((h & 0xffffu) << 16);
    return __half2float(__ushort_as_half((unsigned short)(h & 0xffffu)));
}


/* Programmatic dependent launch: wait for the previous kernel of the stream (its writes
 * visible), and let the next one be scheduled. No-ops when the launch had no PDL attribute.
 * With PDL, kernels of the stream overlap on an SM, and the SM's L1 cache is not coherent: a
 * line an older kernel cached (before a newer one rewrote the data) could be hit. So every
 * load of data that an earlier kernel wrote goes through L2 only (__ldcg); only weights
 * (never written after upload) use the read-only path. */
static __device__ __forceinline__ void pdl_wait(void) { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
static __device__ __forceinline__ void pdl_trigger(void) { asm volatile("griddepcontrol.launch_dependents;\n" ::); }

extern "C" int dfk_trace_bind_qlin(dfk_trace_rec *buf, unsigned *ctr, unsigned mask) {
    return dfk_tr_bind_here(buf, ctr, mask);
}

static int g_pdl = 1;
extern "C" void dfk_set_pdl(int on) { g_pdl = on == 2 ? 2 : (on ? 1 : 0); }
extern "C" int dfk_pdl_on(void) { return g_pdl; }

/* kernel<<<grid, block, smem>>> with PDL unless it is off (dfk_set_pdl; 2: these kernels only). */
template <typename... KArgs, typename... Args>
static int launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Args... args) {
    return dfk_launch(kernel, grid, block, smem, g_pdl != 0, args...);
}

/* ---- weight repacking -------------------------------------------------------------------------
 *
 * Layout: per (16-row tile, group, lane (g, t)) WPL = (gs/32)·bits/2 words, stored as NVEC
 * vectors of VEC words: word index (((tile·ng + rec)·NVEC + v)·32 + lane)·VEC + e holds lane
 * word wi = v·VEC + e. Register j of lane (g, t) in k-block kb is the m16n8k32 A fragment: row
 * g + 8·(j & 1), columns 4t + i + 16·(j >> 1) of the 32-column block, byte i of it at bits
 * 8i + bits·p of its word, p its position (RPW = 8/bits positions per byte). At 8 bits word
 * wi = 4·kb + j (p = 0). Below 8 bits the group's k-blocks form two classes (q_code_class: the
 * first and second half) and a word's positions half each: position p = HW·c + sub (HW = RPW/2)
 * of word wi holds the register r = HW·wi + sub of class c, r = 4·(kb mod KBG/2) + j. A class-0
 * register is then (w >> bits·sub) & mask, a class-1 one (w >> bits·sub) & (mask << 4): its
 * codes times 16 (q_mma_group).
 * Scales and biases: one word (scale | bias << 16) per (tile, group, row), rows g and g + 8
 * adjacent: index ((tile·ng + rec)·8 + g)·2 + half (64 bytes a record). Scales only (a weight
 * whose every bias is its scale negated, bit for bit: the ternary codes of MODEL.md §2, w ∈
 * {−s, 0, s}): one word (scale of row g | scale of row g + 8 << 16) per (tile, group, g):
 * index (tile·ng + rec)·8 + g (32 bytes a record); the kernels take b = −s, the same float as
 * the stored bias, so the same bits (q_sb_pair).
 *
 * Record order (rec above): a tile's (tile, group) records are stored K-slice by K-slice
 * (slice kw holds the groups kw, kw + KW, kw + 2·KW, ...; KW = 2^kwl, from the weight's shape),
 * so that the steps one warp streams are one contiguous run: group grp is record
 * q_rec_of_group(grp) of its tile.
 */
static __host__ __device__ __forceinline__ int q_rec_of_group(int grp, int ng, int kwl) {
    const int KW = 1 << kwl, base = ng >> kwl, rem = ng & (KW - 1), kw = grp & (KW - 1);
    return kw * base + (kw < rem ? kw : rem) + (grp >> kwl);
}

/* The group stored at record position pos of a tile (the inverse of q_rec_of_group). */
static __device__ __forceinline__ int q_group_of_rec(int pos, int ng, int kwl) {
    const int base = ng >> kwl, rem = ng & ((1 << kwl) - 1);
    int kw, j;
    if (pos < rem * (base + 1)) {
        kw = pos / (base + 1);
        j = pos % (base + 1);
    } else {
        const int p2 = pos - rem * (base + 1);
        kw = rem + p2 / base;
        j = p2 % base;
    }
    return kw + (j << kwl);
}

/* log2 of a K-slice count (1, 2, 4, 8). */
static __host__ __device__ __forceinline__ int q_kwl(int KW) { return KW >= 8 ? 3 : (KW >= 4 ? 2 : (KW >= 2 ? 1 : 0)); }

__global__ void k_repack_q(const uint32_t *__restrict__ raw, const uint16_t *__restrict__ scales,
                           const uint16_t *__restrict__ biases, int rows, int cols, int bits, int gs, int tiles,
                           int kwl, int so, uint32_t *__restrict__ codes, uint32_t *__restrict__ sb) {
    const int ng = cols / gs, kbg = gs / 32, wpl = kbg * bits / 2, vec = wpl < 4 ? wpl : 4, nvec = wpl / vec;
    const int rpw = 8 / bits;
    const size_t nwords = (size_t)tiles * (size_t)ng * 32 * (size_t)wpl;
    const size_t wpr = (size_t)cols * (size_t)bits / 32;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < nwords) {
        size_t r = idx;
        const int e = (int)(r % (size_t)vec);
        r /= (size_t)vec;
        const int lane = (int)(r % 32);
        r /= 32;
        const int v = (int)(r % (size_t)nvec);
        r /= (size_t)nvec;
        const int group = q_group_of_rec((int)(r % (size_t)ng), ng, kwl);
        const int tile = (int)(r / (size_t)ng);
        const int wi = v * vec + e, hw = rpw / 2, kbh = kbg / 2;
        const int g = lane >> 2, t = lane & 3;
        uint32_t out = 0;
        for (int q = 0; q < rpw; q++) {
            int kb, j;
            if (bits == 8) {
                kb = wi / 4;
                j = wi % 4;
            } else {
                const int rr = hw * wi + q % hw;
                kb = (q / hw) * kbh + rr / 4;
                j = rr % 4;
            }
            const int row = tile * 16 + g + 8 * (j & 1);
            if (row >= rows) continue;
            for (int i = 0; i < 4; i++) {
                const int col = group * gs + kb * 32 + 4 * t + i + 16 * (j >> 1);
                const size_t bit = (size_t)col * (size_t)bits;
                const uint32_t c = (raw[(size_t)row * wpr + bit / 32] >> (bit % 32)) & ((1u << bits) - 1u);
                out |= c << (8 * i + bits * q);
            }
        }
        codes[idx] = out;
    }
    const size_t nsb = (size_t)tiles * (size_t)ng * (so ? 8 : 16);
    if (so && idx < nsb) { /* scales only: rows g and g + 8 in one word */
        const int g = (int)(idx % 8);
        const size_t tg = idx / 8;
        const int group = q_group_of_rec((int)(tg % (size_t)ng), ng, kwl), tile = (int)(tg / (size_t)ng);
        uint32_t o = 0;
        for (int half = 0; half < 2; half++) {
            const int row = tile * 16 + g + 8 * half;
            if (row < rows) o |= (uint32_t)scales[(size_t)row * (size_t)ng + (size_t)group] << (16 * half);
        }
        sb[idx] = o;
    } else if (idx < nsb) {
        const int half = (int)(idx % 2), g = (int)((idx / 2) % 8);
        const size_t tg = idx / 16;
        const int group = q_group_of_rec((int)(tg % (size_t)ng), ng, kwl), tile = (int)(tg / (size_t)ng);
        const int row = tile * 16 + g + 8 * half;
        uint32_t o = 0;
        if (row < rows) {
            const size_t k = (size_t)row * (size_t)ng + (size_t)group;
            o = (uint32_t)scales[k] | ((uint32_t)biases[k] << 16);
        }
        sb[idx] = o;
    }
}

extern "C" int dfk_q_xe_shift(int bits) { return bits == 8 ? 0 : -4; }

extern "C" size_t dfk_q_code_words(int rows, int cols, int bits, int gs) {
    return (size_t)((rows + 15) / 16) * (size_t)(cols / gs) * 32 * (size_t)(gs / 32 * bits / 2);
}

extern "C" size_t dfk_q_sb_words(int rows, int cols, int gs, int scales_only) {
    return (size_t)((rows + 15) / 16) * (size_t)(cols / gs) * (scales_only ? 8 : 16);
}

extern "C" int dfk_repack_q(const uint32_t *raw, const uint16_t *scales, const uint16_t *biases, int rows, int cols,
                            int bits, int gs, int KW, int scales_only, uint32_t *codes, uint32_t *sb) {
    if ((bits != 2 && bits != 4 && bits != 8) || (gs != 64 && gs != 128) || cols % gs != 0 ||
        (KW != 1 && KW != 2 && KW != 4 && KW != 8) || KW > cols / gs || (scales_only && bits != 2) ||
        (!scales_only && !biases))
        return (int)cudaErrorInvalidValue;
    const int tiles = (rows + 15) / 16;
    const size_t nwords = dfk_q_code_words(rows, cols, bits, gs), nsb = dfk_q_sb_words(rows, cols, gs, scales_only);
    const size_t n = nwords > nsb ? nwords : nsb;
    k_repack_q<<<(unsigned)((n + 255) / 256), 256>>>(raw, scales, biases, rows, cols, bits, gs, tiles, q_kwl(KW),
                                                      scales_only ? 1 : 0, codes, sb);
    return (int)cudaGetLastError();
}

/* ---- activation preparation ------------------------------------------------------------------ */

struct qprep_args {
    dfk_qout o[DFK_QMAX];
};

/* Quantizes one group slice: this lane holds elements 4li..4li+3 (v) of group G (lanes of a
 * group: lpg = gs/4 consecutive lanes); ok = 0 for lanes without data (zeros, no writes). Writes
 * the two planes into xq (B-fragment order) and 2^E, S·2^E (file comment). Every lane of the
 * warp must call it (shuffles). */
static __device__ __forceinline__ void q_group(const dfk_qout &O, int m, int ng, int G, int li, bool ok,
                                               const float *v) {
    /* gs is 64 or 128 (dfk_qout): shifts, not divisions */
    const int lg = O.gs == 128 ? 7 : 6, lpg = 1 << (lg - 2), kbg = 1 << (lg - 5);
    /* max |v| as the bits of the magnitudes (ordered as the floats for finite values; when one
     * is not finite, bad is set and the max is not used) */
    int bad = 0;
    uint32_t amax = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t b = __float_as_uint(v[j]) & 0x7fffffffu;
        if (b >= 0x7f800000u) bad = 1;
        amax = b > amax ? b : amax;
    }
    if (lpg == 32) { /* the group is the warp: one reduction instruction each */
        amax = __reduce_max_sync(QFULL, amax);
        bad = __any_sync(QFULL, bad);
    } else {
        for (int off = lpg / 2; off > 0; off >>= 1) {
            const uint32_t o = __shfl_xor_sync(QFULL, amax, off);
            amax = o > amax ? o : amax;
            bad |= __shfl_xor_sync(QFULL, bad, off);
        }
    }
    /* E = frexp exponent of mx, minus 14: from the exponent field for a normal mx */
    int E = 0;
    if (!bad && amax != 0u) {
        int ex;
        if (amax >= 0x00800000u) ex = (int)(amax >> 23) - 126;
        else frexpf(__uint_as_float(amax), &ex);
        E = ex - 14;
    }
    /* v·2^−E: a product with the power of two where it is a normal float (exact scaling, or
     * the same correctly rounded result as ldexpf), else ldexpf */
    const int n = -E;
    const float sc = __uint_as_float((uint32_t)(n + 127) << 23);
    int S = 0;
    uint32_t pa = 0, pb = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int X = bad ? 0 : __float2int_rn(n <= 127 ? v[j] * sc : ldexpf(v[j], n));
        const int a = (X + 128) >> 8, b = X - a * 256;
        S += X;
        pa |= ((uint32_t)a & 0xffu) << (8 * j);
        pb |= ((uint32_t)b & 0xffu) << (8 * j);
    }
    if (lpg == 32) S = __reduce_add_sync(QFULL, S);
    else
        for (int off = lpg / 2; off > 0; off >>= 1) S += __shfl_xor_sync(QFULL, S, off);
    if (ok) {
        const int l8 = li % 8, kb = li / 8, t = l8 % 4, reg = l8 / 4;
        for (int p = 0; p < 2; p++) {
            const size_t u2 =
                ((((size_t)(m * 2 + p) * (size_t)ng + (size_t)G) * 4 + (size_t)t) * (size_t)kbg + (size_t)kb);
            O.xq[u2 * 2 + (size_t)reg] = p == 0 ? pa : pb;
        }
        if (li == 0) {
            O.xe[(size_t)m * (size_t)ng + (size_t)G] = bad ? __int_as_float(0x7fc00000) : ldexpf(1.0f, E + O.xe_shift);
            O.xsx[(size_t)m * (size_t)ng + (size_t)G] = bad ? __int_as_float(0x7fc00000) : ldexpf((float)S, E);
        }
    }
}

/* Block (m, segment, output o): loads x' = x (or silu(x)·up) for its segment, applies the
 * RMSNorm (whole row: one segment) and writes h when asked (output 0 only), then output o's
 * rotation and the group quantization of the file comment. */
__global__ void __launch_bounds__(256) k_qprep(const float *x, const float *up,
                                               const float *__restrict__ norm_w, float eps, int cols, int seg,
                                               float *h, const __grid_constant__ qprep_args P) {
    extern __shared__ float sm[];
    __shared__ float red[8];
    pdl_trigger(); /* before the trace's load: the next kernel's launch waits for every CTA's trigger */
    const dfk_tr_start trs = dfk_tr_begin();
    pdl_wait();
    dfk_tr_mark(trs, DFK_TR_SITE(10000), 0, 0);
    const int m = blockIdx.x, s0 = blockIdx.y * seg, oi = blockIdx.z, tid = threadIdx.x;
    const float *xr = x + (size_t)m * (size_t)cols;
    const float *ur = up ? up + (size_t)m * (size_t)cols : NULL;
    /* every block of the row computes the row's sum of squares itself, in the order of
     * dfk_row_sumsq (the unfused rmsnorm's too): the same bits in all of them */
    const float inv = norm_w ? dfk_rms_inv(dfk_row_sumsq(xr, ur, cols, red), cols, eps) : 1.0f;
    for (int i0 = 0; i0 < seg; i0 += 4 * 256) {
        float v[4], u[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = i0 + j * 256 + tid;
            v[j] = i < seg ? __ldcg(&xr[s0 + i]) : 0.0f;
            u[j] = (ur && i < seg) ? __ldcg(&ur[s0 + i]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = i0 + j * 256 + tid;
            if (i < seg) {
                const float w = ur ? dfk_silu(v[j]) * u[j] : v[j];
                sm[i] = norm_w ? (w * inv) * norm_w[s0 + i] : w;
            }
        }
    }
    if (h && oi == 0) {
        float *hr = h + (size_t)m * (size_t)cols + s0;
        for (int i = tid; i < seg; i += 256) hr[i] = sm[i];
    }
    const dfk_qout &O = P.o[oi];
    if (!O.xq) return;
    if (O.hb > 0) {
        for (int i = tid; i < seg; i += 256) sm[i] = sm[i] * O.signs[s0 + i];
        __syncthreads();
        for (int hh = 1; hh < O.hb; hh <<= 1) {
            for (int p = tid; p < seg / 2; p += 256) {
                const int i = ((p & ~(hh - 1)) << 1) | (p & (hh - 1));
                const float a = sm[i], b = sm[i + hh];
                sm[i] = a + b;
                sm[i + hh] = a - b;
            }
            __syncthreads();
        }
        for (int i = tid; i < seg; i += 256) sm[i] = sm[i] * O.hscale;
    }
    __syncthreads();
    const int gs = O.gs, lpg = gs / 4, gpw = 32 / lpg;
    const int nsg = seg / gs, ng = cols / gs, g0 = s0 / gs;
    const int lane = tid & 31, warp = tid >> 5;
    for (int base = warp * gpw; base < nsg; base += 8 * gpw) {
        const int gl = base + lane / lpg, li = lane % lpg;
        const bool ok = gl < nsg;
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = ok ? sm[gl * gs + 4 * li + j] : 0.0f;
        q_group(O, m, ng, g0 + gl, li, ok, v);
    }
}

/* The bf16 B fragments of the tensor-core linear (dfk_prep's xb layout: n-tile m/2, lanes
 * (3·(m%2) + s)·4 + t for the exact three-way split s of each value) of this thread's four
 * values v of row m, columns e0..e0+3 (e0 % 4 == 0): the values of a 16-column block are held
 * by four consecutive threads (columns 0-3, 4-7, 8-11, 12-15); a fragment word pair takes its
 * .x from columns 2t, 2t+1 and its .y from 2t+8, 2t+9, so the threads of columns 0-7 take
 * their partners' (two lanes up) words and store (act: this thread holds data). The split:
 * dfk_split_part, as dfk_prep's. Every thread of the warp calls it. */
static __device__ __forceinline__ void q_bf16_frags(const float (&v)[4], int m, int cols, int e0, bool act,
                                                    uint32_t *xb) {
    const int q4 = (e0 >> 2) & 3, kb = e0 >> 4, kbt = cols >> 4;
    uint2 *dst = reinterpret_cast<uint2 *>(xb) + ((size_t)(m >> 1) * (size_t)kbt + (size_t)kb) * 32;
#pragma unroll
    for (int sp = 0; sp < 3; sp++) {
        uint32_t w[2];
#pragma unroll
        for (int p = 0; p < 2; p++)
            w[p] = dfk_split_part(v[2 * p], sp) | (dfk_split_part(v[2 * p + 1], sp) << 16);
        const uint32_t y0 = __shfl_down_sync(QFULL, w[0], 2), y1 = __shfl_down_sync(QFULL, w[1], 2);
        if (act && q4 < 2) { /* a 16-column block's four threads are all active or none */
            const int lane_o = (3 * (m & 1) + sp) * 4 + 2 * q4;
            dst[lane_o] = make_uint2(w[0], y0);
            dst[lane_o + 1] = make_uint2(w[1], y1);
        }
    }
}

/* One Hadamard butterfly: (a, b) -> (a + b, a − b). */
static __device__ __forceinline__ void q_bfly(float &a, float &b) {
    const float x = a, y = b;
    a = x + y;
    b = x - y;
}

/* The preparation of segment [s0, s0 + seg) of row m (seg <= 1024, a multiple of 4) by a
 * block of 256 threads, the segment in registers: thread tid holds elements 4tid..4tid+3 of
 * v = x (or silu(x)·up; xv, uv: this thread's x and up, loaded by the caller), times
 * inv·norm_w when norm_w (nwv: this thread's norm weights and sgv its signs of O's rotation,
 * loaded by the caller); writes them to hr (row m of h) when not
 * NULL; then, when O.xq, O's rotation and quantization. The Hadamard butterflies run in
 * registers (distance 1, 2), across lanes (4..64) and through xs (1024 floats of shared
 * memory; 128..512), each pair (a, b) -> (a + b, a − b) at each distance in the order of
 * df_hadamard_inplace, so the values are those of k_qprep. Every thread of the block calls it. */
static __device__ __forceinline__ void q_prep_seg(float4 xv, float4 uv, float4 nwv, float4 sgv, bool up,
                                                  const float *norm_w, float inv, int cols, int s0, int seg, float *hr,
                                                  uint32_t *xb, const dfk_qout &O, int m, float *xs) {
    const int tid = threadIdx.x, lane = tid & 31;
    const bool act = 4 * tid < seg;
    const int e0 = s0 + 4 * tid;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (act) {
        v[0] = xv.x;
        v[1] = xv.y;
        v[2] = xv.z;
        v[3] = xv.w;
        if (up) {
            v[0] = dfk_silu(v[0]) * uv.x;
            v[1] = dfk_silu(v[1]) * uv.y;
            v[2] = dfk_silu(v[2]) * uv.z;
            v[3] = dfk_silu(v[3]) * uv.w;
        }
        if (norm_w) {
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = (v[j] * inv) * (&nwv.x)[j];
        }
        if (hr) *reinterpret_cast<float4 *>(hr + e0) = make_float4(v[0], v[1], v[2], v[3]);
    }
    if (xb) q_bf16_frags(v, m, cols, e0, act, xb);
    if (!O.xq) return;
    const int hb = O.hb;
    if (hb > 0) {
        if (act) {
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = v[j] * (&sgv.x)[j];
        }
        if (hb >= 2) { /* distance 1 */
            q_bfly(v[0], v[1]);
            q_bfly(v[2], v[3]);
        }
        if (hb >= 4) { /* distance 2 */
            q_bfly(v[0], v[2]);
            q_bfly(v[1], v[3]);
        }
        for (int hh = 8; hh <= hb && hh <= 128; hh <<= 1) { /* distance hh/2: lanes differ by hh/8 */
            const int lm = hh >> 3;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float o = __shfl_xor_sync(QFULL, v[j], lm);
                v[j] = (lane & lm) ? (o - v[j]) : (v[j] + o);
            }
        }
        for (int hh = 256; hh <= hb; hh <<= 1) { /* distance hh/2: threads differ by hh/8 (other warps) */
            const int tm = hh >> 3;
            __syncthreads();
#pragma unroll
            for (int j = 0; j < 4; j++) xs[4 * tid + j] = v[j];
            __syncthreads();
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float o = xs[4 * (tid ^ tm) + j];
                v[j] = (tid & tm) ? (o - v[j]) : (v[j] + o);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = v[j] * O.hscale;
    }
    const int lg = O.gs == 128 ? 7 : 6; /* gs is 64 or 128 */
    q_group(O, m, cols >> lg, (s0 + 4 * tid) >> lg, tid & ((1 << (lg - 2)) - 1), act, v);
}

/* This thread's norm weights and rotation signs of segment s0 of k_qprep_fast's block (zeros
 * where it has none): weights, which no kernel writes, so they may be loaded before waiting
 * for the previous kernel. */
static __device__ __forceinline__ void q_prep_consts(const float *norm_w, const dfk_qout &O, int s0, int seg,
                                                     float4 &nwv, float4 &sgv) {
    nwv = sgv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (4 * (int)threadIdx.x < seg) {
        const int e0 = s0 + 4 * (int)threadIdx.x;
        if (norm_w) nwv = __ldg(reinterpret_cast<const float4 *>(norm_w + e0));
        if (O.xq && O.hb > 0) sgv = __ldg(reinterpret_cast<const float4 *>(O.signs + e0));
    }
}

/* The preparation block (m, segment s0 / seg, output oi) of k_qprep_fast, by a block of 256
 * threads (every thread calls it): the segment's loads, the row's RMSNorm scale, q_prep_seg
 * (nwv, sgv: q_prep_consts). red: 8 floats and xs: 1024 floats of shared memory (both may be
 * reused right after). */
static __device__ __forceinline__ void q_prep_block(const float *x, const float *up, const float *norm_w, float eps,
                                                    int cols, int seg, float *h, uint32_t *xb, const dfk_qout &O, int m,
                                                    int s0, int oi, float *red, float *xs, float4 nwv, float4 sgv) {
    const float *xr = x + (size_t)m * (size_t)cols;
    const float *ur = up ? up + (size_t)m * (size_t)cols : NULL;
    /* the segment's loads first: their latency overlaps the row sum's */
    float4 xv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), uv = xv;
    if (4 * (int)threadIdx.x < seg) {
        const int e0 = s0 + 4 * (int)threadIdx.x;
        xv = __ldcg(reinterpret_cast<const float4 *>(xr + e0));
        if (ur) uv = __ldcg(reinterpret_cast<const float4 *>(ur + e0));
    }
    const float inv = norm_w ? dfk_rms_inv(dfk_row_sumsq(xr, ur, cols, red), cols, eps) : 1.0f;
    q_prep_seg(xv, uv, nwv, sgv, ur != NULL, norm_w, inv, cols, s0, seg,
               (h && oi == 0) ? h + (size_t)m * (size_t)cols : NULL, oi == 0 ? xb : NULL, O, m, xs);
}

/* q_prep_block for block (m, segment, output o). */
__global__ void __launch_bounds__(256) k_qprep_fast(const float *x, const float *up, const float *norm_w, float eps,
                                                    int cols, int seg, float *h, uint32_t *xb,
                                                    const __grid_constant__ qprep_args P) {
    __shared__ float red[8];
    __shared__ float xs[1024];
    pdl_trigger(); /* before the trace's load: the next kernel's launch waits for every CTA's trigger */
    const dfk_tr_start trs = dfk_tr_begin();
    DFK_TR_PHASES_BEGIN();
    float4 nwv, sgv;
    q_prep_consts(norm_w, P.o[blockIdx.z], blockIdx.y * seg, seg, nwv, sgv);
    pdl_wait();
    dfk_tr_mark(trs, DFK_TR_SITE(10000), 0, 0);
    q_prep_block(x, up, norm_w, eps, cols, seg, h, xb, P.o[blockIdx.z], blockIdx.x, blockIdx.y * seg, blockIdx.z, red,
                 xs, nwv, sgv);
    DFK_TR_PHASE(10000, 9); /* the block's stores issued */
}

extern "C" int dfk_qprep(const float *x, const float *up, const float *norm_w, float eps, int M, int cols, int seg,
                         float *h, uint32_t *xb, int n, const dfk_qout *outs) {
    if (M < 1 || M > DFK_MAX_ROWS || n < 1 || n > DFK_QMAX || seg <= 0 || cols % seg != 0 || seg > DFK_QPREP_MAX_SEG)
        return (int)cudaErrorInvalidValue;
    if (xb && !dfk_qprep_takes_xb(cols, seg)) return (int)cudaErrorInvalidValue;
    qprep_args P;
    for (int i = 0; i < DFK_QMAX; i++) P.o[i] = i < n ? outs[i] : dfk_qout{};
    const size_t smem = (size_t)seg * sizeof(float);
    static size_t smem_set = 0;
    if (smem > 48 * 1024 && smem_set == 0) {
        cudaFuncSetAttribute(k_qprep, cudaFuncAttributeMaxDynamicSharedMemorySize, DFK_QPREP_MAX_SEG * 4);
        smem_set = 1;
    }
    const dim3 grid((unsigned)M, (unsigned)(cols / seg), (unsigned)n);
    if (seg <= 1024 && seg % 4 == 0 && cols % 4 == 0)
        return launch_pdl(k_qprep_fast, grid, dim3(256), 0, x, up, norm_w, eps, cols, seg, h, xb, P);
    return launch_pdl(k_qprep, grid, dim3(256), smem, x, up, norm_w, eps, cols, seg, h, P);
}

extern "C" int dfk_qprep_takes_xb(int cols, int seg) {
    return seg > 0 && seg <= 1024 && seg % 16 == 0 && cols % 16 == 0 && cols % seg == 0;
}

/* ---- the linear --------------------------------------------------------------------------------- */

static __device__ __forceinline__ void imma(int *d, const uint32_t *a, const uint32_t *b) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* Compile-time shape: BITS-bit codes in groups of GS, NT n-tiles (4 data rows each: columns
 * 2m', 2m'+1 = the high and low planes of row m'), TR 16-row tiles per warp, GP groups whose
 * code loads are issued together. */
template <int BITS, int GS, int NT, int TR>
struct qcfg {
    static constexpr int KBG = GS / 32;
    static constexpr int WPL = KBG * BITS / 2;
    static constexpr int VEC = WPL < 4 ? WPL : 4;
    static constexpr int NVEC = WPL / VEC;
    static constexpr int RPW = 8 / BITS;
    static constexpr int GP0 = 32 / (TR * WPL);
    static constexpr int GP = GP0 < 1 ? 1 : (GP0 > 8 ? 8 : GP0);
    static constexpr uint32_t MASK = BITS == 8 ? 0xffffffffu : ((1u << BITS) - 1u) * 0x01010101u;
};

/* Dense 16-bit linears of one input: block (or rider row) r computes output row r - start[i]
 * of linear i. */
struct dlaunch {
    dfk_dlin d[DFK_QMAX];
    int start[DFK_QMAX + 1];
    int n, M;
};

struct qlaunch {
    dfk_qlin d[DFK_QMAX];
    int start[DFK_QMAX + 1];
    int n, M, sbf; /* the scale format (dfk_linear_q): 1 bf16 (else fp16), plus 2 scales only (q_sb_pair) */
    int prefetch; /* 1: L2 prefetch of each warp's next batch of codes */
    int ring;     /* the kernel: 0 = k_lin_q, 1 = k_lin_qr (persistent) */
    int ctas;     /* k_lin_qr: CTAs (0: as many as fit) */
    int kwl[DFK_QMAX]; /* log2 of each linear's KW */
    int ring_off; /* k_lin_qr, k_lin_qb: byte offset of the rings in dynamic shared memory */
    int bulk;     /* 1: k_lin_qb where the input copy fits (dfk_qsched.bulk) */
    int diag;     /* experiments of k_lin_qb (dfk_set_q_diag): 8 = the input staged by every
                     thread's loads instead of bulk copies (the same bits); timing only: 2 = no
                     arithmetic, 4 = no scale/bias copies (wrong outputs) */
    int ride_first; /* k_lin_qb: 1 = the riders' rows right after the wait, before the units */
    int uq, ur;     /* CTA c of the grid runs units [c·uq + min(c, ur), ...): uq + 1 of them for
                       c < ur, else uq (q_grid_of, from the units and the grid size) */
    dlaunch dn;   /* dense linears riding along (k_lin_qb: their rows after the CTA's units; the
                     other kernels launch them first, as k_lin_dense); dn.n = 0: none */
};

/* The first weights of output row `row` of dense linear L that thread tid takes (the 8-column
 * chunks tid and tid + 256). */
static __device__ __forceinline__ void dense_preload(const dfk_dlin &L, int row, uint4 (&wq)[2]) {
    const uint16_t *wr = (const uint16_t *)L.w + (size_t)row * (size_t)L.cols;
    const int nch = L.cols / 8;
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int c = (int)threadIdx.x + u * 256;
        wq[u] = c < nch ? __ldcs(reinterpret_cast<const uint4 *>(wr) + c) : make_uint4(0u, 0u, 0u, 0u);
    }
}

/* Output row `row` of dense linear L for the M data rows, by a block of 256 threads (every
 * thread calls it; wq: dense_preload's words). Thread tid takes the 8-column chunks c = tid,
 * tid + 256, ... in order, each column in order; then per data row an xor butterfly per warp and
 * the 8 warp sums in order. red: [DFK_MAX_ROWS][8] floats of shared memory, free on entry.
 * Loads: per pass of two chunks, the next pass's weights and then the data rows' x of this pass
 * (rows in groups of four) are all issued before the arithmetic, so that a pass costs one round
 * trip to L2 rather than one per data row (the order of the operations does not change).
 * MR: the most data rows the caller can have (M <= MR); RGMAX: the most rows of one group
 * (registers: 16 floats of x per row of a group). */
template <int MR, int RGMAX = 4>
static __device__ __forceinline__ void dense_row(const dfk_dlin &L, int row, int M, uint4 (&wq)[2], float (*red)[8]) {
    constexpr int RG = MR < RGMAX ? MR : RGMAX; /* data rows whose x loads are in flight together */
    const int tid = threadIdx.x, cols = L.cols;
    const uint16_t *wr = (const uint16_t *)L.w + (size_t)row * (size_t)cols;
    const int nch = cols / 8;
    float acc[MR];
#pragma unroll
    for (int m = 0; m < MR; m++) acc[m] = 0.0f;
    for (int c0 = 0; c0 < nch; c0 += 512) {
        uint4 cur[2] = {wq[0], wq[1]};
        if (c0 + 512 < nch) {
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int c = c0 + 512 + tid + u * 256;
                wq[u] = c < nch ? __ldcs(reinterpret_cast<const uint4 *>(wr) + c) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        float w[2][8];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const uint32_t ws[4] = {cur[u].x, cur[u].y, cur[u].z, cur[u].w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                w[u][2 * k] = q_h16(ws[k], L.wdtype == 1);
                w[u][2 * k + 1] = q_h16(ws[k] >> 16, L.wdtype == 1);
            }
        }
#pragma unroll
        for (int m0 = 0; m0 < MR; m0 += RG) {
            if (m0 >= M) break;
            float4 xv[2][RG][2];
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int c = c0 + tid + u * 256;
#pragma unroll
                for (int mi = 0; mi < RG; mi++) {
                    if (c < nch && m0 + mi < M) {
                        const float4 *xp =
                            reinterpret_cast<const float4 *>(L.x + (size_t)(m0 + mi) * (size_t)cols) + 2 * c;
                        xv[u][mi][0] = __ldcg(xp);
                        xv[u][mi][1] = __ldcg(xp + 1);
                    } else {
                        xv[u][mi][0] = xv[u][mi][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < 2; u++) {
                if (c0 + tid + u * 256 >= nch) continue;
#pragma unroll
                for (int mi = 0; mi < RG; mi++) {
                    if (m0 + mi >= M) break;
                    const float xs[8] = {xv[u][mi][0].x, xv[u][mi][0].y, xv[u][mi][0].z, xv[u][mi][0].w,
                                         xv[u][mi][1].x, xv[u][mi][1].y, xv[u][mi][1].z, xv[u][mi][1].w};
#pragma unroll
                    for (int k = 0; k < 8; k++) acc[m0 + mi] = acc[m0 + mi] + w[u][k] * xs[k];
                }
            }
        }
    }
    const int lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int m = 0; m < MR; m++) {
        if (m >= M) break;
        float v = acc[m];
        for (int off = 16; off > 0; off >>= 1) v = v + __shfl_xor_sync(QFULL, v, off);
        if (lane == 0) red[m][warp] = v;
    }
    __syncthreads();
    if (tid < M) {
        float s = red[tid][0];
        for (int k = 1; k < 8; k++) s = s + red[tid][k];
        float *yp = L.y + (size_t)tid * (size_t)L.rows + (size_t)row;
        *yp = L.add ? __ldcg(yp) + s : s;
    }
}

template <int VEC>
static __device__ __forceinline__ void q_load_words(const uint32_t *p, uint32_t *w) {
    if (VEC == 4) {
        const uint4 q = __ldcs(reinterpret_cast<const uint4 *>(p));
        w[0] = q.x;
        w[VEC > 1 ? 1 : 0] = q.y;
        w[VEC > 2 ? 2 : 0] = q.z;
        w[VEC > 3 ? 3 : 0] = q.w;
    } else if (VEC == 2) {
        const uint2 q = __ldcs(reinterpret_cast<const uint2 *>(p));
        w[0] = q.x;
        w[VEC > 1 ? 1 : 0] = q.y;
    } else {
        w[0] = __ldcs(p);
    }
}

/* The B fragments of one group for n-tile nt (lane (g, t): data row 4nt + g/2, plane g % 2,
 * k-block kb: registers {k = 4t..4t+3, 4t+16..4t+19}) and the row's group scale and sum
 * (lane t: data row 4nt + t), from global memory (through L2) or from the CTA's shared copy
 * (SM). Zeros for rows >= M. */
template <int KBG, bool SM>
static __device__ __forceinline__ void q_load_b(const uint32_t *xq, const float *xe_p, const float *xs_p, int M, int ng,
                                                int grp, int nt, int g, int t, uint32_t (*bq)[2], float &xe,
                                                float &xs) {
    const int m = 4 * nt + (g >> 1), p = g & 1;
    if (m < M) {
        const size_t u2 = (((size_t)(m * 2 + p) * (size_t)ng + (size_t)grp) * 4 + (size_t)t) * (size_t)KBG;
        const uint4 *src = reinterpret_cast<const uint4 *>(xq) + u2 / 2;
#pragma unroll
        for (int k = 0; k < KBG / 2; k++) {
            const uint4 v = SM ? src[k] : __ldcg(src + k);
            bq[2 * k][0] = v.x;
            bq[2 * k][1] = v.y;
            bq[2 * k + 1][0] = v.z;
            bq[2 * k + 1][1] = v.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < KBG; k++) bq[k][0] = bq[k][1] = 0u;
    }
    const int mt = 4 * nt + t;
    const size_t i = (size_t)mt * (size_t)ng + (size_t)grp;
    xe = mt < M ? (SM ? xe_p[i] : __ldcg(&xe_p[i])) : 0.0f;
    xs = mt < M ? (SM ? xs_p[i] : __ldcg(&xs_p[i])) : 0.0f;
}

/* Bytes of the shared copy of a prepared input (SMB instances): the planes of M rows, then
 * 2^E and S·2^E per (row, group). */
static __host__ __device__ __forceinline__ size_t q_smem_bytes(int M, int cols, int gs) {
    return (size_t)M * 2 * (size_t)cols + (size_t)M * (size_t)(cols / gs) * 8;
}

/* L2 prefetch of the code and scale lines of one warp's share of a unit (tiles tile0.. of
 * linear L, groups kw, kw + KW, ...): 128-byte lines, spread over the lanes. */
template <int WPL, int TR>
static __device__ __forceinline__ void q_prefetch_unit(const dfk_qlin &L, int tile0, int tiles, int ng, int kw, int KW,
                                                       int lane, int sbw) {
    constexpr int LINES = WPL; /* WPL words x 32 lanes x 4 bytes = WPL lines of 128 bytes per (tile, group) */
    const int ngw = (ng - kw + KW - 1) / KW;
    const int n = TR * ngw * (LINES + 1);
    for (int i = lane; i < n; i += 32) {
        const int tr = i / (ngw * (LINES + 1)), r = i % (ngw * (LINES + 1));
        const int gi = r / (LINES + 1), ln = r % (LINES + 1);
        if (tile0 + tr >= tiles) continue;
        const size_t tg = (size_t)(tile0 + tr) * (size_t)ng + (size_t)(q_rec_of_group(kw, ng, q_kwl(KW)) + gi);
        const void *ptr = ln < LINES ? (const void *)(L.codes + tg * (size_t)(WPL * 32) + (size_t)ln * 32)
                                     : (const void *)(L.sb + tg * (size_t)sbw);
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
    }
}

/* The scale/bias words of lane row g of record tg (file comment): .x row g, .y row g + 8; scales
 * only (so): .x both scales. */
static __device__ __forceinline__ uint2 q_load_sb(const uint32_t *sb, size_t tg, int g, int so) {
    if (so) return make_uint2(__ldg(sb + tg * 8 + (size_t)g), 0u);
    return __ldg(reinterpret_cast<const uint2 *>(sb + (tg * 8 + (size_t)g) * 2));
}

/* The code words and scale/bias words of GP groups (gbase, gbase + KW, ...) for TR tiles,
 * all loads issued before any is used (zeros outside the weight); so: scales only. */
template <int GP, int TR, int WPL, int VEC, int NVEC>
static __device__ __forceinline__ void q_load_batch(const dfk_qlin &L, int tile0, const bool *tvalid, int ng,
                                                    int gbase, int KW, int lane, int g, int so, uint32_t (*wr)[TR][WPL],
                                                    uint2 (*sbv)[TR]) {
#pragma unroll
    for (int gi = 0; gi < GP; gi++) {
        const int grp = gbase + gi * KW;
#pragma unroll
        for (int tr = 0; tr < TR; tr++) {
            if (grp < ng && tvalid[tr]) {
                const size_t tg = (size_t)(tile0 + tr) * (size_t)ng + (size_t)q_rec_of_group(grp, ng, q_kwl(KW));
#pragma unroll
                for (int v = 0; v < NVEC; v++)
                    q_load_words<VEC>(L.codes + ((tg * NVEC + (size_t)v) * 32 + (size_t)lane) * VEC,
                                      &wr[gi][tr][v * VEC]);
                sbv[gi][tr] = q_load_sb(L.sb, tg, g, so);
            } else {
#pragma unroll
                for (int w = 0; w < WPL; w++) wr[gi][tr][w] = 0u;
                sbv[gi][tr] = make_uint2(0u, 0u);
            }
        }
    }
}

/* L2 prefetch of the code and scale lines of the GP groups gbase, gbase + KW, ... for TR tiles
 * (the warp's next batch: its loads then wait on L2, not DRAM). */
template <int GP, int TR, int WPL>
static __device__ __forceinline__ void q_prefetch_batch(const dfk_qlin &L, int tile0, const bool *tvalid, int ng,
                                                        int gbase, int KW, int lane, int sbw) {
    constexpr int PER = WPL + 1, N = GP * TR * PER;
    for (int i = lane; i < N; i += 32) {
        const int gi = i / (TR * PER), r = i % (TR * PER), tr = r / PER, ln = r % PER;
        const int grp = gbase + gi * KW;
        if (grp >= ng) continue;
        bool v = false;
#pragma unroll
        for (int k = 0; k < TR; k++)
            if (k == tr) v = tvalid[k];
        if (!v) continue;
        const size_t tg = (size_t)(tile0 + tr) * (size_t)ng + (size_t)q_rec_of_group(grp, ng, q_kwl(KW));
        const void *ptr = ln < WPL ? (const void *)(L.codes + tg * (size_t)(WPL * 32) + (size_t)ln * 32)
                                   : (const void *)(L.sb + tg * (size_t)sbw);
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
    }
}

/* The class of k-block kb of a group below 8 bits (0: codes in place, value q; 1: shifted up
 * by 4, value 16q; weight repacking) and A register j of k-block kb from this lane's words w. */
template <int BITS, int GS>
static __host__ __device__ __forceinline__ constexpr int q_code_class(int kb) {
    return BITS == 8 ? 0 : kb / (GS / 64);
}
template <int BITS, int GS>
static __device__ __forceinline__ uint32_t q_code_reg(const uint32_t *w, int kb, int j) {
    if constexpr (BITS == 8) {
        return w[kb * 4 + j];
    } else {
        constexpr int HW = 4 / BITS, HALF = GS / 64; /* positions per class in a word; k-blocks per class */
        constexpr uint32_t MASK = ((1u << BITS) - 1u) * 0x01010101u;
        const int r = (kb % HALF) * 4 + j, sub = r % HW;
        return (w[r / HW] >> (BITS * sub)) & (MASK << (4 * q_code_class<BITS, GS>(kb)));
    }
}

/* The scales and biases of rows g (s0, b0) and g + 8 (s1, b1) from a lane's sb words (sbf: the
 * launch's scale format, qlaunch.sbf). Scales only: b = −s, exactly the float of the bias that
 * the weight stores (its bits are the scale's with the sign flipped), so the same bits as the
 * scale/bias layout. */
static __device__ __forceinline__ void q_sb_pair(uint2 v, int sbf, float &s0, float &b0, float &s1, float &b1) {
    const int bf = sbf & 1;
    if (sbf & 2) {
        s0 = q_h16(v.x, bf);
        s1 = q_h16(v.x >> 16, bf);
        b0 = -s0;
        b1 = -s1;
    } else {
        s0 = q_h16(v.x, bf);
        b0 = q_h16(v.x >> 16, bf);
        s1 = q_h16(v.y, bf);
        b1 = q_h16(v.y >> 16, bf);
    }
}

/* One group's MMAs and epilogue for TR tiles and NT n-tiles (file comment): the codes w of
 * each tile (this lane's words), its scale/bias word pair sbv, the B fragments bq and the
 * rows' 2^E (xe) and S·2^E (xs); adds the group's terms to yv in the fixed order.
 *
 * Below 8 bits the k-blocks fall in two classes (q_code_class): the first half's codes are
 * taken with their low bits in place (value q), the second half's shifted up by 4 (value 16q),
 * so that each A register costs one mask (and a word one shift at 2 bits) where a shift and a
 * mask each were needed. The classes accumulate apart (exact integers, chains L and H), and
 * their sum 16·L + H = 16·D is used as it is: for these formats the prepared input holds
 * 2^(E−4) in place of 2^E (dfk_q_xe_shift), and float(16·D)·2^(E−4) = float(D)·2^E, the same
 * bits (where 2^(E−4) is a float: groups whose largest |x'| is at least 2^−131). */
template <int BITS, int GS, int NT, int TR>
static __device__ __forceinline__ void q_mma_group(const uint32_t (&w)[TR][qcfg<BITS, GS, NT, TR>::WPL],
                                                   const uint2 (&sbv)[TR],
                                                   const uint32_t (&bq)[NT][qcfg<BITS, GS, NT, TR>::KBG][2],
                                                   const float (&xe)[NT], const float (&xs)[NT], int sbf,
                                                   float (&yv)[TR][NT][2]) {
    typedef qcfg<BITS, GS, NT, TR> C;
    constexpr int KBG = C::KBG, NCH = BITS == 8 ? 1 : 2;
    int D[NCH][TR][NT][4];
#pragma unroll
    for (int h = 0; h < NCH; h++)
#pragma unroll
        for (int tr = 0; tr < TR; tr++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) D[h][tr][nt][0] = D[h][tr][nt][1] = D[h][tr][nt][2] = D[h][tr][nt][3] = 0;
#pragma unroll
    for (int kb = 0; kb < KBG; kb++)
#pragma unroll
        for (int tr = 0; tr < TR; tr++) {
            uint32_t a[4];
#pragma unroll
            for (int j = 0; j < 4; j++) a[j] = q_code_reg<BITS, GS>(w[tr], kb, j);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) imma(D[q_code_class<BITS, GS>(kb)][tr][nt], a, bq[nt][kb]);
        }
    /* lane (g, t): output rows g (D0, D1) and g + 8 (D2, D3), data row 4nt + t; the planes
     * combine exactly: D = 256·high + low; y += b·S·2^E, then y += s·(D·2^E), both fused
     * multiply-adds (fewer instructions than separate products and sums: measured 1-2% faster
     * decode) */
#pragma unroll
    for (int tr = 0; tr < TR; tr++) {
        float s0, b0, s1, b1;
        q_sb_pair(sbv[tr], sbf, s0, b0, s1, b1);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            int c[4];
#pragma unroll
            for (int i = 0; i < 4; i++) /* class H counts 16 times: 16·L + H = 16·D below 8 bits */
                c[i] = NCH == 1 ? D[0][tr][nt][i] : D[0][tr][nt][i] * 16 + D[NCH - 1][tr][nt][i];
            const int d0 = c[0] * 256 + c[1], d1 = c[2] * 256 + c[3];
            const float e = xe[nt], sx = xs[nt];
            yv[tr][nt][0] = fmaf(s0, (float)d0 * e, fmaf(b0, sx, yv[tr][nt][0]));
            yv[tr][nt][1] = fmaf(s1, (float)d1 * e, fmaf(b1, sx, yv[tr][nt][1]));
        }
    }
}

/* The end of a unit: the KW K-slice partial sums of each tile added in order kw = 0..KW−1
 * (through shared memory; every warp of the CTA calls it), then warp kw = 0 stores (or adds
 * to) y. */
template <int NT, int TR>
static __device__ __forceinline__ void q_finish(const dfk_qlin &L, float (*red)[TR * NT * 2][32], float (&yv)[TR][NT][2],
                                                int KW, int kw, int warp, int lane, int g, int t, int M, int tile0,
                                                const bool (&tvalid)[TR]) {
    if (KW > 1) dfk_kslice_sum<TR, NT>(red, yv, KW, kw, warp, lane);
    if (kw == 0) {
        float *y = L.y;
        const int rows = L.rows;
#pragma unroll
        for (int tr = 0; tr < TR; tr++) {
            if (!tvalid[tr]) continue;
            const int r0 = (tile0 + tr) * 16 + g, r1 = r0 + 8;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int m = 4 * nt + t;
                if (m >= M) continue;
                float *yr = y + (size_t)m * (size_t)rows;
                if (r0 < rows) yr[r0] = L.add ? __ldcg(&yr[r0]) + yv[tr][nt][0] : yv[tr][nt][0];
                if (r1 < rows) yr[r1] = L.add ? __ldcg(&yr[r1]) + yv[tr][nt][1] : yv[tr][nt][1];
            }
        }
    }
}

/* The prepared input of linear L (planes, 2^E, S·2^E) copied into the CTA's shared memory
 * (once per linear: staged holds the key of the linear whose copy is there); every thread of the CTA
 * calls it. Points bxq, bxe, bxs at the copy. */
template <int GS>
static __device__ __forceinline__ void q_stage_input(const dfk_qlin &L, int M, unsigned char *qsm, int key, int &staged,
                                                     const uint32_t *&bxq, const float *&bxe, const float *&bxs) {
    const int ng = L.cols / GS;
    const size_t nq = (size_t)M * 2 * (size_t)L.cols / 16, ne = (size_t)M * (size_t)ng;
    float *se = reinterpret_cast<float *>(qsm + nq * 16);
    if (staged != key) {
        __syncthreads(); /* the previous linear's copy may still be read */
        const uint4 *gq = reinterpret_cast<const uint4 *>(L.xq);
        uint4 *sq = reinterpret_cast<uint4 *>(qsm);
        for (size_t i = threadIdx.x; i < nq; i += 256) sq[i] = __ldcg(gq + i);
        for (size_t i = threadIdx.x; i < ne; i += 256) {
            se[i] = __ldcg(L.xe + i);
            se[ne + i] = __ldcg(L.xsx + i);
        }
        __syncthreads();
        staged = key;
    }
    bxq = reinterpret_cast<const uint32_t *>(qsm);
    bxe = se;
    bxs = se + ne;
}

/* Work unit u of a launch: linear di = the last with ustart[di] <= u, its tiles
 * (u − ustart[di])·RW·TR + rw·TR ... . */
static __device__ __forceinline__ int q_unit_lin(const qlaunch &P, int u) {
    int di = 0;
    while (di + 1 < P.n && u >= P.start[di + 1]) di++;
    return di;
}

/* A persistent grid: CTA c takes its run of units (qlaunch.uq, ur) in order. A unit = 8 warps =
 * RW row-warps x KW K-slices of one linear of the launch (units start[i] .. start[i+1]−1 belong
 * to linear i). Warp (rw, kw) handles TR tiles and the groups kw, kw + KW, ... in order; the KW
 * partial sums are added in order kw = 0..KW−1. While a unit runs, the lines of the CTA's next
 * unit are prefetched into L2. Which CTA computes a unit never changes its arithmetic. */
template <int BITS, int GS, int NT, int TR, int MINB, bool SMB>
__global__ void __launch_bounds__(256, MINB) k_lin_q(const __grid_constant__ qlaunch P) {
    typedef qcfg<BITS, GS, NT, TR> C;
    constexpr int KBG = C::KBG, WPL = C::WPL, VEC = C::VEC, NVEC = C::NVEC, GP = C::GP;
    __shared__ float red[8][TR * NT * 2][32];
    extern __shared__ __align__(16) unsigned char qsm[];
    pdl_trigger(); /* before the trace's load: the next kernel's launch waits for every CTA's trigger */
    const dfk_tr_start trs = dfk_tr_begin();
    const int c = (int)blockIdx.x;
    const int u_begin = c * P.uq + (c < P.ur ? c : P.ur), u_end = u_begin + P.uq + (c < P.ur ? 1 : 0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int M = P.M, sbf = P.sbf, so = (sbf >> 1) & 1, sbw = so ? 8 : 16;
    /* the first unit's first batch of codes, loaded before waiting for the previous kernel
     * (weights do not depend on it): the DRAM latency overlaps the wait and the staging */
    uint32_t wr[GP][TR][WPL];
    uint2 sbv[GP][TR];
    bool preloaded = false;
    if (u_begin < u_end) {
        const int di = q_unit_lin(P, u_begin);
        const dfk_qlin &L = P.d[di];
        const int KW = L.KW, RW = 8 / KW, ng = L.cols / GS, tiles = (L.rows + 15) / 16;
        const int tile0 = ((u_begin - P.start[di]) * RW + warp / KW) * TR;
        bool tv[TR];
#pragma unroll
        for (int tr = 0; tr < TR; tr++) tv[tr] = tile0 + tr < tiles;
        q_load_batch<GP, TR, WPL, VEC, NVEC>(L, tile0, tv, ng, warp % KW, KW, lane, g, so, wr, sbv);
        preloaded = true;
    }
    pdl_wait();
    dfk_tr_mark(trs, DFK_TR_SITE(10000), 0, 0);
    int staged = -1;
    for (int u = u_begin; u < u_end; u++) {
        const int di = q_unit_lin(P, u);
        const dfk_qlin &L = P.d[di];
        const int KW = L.KW, kw = warp % KW, rw = warp / KW, RW = 8 / KW;
        const int rows = L.rows, tiles = (rows + 15) / 16, ng = L.cols / GS;
        const int tile0 = ((u - P.start[di]) * RW + rw) * TR;
        if (u + 1 < u_end) {
            const int dn = q_unit_lin(P, u + 1);
            const dfk_qlin &Ln = P.d[dn];
            const int KWn = Ln.KW, RWn = 8 / KWn;
            q_prefetch_unit<WPL, TR>(Ln, ((u + 1 - P.start[dn]) * RWn + warp / KWn) * TR, (Ln.rows + 15) / 16,
                                     Ln.cols / GS, warp % KWn, KWn, lane, sbw);
        }
        bool tvalid[TR];
#pragma unroll
        for (int tr = 0; tr < TR; tr++) tvalid[tr] = tile0 + tr < tiles;
        const uint32_t *bxq = L.xq;
        const float *bxe = L.xe, *bxs = L.xsx;
        if constexpr (SMB) q_stage_input<GS>(L, M, qsm, di, staged, bxq, bxe, bxs);

        float yv[TR][NT][2];
#pragma unroll
        for (int tr = 0; tr < TR; tr++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) yv[tr][nt][0] = yv[tr][nt][1] = 0.0f;

        for (int gbase = kw; gbase < ng; gbase += KW * GP) {
            /* the code and scale loads of GP groups at once */
            if (!preloaded)
                q_load_batch<GP, TR, WPL, VEC, NVEC>(L, tile0, tvalid, ng, gbase, KW, lane, g, so, wr, sbv);
            preloaded = false;
            if (P.prefetch && gbase + KW * GP < ng)
                q_prefetch_batch<GP, TR, WPL>(L, tile0, tvalid, ng, gbase + KW * GP, KW, lane, sbw);
            /* B fragments: from shared memory (SMB) or from L2, group gi+1's loaded before
             * group gi's MMAs */
            uint32_t bq[2][NT][KBG][2];
            float xe[2][NT], xs[2][NT];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                q_load_b<KBG, SMB>(bxq, bxe, bxs, M, ng, gbase, nt, g, t, bq[0][nt], xe[0][nt], xs[0][nt]);
#pragma unroll
            for (int gi = 0; gi < GP; gi++) {
                const int grp = gbase + gi * KW;
                if (grp >= ng) break;
                if (gi + 1 < GP && grp + KW < ng) {
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
                        q_load_b<KBG, SMB>(bxq, bxe, bxs, M, ng, grp + KW, nt, g, t, bq[(gi + 1) & 1][nt],
                                           xe[(gi + 1) & 1][nt], xs[(gi + 1) & 1][nt]);
                }
                q_mma_group<BITS, GS, NT, TR>(wr[gi], sbv[gi], bq[gi & 1], xe[gi & 1], xs[gi & 1], sbf, yv);
            }
        }
        preloaded = false; /* (a warp without groups in this unit never used its preload) */
        q_finish<NT, TR>(L, red, yv, KW, kw, warp, lane, g, t, M, tile0, tvalid);
    }
}

/* ---- the streaming variant: a ring of code tiles in shared memory ---------------------------
 *
 * Same units, K-slices and arithmetic as k_lin_q (q_mma_group, q_finish: the same bits), one
 * tile per warp, on a persistent grid: CTA c runs its run of units (qlaunch.uq, ur) and each warp
 * streams its (unit, group) steps through a ring of QS slots in shared memory filled by
 * cp.async, QS − 1 steps ahead, across the ends of units and linears. A lane copies its own
 * code words and scale/bias pair of a step and reads back only those: its own
 * cp.async.wait_group is the only synchronization the ring needs. The per-step work is kept to
 * pointer increments (the decode is bound by instruction issue as much as by memory). The
 * CTA's warps stay in step: one contiguous run of units per CTA, a CTA barrier in each unit's
 * K-slice sum and one copy of the input per CTA. Variants that let them drift apart (units
 * taken from a counter, units interleaved over CTAs, K-slice sums by the last warp to arrive,
 * per-warp input copies) all measured slower (docs/PERFORMANCE.md). */

template <int BYTES>
static __device__ __forceinline__ void cp_async(uint32_t saddr, const void *gmem) {
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(gmem) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(saddr), "l"(gmem), "n"(BYTES) : "memory");
}
static __device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Ring slots per warp and bytes per slot (the lane's code words, then its scale/bias pair, or its
 * two scales and 4 bytes unused). */
template <int WPL>
struct qring {
    static constexpr int QS = WPL <= 4 ? 8 : (WPL <= 8 ? 4 : 2);
    static constexpr int SLOT = (WPL + 2) * 32 * 4;
    static constexpr int BYTES = 8 * QS * SLOT; /* 8 warps */
};

/* A warp's copy cursor: the global addresses of its lane's words of the next step to copy,
 * the steps left in that unit, the unit, and the byte strides of a step. */
struct q_icur {
    const char *codes, *sb;
    int left, u, di;
    unsigned step_c, step_s;
};

/* The first unit u' in [u, u_end) in which this warp has steps (u_end: none): the linear di of
 * unit u' (units only move forward, so di is where the search starts), the warp's first record
 * tg (tile·ng + record position of its K-slice) and its number of steps nj. */
template <int GS>
static __device__ __forceinline__ int q_next_run(const qlaunch &P, int u, int u_end, int &di, int warp, size_t &tg,
                                                 int &nj) {
    for (; u < u_end; u++) {
        while (di + 1 < P.n && u >= P.start[di + 1]) di++;
        const dfk_qlin &L = P.d[di];
        const int kwl = P.kwl[di], KW = 1 << kwl, kw = warp & (KW - 1), ng = L.cols / GS;
        const int tile = ((u - P.start[di]) << (3 - kwl)) + (warp >> kwl);
        nj = kw < ng ? (ng - kw + KW - 1) >> kwl : 0;
        if (tile >= (L.rows + 15) / 16 || nj == 0) continue;
        tg = (size_t)tile * (size_t)ng + (size_t)q_rec_of_group(kw, ng, kwl);
        break;
    }
    return u;
}

/* Points the cursor at the first step of unit u (or of the first later unit with steps for
 * this warp; c.u == u_end: none left). di: the linear of unit u (units only move forward). SO:
 * scales only (file comment). */
template <int BITS, int GS, int SO>
static __device__ __forceinline__ void q_icur_unit(const qlaunch &P, int u, int u_end, int di, int warp, int lane,
                                                   int g, q_icur &c) {
    typedef qcfg<BITS, GS, 1, 1> C;
    size_t tg = 0;
    int nj = 0;
    c.u = q_next_run<GS>(P, u, u_end, di, warp, tg, nj);
    c.di = di;
    if (c.u >= u_end) return;
    c.codes = reinterpret_cast<const char *>(P.d[di].codes + (tg * C::NVEC * 32 + (size_t)lane) * C::VEC);
    c.sb = reinterpret_cast<const char *>(P.d[di].sb + (SO ? tg * 8 + (size_t)g : (tg * 8 + (size_t)g) * 2));
    c.left = nj;
    c.step_c = (unsigned)(C::WPL * 128); /* the warp's records are contiguous */
    c.step_s = SO ? 32u : 64u;
}

/* Issues the copies of the cursor's step into the ring slot at shared address saddr and
 * advances the cursor (nothing when no step is left). */
template <int BITS, int GS, int SO>
static __device__ __forceinline__ void q_icur_issue(const qlaunch &P, int u_end, int warp, int lane, int g,
                                                    uint32_t saddr, q_icur &c) {
    typedef qcfg<BITS, GS, 1, 1> C;
    constexpr int VEC = C::VEC, NVEC = C::NVEC, WPL = C::WPL;
    if (c.u >= u_end) return;
#pragma unroll
    for (int v = 0; v < NVEC; v++)
        cp_async<VEC * 4>(saddr + (uint32_t)(lane * 4 * VEC + v * 128 * VEC), c.codes + v * 128 * VEC);
    cp_async<SO ? 4 : 8>(saddr + (uint32_t)(WPL * 128 + lane * 8), c.sb);
    c.codes += c.step_c;
    c.sb += c.step_s;
    if (--c.left == 0) q_icur_unit<BITS, GS, SO>(P, c.u + 1, u_end, c.di, warp, lane, g, c);
}

/* One step's B fragments and 2^E, S·2^E through the step pointers (zeros for rows >= M). */
template <int KBG, int NT, bool SMB>
static __device__ __forceinline__ void q_load_bfrag(const uint4 *const (&bp)[NT], const float *const (&ep)[NT],
                                                    const float *const (&sp)[NT], const bool (&bok)[NT],
                                                    const bool (&eok)[NT], uint32_t (&b)[NT][KBG][2], float (&e)[NT],
                                                    float (&sx)[NT]) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        if (bok[nt]) {
#pragma unroll
            for (int k = 0; k < KBG / 2; k++) {
                const uint4 v = SMB ? bp[nt][k] : __ldcg(bp[nt] + k);
                b[nt][2 * k][0] = v.x;
                b[nt][2 * k][1] = v.y;
                b[nt][2 * k + 1][0] = v.z;
                b[nt][2 * k + 1][1] = v.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < KBG; k++) b[nt][k][0] = b[nt][k][1] = 0u;
        }
        e[nt] = eok[nt] ? (SMB ? *ep[nt] : __ldcg(ep[nt])) : 0.0f;
        sx[nt] = eok[nt] ? (SMB ? *sp[nt] : __ldcg(sp[nt])) : 0.0f;
    }
}

/* The lane's scale/bias words in a ring slot at shared address a (SO: scales only, .y unused). */
template <int SO>
static __device__ __forceinline__ void q_ring_sb(uint32_t a, uint2 &sbv) {
    if constexpr (SO) {
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(sbv.x) : "r"(a) : "memory");
        sbv.y = 0u;
    } else {
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(sbv.x), "=r"(sbv.y) : "r"(a) : "memory");
    }
}

/* The lane's code words and scale/bias pair of the ring slot at shared address caddr. */
template <int BITS, int GS, int SO>
static __device__ __forceinline__ void q_ring_read(uint32_t caddr, int lane, uint32_t (&w)[qcfg<BITS, GS, 1, 1>::WPL],
                                                   uint2 &sbv) {
    typedef qcfg<BITS, GS, 1, 1> C;
    constexpr int WPL = C::WPL, VEC = C::VEC, NVEC = C::NVEC;
#pragma unroll
    for (int v = 0; v < NVEC; v++) {
        const uint32_t a = caddr + (uint32_t)(lane * 4 * VEC + v * 128 * VEC);
        if constexpr (VEC == 4)
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(w[v * VEC]), "=r"(w[v * VEC + (VEC > 1 ? 1 : 0)]), "=r"(w[v * VEC + (VEC > 2 ? 2 : 0)]),
                           "=r"(w[v * VEC + (VEC > 3 ? 3 : 0)])
                         : "r"(a)
                         : "memory");
        else if constexpr (VEC == 2)
            asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n"
                         : "=r"(w[v * VEC]), "=r"(w[v * VEC + (VEC > 1 ? 1 : 0)])
                         : "r"(a)
                         : "memory");
        else
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w[v * VEC]) : "r"(a) : "memory");
    }
    q_ring_sb<SO>(caddr + (uint32_t)(WPL * 128 + lane * 8), sbv);
}

/* One step of a warp: waits for its ring slot, reads the lane's codes and scale/bias pair,
 * loads the next step's B fragments (bn, en, sn: pointers advanced by one step) and adds the
 * group's terms (q_mma_group) using the current ones (b, e, s). */
template <int BITS, int GS, int NT, int QS, bool SMB, int SBF>
static __device__ __forceinline__ void q_ring_step(uint32_t caddr, int lane, bool more,
                                                   const uint32_t (&b)[NT][qcfg<BITS, GS, NT, 1>::KBG][2],
                                                   const float (&e)[NT], const float (&sx)[NT],
                                                   uint32_t (&bn)[NT][qcfg<BITS, GS, NT, 1>::KBG][2], float (&en)[NT],
                                                   float (&sn)[NT], const uint4 *const (&bp)[NT],
                                                   const float *const (&ep)[NT], const float *const (&sp)[NT],
                                                   const bool (&bok)[NT], const bool (&eok)[NT],
                                                   float (&yv)[1][NT][2]) {
    typedef qcfg<BITS, GS, NT, 1> C;
    constexpr int KBG = C::KBG, WPL = C::WPL, VEC = C::VEC, NVEC = C::NVEC;
    if (more) q_load_bfrag<KBG, NT, SMB>(bp, ep, sp, bok, eok, bn, en, sn);
    cp_async_wait<QS - 1>();
    uint32_t w[1][WPL];
    uint2 sbv[1];
#pragma unroll
    for (int v = 0; v < NVEC; v++) {
        const uint32_t a = caddr + (uint32_t)(lane * 4 * VEC + v * 128 * VEC);
        if constexpr (VEC == 4)
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                         : "=r"(w[0][v * VEC]), "=r"(w[0][v * VEC + (VEC > 1 ? 1 : 0)]),
                           "=r"(w[0][v * VEC + (VEC > 2 ? 2 : 0)]), "=r"(w[0][v * VEC + (VEC > 3 ? 3 : 0)])
                         : "r"(a)
                         : "memory");
        else if constexpr (VEC == 2)
            asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n"
                         : "=r"(w[0][v * VEC]), "=r"(w[0][v * VEC + (VEC > 1 ? 1 : 0)])
                         : "r"(a)
                         : "memory");
        else
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w[0][v * VEC]) : "r"(a) : "memory");
    }
    q_ring_sb<(SBF >> 1) & 1>(caddr + (uint32_t)(WPL * 128 + lane * 8), sbv[0]);
    q_mma_group<BITS, GS, NT, 1>(w, sbv, b, e, sx, SBF, yv);
}

/* One work unit u (of linear di of launch P) of the ring kernels: its warp's steps through the
 * ring (caddr: the warp's current slot, advanced; iss.issue(saddr) copies the warp's next step
 * into the slot just read), then the K-slice sum and the store. key: the staged-input key of
 * q_stage_input. Every thread of the CTA calls it. */
template <int BITS, int GS, int NT, bool SMB, int SBF, class Iss>
static __device__ __forceinline__ void q_unit_ring(const qlaunch &P, int di, int u, int key, int &staged,
                                                   unsigned char *qsm, float (*red)[NT * 2][32], uint32_t &caddr,
                                                   uint32_t ring0, uint32_t ring_end, Iss &iss, int warp, int lane,
                                                   int g, int t) {
    typedef qcfg<BITS, GS, NT, 1> C;
    typedef qring<C::WPL> R;
    constexpr int KBG = C::KBG, QS = R::QS, SLOT = R::SLOT;
    const int M = P.M;
    const dfk_qlin &L = P.d[di];
    const int kwl = P.kwl[di], KW = 1 << kwl, kw = warp & (KW - 1), ng = L.cols / GS, tiles = (L.rows + 15) / 16;
    const int tile0 = ((u - P.start[di]) << (3 - kwl)) + (warp >> kwl);
    const bool tvalid[1] = {tile0 < tiles};
    const int nj = (tvalid[0] && kw < ng) ? (ng - kw + KW - 1) >> kwl : 0;
    const uint32_t *bxq = L.xq;
    const float *bxe = L.xe, *bxs = L.xsx;
    if constexpr (SMB) q_stage_input<GS>(L, M, qsm, key, staged, bxq, bxe, bxs);
    float yv[1][NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) yv[0][nt][0] = yv[0][nt][1] = 0.0f;
    /* B fragment pointers at group kw (lane (g, t): data row 4nt + g/2, plane g % 2; its
     * 2^E and S·2^E: row 4nt + t), advanced by KW groups per step */
    const uint4 *bp[NT];
    const float *ep[NT], *sp[NT];
    bool bok[NT], eok[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const int m = 4 * nt + (g >> 1), p = g & 1, mt = 4 * nt + t;
        bok[nt] = m < M;
        eok[nt] = mt < M;
        bp[nt] = reinterpret_cast<const uint4 *>(bxq) +
                 ((((size_t)(bok[nt] ? m : 0) * 2 + (size_t)p) * (size_t)ng + (size_t)kw) * 4 + (size_t)t) * (KBG / 2);
        ep[nt] = bxe + (size_t)(eok[nt] ? mt : 0) * (size_t)ng + (size_t)kw;
        sp[nt] = bxs + (size_t)(eok[nt] ? mt : 0) * (size_t)ng + (size_t)kw;
    }
    const size_t bstep = (size_t)KW * 4 * (KBG / 2);
    uint32_t b0[NT][KBG][2], b1[NT][KBG][2];
    float e0[NT], s0[NT], e1[NT], s1[NT];
    /* step 0's fragments, then two steps per iteration (the buffers alternate) */
#define Q_ADVANCE()                                                                                                    \
do {                                                                                                               \
    _Pragma("unroll") for (int nt = 0; nt < NT; nt++) {                                                            \
        bp[nt] += bstep;                                                                                           \
        ep[nt] += KW;                                                                                              \
        sp[nt] += KW;                                                                                              \
    }                                                                                                              \
} while (0)
    if constexpr (SMB) {
        /* B from shared memory: two steps per iteration, both loaded up front (no
         * prefetch ring needed), their MMA chains independent */
        int j = 0;
#pragma unroll 1
        for (; j + 1 < nj; j += 2) {
            uint32_t ba[NT][KBG][2], bb[NT][KBG][2];
            float ea[NT], sa[NT], eb[NT], sb2[NT];
            q_load_bfrag<KBG, NT, true>(bp, ep, sp, bok, eok, ba, ea, sa);
            Q_ADVANCE();
            q_load_bfrag<KBG, NT, true>(bp, ep, sp, bok, eok, bb, eb, sb2);
            Q_ADVANCE();
            const uint32_t caddr2 = caddr + SLOT == ring_end ? ring0 : caddr + SLOT;
            cp_async_wait<QS >= 2 ? QS - 2 : 0>();
            uint32_t wa[1][C::WPL], wb[1][C::WPL];
            uint2 sva[1], svb[1];
            q_ring_read<BITS, GS, (SBF >> 1) & 1>(caddr, lane, wa[0], sva[0]);
            q_ring_read<BITS, GS, (SBF >> 1) & 1>(caddr2, lane, wb[0], svb[0]);
            q_mma_group<BITS, GS, NT, 1>(wa, sva, ba, ea, sa, SBF, yv);
            q_mma_group<BITS, GS, NT, 1>(wb, svb, bb, eb, sb2, SBF, yv);
            iss.issue(caddr);
            cp_async_commit();
            iss.issue(caddr2);
            cp_async_commit();
            caddr = caddr2 + SLOT == ring_end ? ring0 : caddr2 + SLOT;
        }
        if (j < nj) {
            uint32_t ba[NT][KBG][2];
            float ea[NT], sa[NT];
            q_load_bfrag<KBG, NT, true>(bp, ep, sp, bok, eok, ba, ea, sa);
            Q_ADVANCE();
            cp_async_wait<QS - 1>();
            uint32_t wa[1][C::WPL];
            uint2 sva[1];
            q_ring_read<BITS, GS, (SBF >> 1) & 1>(caddr, lane, wa[0], sva[0]);
            q_mma_group<BITS, GS, NT, 1>(wa, sva, ba, ea, sa, SBF, yv);
            iss.issue(caddr);
            cp_async_commit();
            caddr = caddr + SLOT == ring_end ? ring0 : caddr + SLOT;
        }
    } else {
    if (nj > 0) {
        q_load_bfrag<KBG, NT, false>(bp, ep, sp, bok, eok, b0, e0, s0);
        Q_ADVANCE();
    }
#pragma unroll 1
    for (int j = 0; j < nj; j += 2) {
        q_ring_step<BITS, GS, NT, QS, SMB, SBF>(caddr, lane, j + 1 < nj, b0, e0, s0, b1, e1, s1, bp, ep, sp, bok,
                                                 eok, yv);
        Q_ADVANCE();
        iss.issue(caddr);
        cp_async_commit();
        caddr += SLOT;
        if (caddr == ring_end) caddr = ring0;
        if (j + 1 < nj) {
            q_ring_step<BITS, GS, NT, QS, SMB, SBF>(caddr, lane, j + 2 < nj, b1, e1, s1, b0, e0, s0, bp, ep, sp,
                                                     bok, eok, yv);
            Q_ADVANCE();
            iss.issue(caddr);
            cp_async_commit();
            caddr += SLOT;
            if (caddr == ring_end) caddr = ring0;
        }
    }
    }
#undef Q_ADVANCE
    q_finish<NT, 1>(L, red, yv, KW, kw, warp, lane, g, t, M, tile0, tvalid);
}

/* The issuer of k_lin_qr: the cursor over the CTA's units [.., u_end) of launch P. */
template <int BITS, int GS, int SO>
struct q_issue_launch {
    const qlaunch &P;
    q_icur &c;
    int u_end, warp, lane, g;
    __device__ __forceinline__ void issue(uint32_t saddr) {
        q_icur_issue<BITS, GS, SO>(P, u_end, warp, lane, g, saddr, c);
    }
};

template <int BITS, int GS, int NT, int MINB, bool SMB, int SBF>
__global__ void __launch_bounds__(256, MINB) k_lin_qr(const __grid_constant__ qlaunch P) {
    typedef qring<qcfg<BITS, GS, NT, 1>::WPL> R;
    constexpr int QS = R::QS, SLOT = R::SLOT;
    __shared__ float red[8][NT * 2][32];
    extern __shared__ __align__(16) unsigned char qsm[];
    pdl_trigger(); /* before the trace's load: the next kernel's launch waits for every CTA's trigger */
    const dfk_tr_start trs = dfk_tr_begin();
    const int c = (int)blockIdx.x;
    const int u_begin = c * P.uq + (c < P.ur ? c : P.ur), u_end = u_begin + P.uq + (c < P.ur ? 1 : 0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    /* this warp's ring of QS slots */
    const uint32_t ring0 = (uint32_t)__cvta_generic_to_shared(qsm + P.ring_off) + (uint32_t)(warp * QS * SLOT);
    const uint32_t ring_end = ring0 + (uint32_t)(QS * SLOT);
    /* the first QS steps' copies, issued before waiting for the previous kernel (weights do
     * not depend on it); one commit group per step, empty ones past the end */
    q_icur ic;
    q_icur_unit<BITS, GS, (SBF >> 1) & 1>(P, u_begin, u_end, 0, warp, lane, g, ic);
#pragma unroll 1
    for (int k = 0; k < QS; k++) {
        q_icur_issue<BITS, GS, (SBF >> 1) & 1>(P, u_end, warp, lane, g, ring0 + (uint32_t)(k * SLOT), ic);
        cp_async_commit();
    }
    pdl_wait();
    dfk_tr_mark(trs, DFK_TR_SITE(10000), 0, 0);
    int staged = -1, di = 0;
    uint32_t caddr = ring0;
    q_issue_launch<BITS, GS, (SBF >> 1) & 1> iss{P, ic, u_end, warp, lane, g};
    for (int u = u_begin; u < u_end; u++) {
        while (di + 1 < P.n && u >= P.start[di + 1]) di++;
        q_unit_ring<BITS, GS, NT, SMB, SBF>(P, di, u, di, staged, qsm, red, caddr, ring0, ring_end, iss, warp, lane, g,
                                            t);
    }
    cp_async_wait<0>();
}

/* ---- the bulk-copy variant: a warp's run of records through the tensor memory accelerator ---
 *
 * Same units, K-slices and arithmetic as k_lin_q and k_lin_qr (q_mma_group, q_finish: the same
 * bits). A warp's steps of a unit are one contiguous run of records (record order above); lane
 * 0 copies them, up to QC records at a time, with cp.async.bulk into a ring of NS stages
 * in shared memory, one mbarrier per stage (the copy's byte count completes it); the lanes only
 * wait on the stage's barrier and read their own words. The prepared input is copied into
 * shared memory once per linear (three bulk copies where its arrays are whole 16-byte lines),
 * with a zero record that the lanes of data rows >= M read instead: a step's loads take no
 * conditions. What a step issues is the fragment and code loads, the code unpacking, the MMAs
 * and the epilogue; what a unit adds is the K-slice sum, and lane 0's copy cursor moves to the
 * next unit's run by two pointer increments (the search only at a linear's last unit). */

/* Resident CTAs per SM asked of the compiler for one n-tile (registers for three), but for the
 * 8 x 2 and 6 x 2 rings, which leave room for two at most where qb_shape picks them. */
#define QB_MINB 3

/* The ring of k_lin_qb: NS stages per warp of up to QC records each (qb_shape), by bulk copies
 * of whole stages (the records of a warp's unit, up to QC, in one copy: fewer waits and copies
 * per record; measured on the H200, plain decoding, 6 x 2 against 2 x 4: 170.6-172.3 against
 * 155.3-162.6 tok/s). */
template <int WPL, int NS, int QC, int SBB = 64>
struct qbulk {
    static constexpr int CB = WPL * 128;          /* code bytes of a record (32 lanes x WPL words) */
    static constexpr int STAGE = QC * (CB + SBB); /* QC records' codes, then their sb rows of SBB bytes
                                                     (64; 32 with scales only) */
    static constexpr int RING = NS * STAGE;      /* per warp */
    static constexpr int BYTES = 8 * RING + 8 * NS * 8 + 16; /* 8 warps' rings, their mbarriers, the input copy's */
};

/* Lane 0's copy cursor: the next records of the warp's runs over the CTA's units [.., u_end):
 * the run's next code and scale/bias bytes, the records left in it, its unit u and linear di.
 * Within a linear, the run of unit u + 1 starts jc, js bytes after the end of unit u's (same
 * K-slice, the next tiles) and has nj records, for units below ufast (the linear's units but its
 * last, whose tiles may lie partly outside the weight: there the search of qb_cur_unit runs);
 * those four are kept in shared memory (qb_jump), read once per unit (registers are short). */
struct qb_cur {
    const char *codes, *sb;
    int left, u, di;
};
struct qb_jump {
    unsigned jc, js;
    int nj, ufast;
};

/* Points the cursor at the run of unit u (or of the first later unit where this warp has
 * records; c.u == u_end: none left). */
template <int BITS, int GS, int SBB>
static __device__ __forceinline__ void qb_cur_unit(const qlaunch &P, int u, int u_end, int di, int warp, qb_cur &c,
                                                   qb_jump &J) {
    constexpr int WPL = qcfg<BITS, GS, 1, 1>::WPL;
    size_t tg = 0;
    int nj = 0;
    c.u = q_next_run<GS>(P, u, u_end, di, warp, tg, nj);
    c.di = di;
    if (c.u >= u_end) return;
    c.codes = reinterpret_cast<const char *>(P.d[di].codes + tg * (size_t)(WPL * 32));
    c.sb = reinterpret_cast<const char *>(P.d[di].sb + tg * (SBB / 4));
    c.left = nj;
    const unsigned recs = (unsigned)((8 >> P.kwl[di]) * (P.d[di].cols / GS) - nj); /* records between two runs */
    J.jc = recs * (unsigned)(WPL * 128);
    J.js = recs * (unsigned)SBB;
    J.nj = nj;
    J.ufast = P.start[di + 1] - 1;
}

/* Lane 0: the cursor's next (up to QC) records into the stage at shared address stage, on its
 * barrier bar; advances the cursor. Nothing when no record is left. */
template <int BITS, int GS, int QC, int SBB>
static __device__ __forceinline__ void qb_issue(const qlaunch &P, int u_end, int warp, uint32_t stage, uint32_t bar,
                                                qb_cur &c, qb_jump &J) {
    typedef qbulk<qcfg<BITS, GS, 1, 1>::WPL, 1, QC, SBB> B;
    if (c.u >= u_end) return;
    const int n = c.left < QC ? c.left : QC;
    const bool sb = !(P.diag & 4);
    mbar_expect(bar, (unsigned)(n * (B::CB + (sb ? SBB : 0))));
    bulk_copy(stage, c.codes, (unsigned)(n * B::CB), bar);
    if (sb) bulk_copy(stage + (uint32_t)(QC * B::CB), c.sb, (unsigned)(n * SBB), bar);
    c.codes += n * B::CB;
    c.sb += n * SBB;
    c.left -= n;
    if (c.left == 0) {
        if (c.u + 1 < J.ufast && c.u + 1 < u_end) { /* the next unit's run: the next tiles of this K-slice */
            c.u++;
            c.codes += J.jc;
            c.sb += J.js;
            c.left = J.nj;
        } else {
            qb_cur_unit<BITS, GS, SBB>(P, c.u + 1, u_end, c.di, warp, c, J);
        }
    }
}

/* Bytes of the prepared input of M rows of `cols` columns in k_lin_qb's shared memory: the
 * planes, then 2^E and then S·2^E per (row, group), each of the two arrays padded to 16 bytes
 * (qb_stage_input; the padding is computed there, in qb_lin_of and in k_lin_qb as well). */
static __host__ __device__ __forceinline__ size_t qb_in_bytes(int M, int cols, int gs) {
    const size_t ne = (size_t)M * (size_t)(cols / gs) * 4;
    return (size_t)M * 2 * (size_t)cols + 2 * ((ne + 15) & ~(size_t)15);
}

/* Thread tid of nthr copies its share of linear L's prepared input into shared memory at qsm:
 * nq 16-byte words of planes, then the ne values 2^E at byte nq·16 and S·2^E at byte
 * nq·16 + sxo. The loads of four rounds are issued before their stores (the input was just
 * written by the previous kernel: one L2 round trip per four rounds). */
static __device__ __forceinline__ void qb_copy_input(const dfk_qlin &L, int nq, int ne, unsigned sxo,
                                                     unsigned char *qsm, int tid, int nthr) {
    const uint4 *gq = reinterpret_cast<const uint4 *>(L.xq);
    uint4 *sq = reinterpret_cast<uint4 *>(qsm);
    float *se = reinterpret_cast<float *>(qsm + (size_t)nq * 16);
    float *ss = reinterpret_cast<float *>(qsm + (size_t)nq * 16 + sxo);
    constexpr int R = 4;
    for (int i0 = tid; i0 < nq || i0 < ne; i0 += R * nthr) {
        uint4 v[R];
        float e[R], sx[R];
#pragma unroll
        for (int k = 0; k < R; k++) {
            const int i = i0 + k * nthr;
            if (i < nq) v[k] = __ldcg(gq + i);
            if (i < ne) {
                e[k] = __ldcg(L.xe + i);
                sx[k] = __ldcg(L.xsx + i);
            }
        }
#pragma unroll
        for (int k = 0; k < R; k++) {
            const int i = i0 + k * nthr;
            if (i < nq) sq[i] = v[k];
            if (i < ne) {
                se[i] = e[k];
                ss[i] = sx[k];
            }
        }
    }
}

/* The prepared input of linear L in shared memory at qsm (shared address smem0), once per
 * linear (staged holds the key of the linear whose copy is there): the planes of the M rows,
 * then 2^E per (row, group), then at sxo bytes after those S·2^E. Every thread of the CTA calls
 * it. Where the three arrays are whole 16-byte lines, thread 0 copies them with three bulk
 * copies that complete on the mbarrier ibar (its phase in iparity) and the others wait on it;
 * otherwise every thread copies its share (qb_copy_input). The same bytes either way. */
static __device__ __forceinline__ void qb_stage_input(const dfk_qlin &L, int M, int gs, unsigned char *qsm,
                                                      uint32_t smem0, uint32_t ibar, unsigned &iparity, int key,
                                                      int &staged, unsigned sxo, bool copy) {
    if (staged == key) return;
    const int ng = L.cols / gs;
    const unsigned nqb = (unsigned)(M * 2 * L.cols), neb = (unsigned)(M * ng * 4);
    __syncthreads(); /* the previous linear's copy may still be read */
    const bool bulk = !copy && ((nqb | neb) & 15u) == 0 &&
                      (((uintptr_t)L.xq | (uintptr_t)L.xe | (uintptr_t)L.xsx) & 15u) == 0;
    if (bulk) {
        if (threadIdx.x == 0) {
            /* the generic-proxy reads of the previous copy (ordered by the barrier) before the
             * bulk copies' writes */
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            mbar_expect(ibar, nqb + 2 * neb);
            bulk_copy(smem0, L.xq, nqb, ibar);
            bulk_copy(smem0 + nqb, L.xe, neb, ibar);
            bulk_copy(smem0 + nqb + sxo, L.xsx, neb, ibar);
        }
        mbar_wait(ibar, iparity);
        iparity ^= 1u;
    } else {
        qb_copy_input(L, (int)(nqb / 16), M * ng, sxo, qsm, threadIdx.x, 256);
        __syncthreads();
    }
    staged = key;
}

/* How a warp of k_lin_qb addresses the prepared input of one linear in shared memory (byte
 * offsets in qsm): its lanes' B fragments (ba) and 2^E (ea) at the first group of its K-slice,
 * their steps per record (bst, est), and S·2^E at ea + sxo. */
template <int NT>
struct qb_lin {
    uint32_t ba[NT], ea[NT], bst[NT], est[NT], sxo;
};

/* qb_lin for warp K-slice kw of KW, a linear of `cols` columns, M rows. Lanes of data rows >= M
 * read the zero record (at byte offset zero) for their B fragments, so their products are zero,
 * and row 0's 2^E and S·2^E (finite values; those rows' outputs are never stored). */
template <int GS, int NT>
static __device__ __forceinline__ qb_lin<NT> qb_lin_of(int M, int cols, int kw, int KW, int lane, uint32_t zero) {
    constexpr int KBG = GS / 32;
    const int ng = cols / GS, g = lane >> 2, t = lane & 3;
    const uint32_t nqb = (uint32_t)(M * 2 * cols), neb = (uint32_t)(M * ng * 4);
    qb_lin<NT> A;
    A.sxo = (neb + 15u) & ~15u;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const int m = 4 * nt + (g >> 1), p = g & 1, mt = 4 * nt + t < M ? 4 * nt + t : 0;
        A.ba[nt] = m < M ? (uint32_t)((((m * 2 + p) * ng + kw) * 4 + t) * (KBG / 2) * 16) : zero;
        A.bst[nt] = m < M ? (uint32_t)(KW * 4 * (KBG / 2) * 16) : 0u;
        A.ea[nt] = nqb + (uint32_t)((mt * ng + kw) * 4);
        A.est[nt] = (uint32_t)(KW * 4);
    }
    return A;
}

/* Step r of a ring stage (stp: the stage; C records per stage): this lane's B fragments and
 * 2^E, S·2^E at byte offsets ba, ea, ea + A.sxo of qsm (ba, ea advanced by A.bst, A.est), its
 * code words and its scale/bias pair. Plain loads: they stay after the stage's barrier wait
 * (whose asm clobbers memory), and the compiler may move them ahead of an earlier step's MMAs. */
template <int BITS, int GS, int NT, int SBB>
static __device__ __forceinline__ void qb_load_step(const unsigned char *qsm, const unsigned char *stp, int r, int C,
                                                    int lane, int g, uint32_t (&ba)[NT], uint32_t (&ea)[NT],
                                                    const qb_lin<NT> &A,
                                                    uint32_t (&bq)[NT][qcfg<BITS, GS, NT, 1>::KBG][2], float (&e)[NT],
                                                    float (&sx)[NT], uint32_t (&w)[qcfg<BITS, GS, NT, 1>::WPL],
                                                    uint2 &sbv) {
    typedef qcfg<BITS, GS, NT, 1> Q;
    constexpr int KBG = Q::KBG, VEC = Q::VEC, NVEC = Q::NVEC, CB = Q::WPL * 128;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const uint4 *bp = reinterpret_cast<const uint4 *>(qsm + ba[nt]);
#pragma unroll
        for (int k = 0; k < KBG / 2; k++) {
            const uint4 v = bp[k];
            bq[nt][2 * k][0] = v.x;
            bq[nt][2 * k][1] = v.y;
            bq[nt][2 * k + 1][0] = v.z;
            bq[nt][2 * k + 1][1] = v.w;
        }
        e[nt] = *reinterpret_cast<const float *>(qsm + ea[nt]);
        sx[nt] = *reinterpret_cast<const float *>(qsm + ea[nt] + A.sxo);
        ba[nt] += A.bst[nt];
        ea[nt] += A.est[nt];
    }
#pragma unroll
    for (int v = 0; v < NVEC; v++) {
        const unsigned char *a = stp + r * CB + (v * 32 + lane) * VEC * 4;
        if constexpr (VEC == 4) {
            const uint4 q = *reinterpret_cast<const uint4 *>(a);
            w[v * 4] = q.x;
            w[v * 4 + (VEC > 1 ? 1 : 0)] = q.y;
            w[v * 4 + (VEC > 2 ? 2 : 0)] = q.z;
            w[v * 4 + (VEC > 3 ? 3 : 0)] = q.w;
        } else if constexpr (VEC == 2) {
            const uint2 q = *reinterpret_cast<const uint2 *>(a);
            w[v * 2] = q.x;
            w[v * 2 + (VEC > 1 ? 1 : 0)] = q.y;
        } else {
            w[v] = *reinterpret_cast<const uint32_t *>(a);
        }
    }
    if constexpr (SBB == 32) /* scales only: rows g and g + 8 in one word */
        sbv = make_uint2(*reinterpret_cast<const uint32_t *>(stp + C * CB + r * 32 + g * 4), 0u);
    else
        sbv = *reinterpret_cast<const uint2 *>(stp + C * CB + r * 64 + g * 8);
}

/* The steps of one warp in a unit of k_lin_qb: nj records through the warp's ring (stages at
 * ring0, barriers at bar0; stage and parity: the ring's cursor), their groups' terms summed
 * into yv in order (zeroed first), the input addressed as A says (qb_lin_of). Lane 0 refills
 * each stage once read, by issue(stage address, barrier address). */
template <int BITS, int GS, int NT, int SBF, int NS, int QC, class Iss>
static __device__ __forceinline__ void qb_unit_steps(const qlaunch &P, const qb_lin<NT> A, int lane, int nj,
                                                     const unsigned char *qsm, uint32_t smem0, uint32_t ring0,
                                                     uint32_t bar0, int &stage, unsigned &parity,
                                                     float (&yv)[1][NT][2], Iss issue) {
    typedef qcfg<BITS, GS, NT, 1> C;
    constexpr int SBB = SBF & 2 ? 32 : 64;
    typedef qbulk<C::WPL, NS, QC, SBB> B;
    constexpr int KBG = C::KBG, WPL = C::WPL;
    const int g = lane >> 2;
    uint32_t ba[NT], ea[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        ba[nt] = A.ba[nt];
        ea[nt] = A.ea[nt];
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++) yv[0][nt][0] = yv[0][nt][1] = 0.0f;
#pragma unroll 1
    for (int j = 0; j < nj; j += QC) {
        const int n = nj - j < QC ? nj - j : QC;
        const uint32_t st = ring0 + (uint32_t)(stage * B::STAGE), bar = bar0 + (uint32_t)(8 * stage);
        mbar_wait(bar, parity);
        const unsigned char *stp = qsm + (st - smem0);
        if (P.diag & 2) {
            /* timing experiment: the copies only */
        } else {
            /* the stage's records two at a time: both records' loads first, then the groups in
             * order (the MMA chains of the two overlap; the sums into yv keep their order) */
            int r = 0;
#pragma unroll 1
            for (; r + 2 <= n; r += 2) {
                uint32_t bq[2][NT][KBG][2], w[2][1][WPL];
                float e[2][NT], sx[2][NT];
                uint2 sbv[2][1];
#pragma unroll
                for (int h = 0; h < 2; h++)
                    qb_load_step<BITS, GS, NT, SBB>(qsm, stp, r + h, QC, lane, g, ba, ea, A, bq[h], e[h], sx[h],
                                                    w[h][0], sbv[h][0]);
#pragma unroll
                for (int h = 0; h < 2; h++) q_mma_group<BITS, GS, NT, 1>(w[h], sbv[h], bq[h], e[h], sx[h], SBF, yv);
            }
            if (r < n) {
                uint32_t bq[NT][KBG][2], w[1][WPL];
                float e[NT], sx[NT];
                uint2 sbv[1];
                qb_load_step<BITS, GS, NT, SBB>(qsm, stp, r, QC, lane, g, ba, ea, A, bq, e, sx, w[0], sbv[0]);
                q_mma_group<BITS, GS, NT, 1>(w, sbv, bq, e, sx, SBF, yv);
            }
        }
        /* the stage is read: lane 0 refills it with the run's next records */
        __syncwarp();
        if (lane == 0) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            issue(st, bar);
        }
        if (++stage == NS) {
            stage = 0;
            parity ^= 1u;
        }
    }
}

/* The rows of the dense linears riding along with a k_lin_qb launch that fall to CTA cta of
 * G: rows cta, cta + G, ... of the riders' rows laid end to end (dense_row: k_lin_dense's bits).
 * red: DFK_MAX_ROWS x 8 floats of shared memory. Every thread of the CTA calls it. */
template <int MR, int RG>
static __device__ __forceinline__ void qb_riders(const qlaunch &P, int cta, int G, int M, float (*red)[8]) {
    if (P.dn.n <= 0) return;
    const int total = P.dn.start[P.dn.n];
    for (int r = cta; r < total; r += G) {
        int dj = 0;
        while (dj + 1 < P.dn.n && r >= P.dn.start[dj + 1]) dj++;
        uint4 wq[2];
        dense_preload(P.dn.d[dj], r - P.dn.start[dj], wq);
        __syncthreads(); /* red is free */
        dense_row<MR, RG>(P.dn.d[dj], r - P.dn.start[dj], M, wq, red);
    }
}

/* Dynamic shared memory of k_lin_qb: the input copy (in bytes, then a 64-byte zero record),
 * then at P.ring_off the rings and barriers (qbulk::BYTES). */
template <int BITS, int GS, int NT, int SBF, int NS, int QC>
__global__ void __launch_bounds__(256, NT == 1 && QC < 6 ? QB_MINB : 2) k_lin_qb(const __grid_constant__ qlaunch P) {
    typedef qcfg<BITS, GS, NT, 1> C;
    constexpr int SBB = SBF & 2 ? 32 : 64;
    typedef qbulk<C::WPL, NS, QC, SBB> B;
    __shared__ float red[8][NT * 2][32];
    __shared__ qb_jump jump[8];
    extern __shared__ __align__(128) unsigned char qsm[];
    pdl_trigger(); /* before the trace's load: the next kernel's launch waits for every CTA's trigger */
    const dfk_tr_start trs = dfk_tr_begin();
    const int G = (int)gridDim.x, cta = (int)blockIdx.x;
    if (P.dn.n > 0) { /* this CTA's rider rows (after its units) into L2 now: weights, no wait */
        for (int r = cta; r < P.dn.start[P.dn.n]; r += G) {
            int dj = 0;
            while (dj + 1 < P.dn.n && r >= P.dn.start[dj + 1]) dj++;
            const dfk_dlin &D = P.dn.d[dj];
            const uintptr_t b0 = (uintptr_t)D.w + (uintptr_t)(r - P.dn.start[dj]) * (uintptr_t)D.cols * 2u;
            const uintptr_t l0 = b0 & ~(uintptr_t)127, b1 = b0 + (uintptr_t)D.cols * 2u;
            for (uintptr_t a = l0 + (uintptr_t)threadIdx.x * 128u; a < b1; a += (uintptr_t)blockDim.x * 128u)
                asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a));
        }
    }
    const int u_begin = cta * P.uq + (cta < P.ur ? cta : P.ur), u_end = u_begin + P.uq + (cta < P.ur ? 1 : 0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const uint32_t smem0 = (uint32_t)__cvta_generic_to_shared(qsm);
    const uint32_t ring0 = smem0 + (uint32_t)P.ring_off + (uint32_t)(warp * B::RING);
    const uint32_t bar0 = smem0 + (uint32_t)P.ring_off + (uint32_t)(8 * B::RING) + (uint32_t)(warp * NS * 8);
    const uint32_t zero = (uint32_t)P.ring_off - 64u; /* byte offset in qsm */
    if (threadIdx.x < 16) reinterpret_cast<uint32_t *>(qsm + P.ring_off - 64)[threadIdx.x] = 0u;
    const uint32_t ibar = smem0 + (uint32_t)P.ring_off + (uint32_t)(8 * B::RING + 8 * NS * 8); /* the input copy's */
    if (lane == 0) {
        for (int s = 0; s < NS; s++) mbar_init(bar0 + (uint32_t)(8 * s), 1u);
        if (warp == 0) mbar_init(ibar, 1u); /* its first use is after a CTA barrier */
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
    /* the first stages' copies, issued before waiting for the previous kernel (weights do not
     * depend on it) */
    qb_cur cur;
    if (lane == 0) {
        qb_cur_unit<BITS, GS, SBB>(P, u_begin, u_end, 0, warp, cur, jump[warp]);
        for (int s = 0; s < NS; s++)
            qb_issue<BITS, GS, QC, SBB>(P, u_end, warp, ring0 + (uint32_t)(s * B::STAGE), bar0 + (uint32_t)(8 * s), cur,
                                   jump[warp]);
    }
    pdl_wait();
    dfk_tr_mark(trs, DFK_TR_SITE(10000), 0, 0);
    if (P.ride_first) { /* the riders first: their latency under the ring's first copies */
        qb_riders<4 * NT, NT == 1 && QC < 6 ? 2 : 4>(P, cta, G, P.M, reinterpret_cast<float(*)[8]>(&red[0][0][0]));
        __syncthreads(); /* red is the units' again */
    }
    /* the linear of the current unit (di; its units end at lin_end) and what its units share:
     * this warp's K-slice kw of KW = 2^kwl, its records per unit nj, its first tile less the
     * linear's first unit's (tbase); the input's addresses (qb_lin_of) are recomputed per unit,
     * which costs a few instructions where keeping them took registers and spilled */
    int staged = -1, di = -1, lin_end = 0, stage = 0, kwl = 0, kw = 0, tiles = 0, nj = 0, tbase = 0;
    unsigned parity = 0, iparity = 0;
    const int M = P.M;
    for (int u = u_begin; u < u_end; u++) {
        if (u >= lin_end) {
            do {
                di++;
            } while (u >= P.start[di + 1]); /* u < P.start[P.n] */
            const dfk_qlin &L = P.d[di];
            const int ng = L.cols / GS;
            kwl = P.kwl[di];
            kw = warp & ((1 << kwl) - 1);
            tiles = (L.rows + 15) / 16;
            nj = kw < ng ? (ng - kw + (1 << kwl) - 1) >> kwl : 0;
            tbase = (warp >> kwl) - (P.start[di] << (3 - kwl));
            lin_end = P.start[di + 1];
            qb_stage_input(L, M, GS, qsm, smem0, ibar, iparity, di, staged,
                           ((unsigned)(M * ng * 4) + 15u) & ~15u, (P.diag & 8) != 0);
        }
        const dfk_qlin &L = P.d[di];
        const int tile0 = (u << (3 - kwl)) + tbase;
        const bool tvalid[1] = {tile0 < tiles};
        float yv[1][NT][2];
        qb_unit_steps<BITS, GS, NT, SBF, NS, QC>(
            P, qb_lin_of<GS, NT>(M, L.cols, kw, 1 << kwl, lane, zero), lane, tvalid[0] ? nj : 0, qsm, smem0, ring0,
            bar0, stage, parity, yv,
            [&](uint32_t st, uint32_t bar) { qb_issue<BITS, GS, QC, SBB>(P, u_end, warp, st, bar, cur, jump[warp]); });
        q_finish<NT, 1>(L, red, yv, 1 << kwl, kw, warp, lane, g, t, M, tile0, tvalid);
    }
    if (threadIdx.x == 0 && g_tr_buf) { /* trace: the units' end; aux = the launch's weight KiB */
        size_t wb = 0;
        for (int i = 0; i < P.n; i++)
            wb += (size_t)P.d[i].rows * (size_t)P.d[i].cols * BITS / 8 + (size_t)P.d[i].rows * (P.d[i].cols / GS) * 4;
        dfk_tr_mark(trs, DFK_TR_SITE(10000), 1, (unsigned)(wb >> 10));
    }
    /* the dense linears riding along: their rows over the CTAs, after the units (the bits of
     * k_lin_dense) */
    if (!P.ride_first) {
        static_assert(sizeof(red) >= sizeof(float) * DFK_MAX_ROWS * 8, "red holds dense_row's sums");
        qb_riders<4 * NT, NT == 1 && QC < 6 ? 2 : 4>(P, cta, G, M, reinterpret_cast<float(*)[8]>(&red[0][0][0]));
    }
}


/* A grid of G CTAs for launch P: sets P's units per CTA (qlaunch.uq, ur). */
static dim3 q_grid_of(qlaunch &P, unsigned G) {
    const unsigned U = (unsigned)P.start[P.n];
    P.uq = (int)(U / G);
    P.ur = (int)(U % G);
    return dim3(G);
}

template <int BITS, int GS, int NT, int TR>
static int launch_q(qlaunch P, unsigned blocks);
static int dense_launch(const dlaunch &P);
static int dense_plan(int M, int n, const dfk_dlin *lins, dlaunch *P);

/* The dense linears riding along with P, launched on their own before a kernel that does not
 * take them (all but k_lin_qb); P.dn.n = 0 afterwards. */
static int dense_first(qlaunch &P) {
    if (P.dn.n == 0) return 0;
    const int st = dense_launch(P.dn);
    P.dn.n = 0;
    return st;
}

static int g_qsmem = 1;
static size_t g_qsmem_max = (size_t)-1;
extern "C" void dfk_set_qsmem(int on) { g_qsmem = on ? 1 : 0; }
extern "C" void dfk_set_qsmem_max(size_t bytes) { g_qsmem_max = bytes; }

/* Shared copies of the prepared input up to this size (two CTAs per SM still fit). */
#define Q_SMEM_MAX (100 * 1024)

static int g_q_sms = 132, g_q_persist = 0, g_q_prefetch = 1;
/* 1 (default): persistent grids of g_q_sms x CTAs per SM (each CTA the floor or ceiling of U/G
 * units); 0: the fewest CTAs that give every CTA the same number of units, which leaves SMs
 * with fewer CTAs than others (dfk_set_q_full_grid; H200: plain decoding 166.8 against 163.0 tok/s, verify passes
 * 1-2% faster, docs/PERFORMANCE.md) */
static int g_q_full_grid = 1;
extern "C" void dfk_set_q_full_grid(int on) { g_q_full_grid = on != 0; }
extern "C" void dfk_set_q_prefetch(int on) { g_q_prefetch = on ? 1 : 0; }
extern "C" void dfk_set_q_sm_count(int n) { g_q_sms = n > 0 ? n : 132; }
extern "C" void dfk_set_q_persistent(int on) { g_q_persist = on ? 1 : 0; }

/* `units` work units: one CTA each (default), or a persistent grid of MINB CTAs per SM
 * (dfk_set_q_persistent; measured slower on the H200). */
template <int BITS, int GS, int NT, int TR>
static int launch_q(qlaunch P, unsigned units) {
    constexpr int MINB = NT <= 2 ? 2 : 1;
    const unsigned cap = (unsigned)(g_q_sms * MINB);
    const dim3 blocks = q_grid_of(P, (g_q_persist && units > cap) ? cap : units);
    if constexpr (NT <= 2) {
        size_t smem = 0;
        for (int i = 0; i < P.n; i++) {
            const size_t b = q_smem_bytes(P.M, P.d[i].cols, GS);
            if (b > smem) smem = b;
        }
        if (g_qsmem && smem <= Q_SMEM_MAX) {
            static bool attr = false;
            if (!attr) {
                cudaFuncSetAttribute(k_lin_q<BITS, GS, NT, TR, MINB, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     Q_SMEM_MAX);
                attr = true;
            }
            return launch_pdl(k_lin_q<BITS, GS, NT, TR, MINB, true>, blocks, dim3(256), smem, P);
        }
    }
    return launch_pdl(k_lin_q<BITS, GS, NT, TR, MINB, false>, blocks, dim3(256), 0, P);
}

/* Shared memory a k_lin_qr CTA may take for the input copy and the rings. */
#define QR_SMEM_MAX (200 * 1024)

/* Resident CTAs per SM of a 256-thread kernel with `smem` bytes of dynamic shared memory (its
 * cap raised to QR_SMEM_MAX on first use), cached per launcher instance in c. */
struct q_occ {
    bool attr;
    size_t smem;
    int per;
};
template <typename K>
static int q_occupancy(K kern, size_t smem, q_occ &c) {
    if (!c.attr) {
        cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, QR_SMEM_MAX);
        c.attr = true;
    }
    if (c.smem != smem || c.per == 0) {
        int per = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kern, 256, smem) != cudaSuccess || per < 1) per = 1;
        c.per = per;
        c.smem = smem;
    }
    return c.per;
}

/* CTAs of a persistent grid over `units` work units: P.ctas, or per_sm on every SM, lowered so
 * that every CTA runs ceil(units/G) or one unit fewer. */
static unsigned q_grid(const qlaunch &P, unsigned units, int per_sm) {
    unsigned blocks = P.ctas > 0 ? (unsigned)P.ctas : (unsigned)(g_q_sms * per_sm);
    if (blocks > units) blocks = units;
    if (g_q_full_grid) return blocks; /* every SM's share of CTAs: CTAs run floor or ceil of U/G units */
    const unsigned per = (units + blocks - 1) / blocks;
    return (units + per - 1) / per;
}

/* The dynamic shared memory of a k_lin_qb launch with NS ring stages (in: the input copy's
 * bytes, rounded up to 128) for scale format sbf (qlaunch.sbf), and its kernel. The scales-only
 * instances exist for 2-bit codes only (q_linear_launch refuses the others). */
template <int BITS, int GS, int NT, int NS, int QC>
static size_t qb_smem(size_t in, int sbf) {
    typedef qcfg<BITS, GS, NT, 1> C; /* the zero record in the last 64 bytes before the rings */
    return in + 128 + (sbf & 2 ? qbulk<C::WPL, NS, QC, 32>::BYTES : qbulk<C::WPL, NS, QC, 64>::BYTES);
}
template <int BITS, int GS, int NT, int NS, int QC>
static void (*qb_kernel(int sbf))(qlaunch) {
    if constexpr (BITS == 2) {
        if (sbf & 2) return sbf & 1 ? k_lin_qb<BITS, GS, NT, 3, NS, QC> : k_lin_qb<BITS, GS, NT, 2, NS, QC>;
    }
    return sbf & 1 ? k_lin_qb<BITS, GS, NT, 1, NS, QC> : k_lin_qb<BITS, GS, NT, 0, NS, QC>;
}

static int g_q_diag = 0;
/* k_lin_qb's ring shape for one and for two n-tiles: 0 = by occupancy; 1..3 = qb_shape 0..2
 * (dfk_set_q_stage) */
static int g_q_stage[2] = {0, 0};
extern "C" void dfk_set_q_stage(int which) {
    const int a = which >= 10 ? which / 10 : which, b = which >= 10 ? which % 10 : which;
    g_q_stage[0] = a >= 0 && a <= 3 ? a : 0;
    g_q_stage[1] = b >= 0 && b <= 3 ? b : 0;
}
extern "C" void dfk_set_q_diag(int bits) { g_q_diag = bits & 14; }
static int g_ride_first = 0;
extern "C" void dfk_set_ride_first(int on) { g_ride_first = on ? 1 : 0; }
/* Ring shape I (0..2) of k_lin_qb for NT n-tiles, by preference: records per stage QC x stages
 * per warp NS; one n-tile 8 x 2, 6 x 2, 2 x 3; two n-tiles 4 x 2, 2 x 3, 2 x 2. Its kernel and
 * its dynamic shared memory for an input copy of `in` bytes. (A 10 x 2 shape first, which takes
 * a warp's 10 records of a unit of the 5120-column linears in one stage where 8 x 2 takes two,
 * measured the same on the H200: docs/PERFORMANCE.md.) */
template <int NT, int I>
struct qb_shape {
    static constexpr int QC = NT == 1 ? (I == 0 ? 8 : (I == 1 ? 6 : 2)) : (I == 0 ? 4 : 2);
    static constexpr int NS = NT == 1 ? (I == 2 ? 3 : 2) : (I == 1 ? 3 : 2);
};
template <int BITS, int GS, int NT, int I>
static void qb_shape_kernel(int sbf, size_t in, void (*&kern)(qlaunch), size_t &smem) {
    typedef qb_shape<NT, I> S;
    kern = qb_kernel<BITS, GS, NT, S::NS, S::QC>(sbf);
    smem = qb_smem<BITS, GS, NT, S::NS, S::QC>(in, sbf);
}

/* k_lin_qb on a persistent grid (q_grid), when the input copy fits in shared memory beside the
 * rings; returns 0 (and launches nothing) when it does not. The ring shape is the first of
 * qb_shape's that keeps two CTAs per SM (or as many as any shape gives, when that is one), or the
 * one dfk_set_q_stage names; it never changes the arithmetic. Measured on the H200 (plain
 * decoding, 8 x 2 at two CTAs per SM against 6 x 2 at three: 175.4-177.0 against
 * 166.8-168.6 tok/s; t(4), where 8 x 2 leaves one CTA per SM, 7.04 against 6.85 ms). */
template <int BITS, int GS, int NT>
static int launch_qb(qlaunch P, unsigned units, int *st) {
    size_t in = 0;
    for (int i = 0; i < P.n; i++) {
        const size_t b = qb_in_bytes(P.M, P.d[i].cols, GS);
        if (b > in) in = b;
    }
    in = (in + 127) & ~(size_t)127;
    if (in > g_qsmem_max) return 0;
    /* the shape is chosen by the shared memory of the layout with biases, also for weights stored
     * as their scales alone (whose smaller stages would let the 8 x 2 ring fill an SM's shared
     * memory with two CTAs at 4 rows of 5120 columns, leaving the L1 cache almost nothing:
     * measured on the H200, t(4) 5.67 against 5.47 ms: docs/PERFORMANCE.md) */
    void (*kern[3])(qlaunch), (*kern_b[3])(qlaunch);
    size_t smem[3], smem_b[3];
    qb_shape_kernel<BITS, GS, NT, 0>(P.sbf, in, kern[0], smem[0]);
    qb_shape_kernel<BITS, GS, NT, 1>(P.sbf, in, kern[1], smem[1]);
    qb_shape_kernel<BITS, GS, NT, 2>(P.sbf, in, kern[2], smem[2]);
    qb_shape_kernel<BITS, GS, NT, 0>(P.sbf & 1, in, kern_b[0], smem_b[0]);
    qb_shape_kernel<BITS, GS, NT, 1>(P.sbf & 1, in, kern_b[1], smem_b[1]);
    qb_shape_kernel<BITS, GS, NT, 2>(P.sbf & 1, in, kern_b[2], smem_b[2]);
    static q_occ occ[3][2];
    int per[3] = {0, 0, 0}, most = 0;
    const int want = g_q_stage[NT - 1];
    for (int i = 0; i < 3; i++) {
        if (smem_b[i] > QR_SMEM_MAX || (want > 0 && i != want - 1)) continue;
        per[i] = q_occupancy(kern_b[i], smem_b[i], occ[i][P.sbf & 1]);
        most = per[i] > most ? per[i] : most;
    }
    int best = -1;
    for (int i = 0; i < 3 && best < 0; i++)
        if (per[i] > 0 && per[i] >= (most < 2 ? most : 2)) best = i;
    if (best < 0) return 0;
    const int best_per = per[best]; /* the grid as with biases (the same CTAs per SM, or fewer) */
    if (P.sbf & 2) { /* the scales-only kernel's shared memory cap (set at its first use) */
        static q_occ occ_so[3][2];
        (void)q_occupancy(kern[best], smem[best], occ_so[best][P.sbf & 1]);
    }
    P.ring_off = (int)(in + 128);
    const dim3 grid = q_grid_of(P, q_grid(P, units, best_per));
    *st = launch_pdl(kern[best], grid, dim3(256), smem[best], P);
    return 1;
}

/* k_lin_qr on a persistent grid: G CTAs (P.ctas, or as many as fit on the device at once,
 * lowered so that every CTA runs ceil(U/G) or one unit fewer); the input copy in shared
 * memory when it fits beside the rings. */
template <int BITS, int GS, int NT>
static int launch_qr(qlaunch P, unsigned units) {
    if constexpr (NT <= 2) { /* M <= 4; M <= 8 where P.bulk is 2 */
        int st = 0;
        if (P.bulk >= NT && g_qsmem) {
            if (launch_qb<BITS, GS, NT>(P, units, &st)) return st;
        }
    }
    if (const int dst = dense_first(P)) return dst;
    constexpr int MINB = NT == 1 ? 3 : (NT == 2 ? 2 : 1);
    typedef qring<qcfg<BITS, GS, NT, 1>::WPL> R;
    size_t in = 0;
    for (int i = 0; i < P.n; i++) {
        const size_t b = q_smem_bytes(P.M, P.d[i].cols, GS);
        if (b > in) in = b;
    }
    in = (in + 15) & ~(size_t)15;
    const bool smb = g_qsmem && in + R::BYTES <= QR_SMEM_MAX && in <= g_qsmem_max;
    P.ring_off = smb ? (int)in : 0;
    const size_t smem = (smb ? in : 0) + R::BYTES;
    void (*kern)(qlaunch) = P.sbf & 1 ? (smb ? k_lin_qr<BITS, GS, NT, MINB, true, 1> : k_lin_qr<BITS, GS, NT, MINB, false, 1>)
                                      : (smb ? k_lin_qr<BITS, GS, NT, MINB, true, 0> : k_lin_qr<BITS, GS, NT, MINB, false, 0>);
    if constexpr (BITS == 2) { /* scales only (file comment) */
        if (P.sbf & 2)
            kern = P.sbf & 1 ? (smb ? k_lin_qr<BITS, GS, NT, MINB, true, 3> : k_lin_qr<BITS, GS, NT, MINB, false, 3>)
                             : (smb ? k_lin_qr<BITS, GS, NT, MINB, true, 2> : k_lin_qr<BITS, GS, NT, MINB, false, 2>);
    }
    static q_occ occ[8];
    const int per_sm = q_occupancy(kern, smem, occ[(smb ? 1 : 0) + 2 * (P.sbf & 3)]);
    const dim3 grid = q_grid_of(P, q_grid(P, units, per_sm));
    return launch_pdl(kern, grid, dim3(256), smem, P);
}

template <int BITS, int GS, int NT>
static int launch_q_tr(qlaunch P, unsigned blocks, int TR) {
    if (P.ring) return launch_qr<BITS, GS, NT>(P, blocks);
    if (const int dst = dense_first(P)) return dst;
    if constexpr (NT == 1) {
        if (TR >= 4) return launch_q<BITS, GS, NT, 4>(P, blocks);
    }
    if constexpr (NT <= 2) {
        if (TR >= 2) return launch_q<BITS, GS, NT, 2>(P, blocks);
    }
    return launch_q<BITS, GS, NT, 1>(P, blocks);
}

template <int BITS, int GS>
static int launch_q_nt(const qlaunch &P, unsigned blocks, int TR) {
    switch ((P.M + 3) / 4) {
    case 1: return launch_q_tr<BITS, GS, 1>(P, blocks, TR);
    case 2: return launch_q_tr<BITS, GS, 2>(P, blocks, TR);
    case 3: return launch_q_tr<BITS, GS, 3>(P, blocks, TR);
    default: return launch_q_tr<BITS, GS, 4>(P, blocks, TR);
    }
}

extern "C" int dfk_linear_q_max_tr(int M) { return M <= 4 ? 4 : (M <= 8 ? 2 : 1); }

static int q_linear_launch(int bits, int gs, int sbf, int M, dfk_qsched sched, int n, const dfk_qlin *lins,
                           const dlaunch &dn);

/* Rows per launch: M, or fewer where the schedule asks (dfk_qsched.split_rows, split_bytes). */
static int q_split_chunk(int M, int gs, const dfk_qsched &sched, int n, const dfk_qlin *lins) {
    int chunk = M;
    if (sched.split_rows > 0 && chunk > sched.split_rows) chunk = sched.split_rows;
    if (sched.split_bytes > 0) {
        int cols = 0;
        for (int i = 0; i < n; i++) cols = lins[i].cols > cols ? lins[i].cols : cols;
        while (chunk > 1 && q_smem_bytes(chunk, cols, gs) > (size_t)sched.split_bytes) chunk--;
    }
    return chunk;
}

extern "C" int dfk_linear_q(int bits, int gs, int sbf, int M, dfk_qsched sched, int n, const dfk_qlin *lins,
                            int nd, const dfk_dlin *dense) {
    if (M < 1 || M > DFK_MAX_ROWS || n < 1 || n > DFK_QMAX || gs <= 0 || nd < 0) return (int)cudaErrorInvalidValue;
    dlaunch dn = {};
    if (nd > 0) {
        const int st = dense_plan(M, nd, dense, &dn);
        if (st) return st;
    }
    const int chunk = q_split_chunk(M, gs, sched, n, lins);
    if (chunk >= M) return q_linear_launch(bits, gs, sbf, M, sched, n, lins, dn);
    if (dn.n > 0) { /* the dense rows are of all M rows: launched on their own first */
        const int st = dense_launch(dn);
        if (st) return st;
        dn.n = 0;
    }
    /* rows in launches of (nearly) equal size: each row's bits are those of a one-row launch
     * either way */
    const int parts = (M + chunk - 1) / chunk;
    int m0 = 0;
    for (int p = 0; p < parts; p++) {
        const int mp = (M - m0) / (parts - p);
        dfk_qlin part[DFK_QMAX];
        for (int i = 0; i < n; i++) {
            part[i] = lins[i];
            part[i].xq = lins[i].xq + (size_t)m0 * (size_t)lins[i].cols / 2;
            part[i].xe = lins[i].xe + (size_t)m0 * (size_t)(lins[i].cols / gs);
            part[i].xsx = lins[i].xsx + (size_t)m0 * (size_t)(lins[i].cols / gs);
            part[i].y = lins[i].y + (size_t)m0 * (size_t)lins[i].rows;
        }
        const int st = q_linear_launch(bits, gs, sbf, mp, sched, n, part, dn);
        if (st) return st;
        m0 += mp;
    }
    return 0;
}

static int q_linear_launch(int bits, int gs, int sbf, int M, dfk_qsched sched, int n, const dfk_qlin *lins,
                           const dlaunch &dn) {
    int TR = sched.TR;
    /* the ring kernel up to ring_max_m rows, the register kernel above (same K-slices: same bits) */
    const int ring = sched.ring && (sched.ring_max_m <= 0 || M <= sched.ring_max_m) ? 1 : 0;
    if (M < 1 || M > DFK_MAX_ROWS || n < 1 || n > DFK_QMAX || TR < 1 || ring < 0 || ring > 1 || sched.ctas < 0 ||
        sbf < 0 || sbf > 3 || ((sbf & 2) && bits != 2))
        return (int)cudaErrorInvalidValue;
    if (TR > dfk_linear_q_max_tr(M)) TR = dfk_linear_q_max_tr(M);
    if (ring) TR = 1; /* k_lin_qr: one tile per warp */
    qlaunch P = {};
    P.n = n;
    P.M = M;
    P.sbf = sbf;
    P.prefetch = g_q_prefetch;
    P.ring = ring;
    P.ctas = sched.ctas;
    P.bulk = sched.bulk;
    P.dn = dn;
    P.diag = g_q_diag;
    P.ride_first = g_ride_first;
    int blocks = 0;
    for (int i = 0; i < n; i++) {
        const int KW = lins[i].KW;
        if (KW != 1 && KW != 2 && KW != 4 && KW != 8) return (int)cudaErrorInvalidValue;
        P.d[i] = lins[i];
        P.kwl[i] = KW == 8 ? 3 : (KW == 4 ? 2 : (KW == 2 ? 1 : 0));
        P.start[i] = blocks;
        const int tiles = (lins[i].rows + 15) / 16, per = (8 / KW) * TR;
        blocks += (tiles + per - 1) / per;
    }
    P.start[n] = blocks;
    const unsigned nb = (unsigned)blocks;
    switch (bits * 1000 + gs) {
    case 2128: return launch_q_nt<2, 128>(P, nb, TR);
    case 2064: return launch_q_nt<2, 64>(P, nb, TR);
    case 4128: return launch_q_nt<4, 128>(P, nb, TR);
    case 4064: return launch_q_nt<4, 64>(P, nb, TR);
    case 8128: return launch_q_nt<8, 128>(P, nb, TR);
    case 8064: return launch_q_nt<8, 64>(P, nb, TR);
    default: return (int)cudaErrorInvalidValue;
    }
}

/* ---- dense 16-bit linears on CUDA cores ------------------------------------------------------- */

/* One block (256 threads) per output row of one linear of the launch. Thread tid takes the
 * 8-column chunks c = tid, tid + 256, ... in order, each column in order; then per data row
 * an xor butterfly per warp and the 8 warp sums in order. */
/* One block (256 threads) per output row of one linear of the launch (dense_row). */
__global__ void __launch_bounds__(256) k_lin_dense(const __grid_constant__ dlaunch P) {
    __shared__ float red[DFK_MAX_ROWS][8];
    pdl_trigger(); /* before the trace's load: the next kernel's launch waits for every CTA's trigger */
    const dfk_tr_start trs = dfk_tr_begin();
    int di = 0;
    while (di + 1 < P.n && (int)blockIdx.x >= P.start[di + 1]) di++;
    const int row = (int)blockIdx.x - P.start[di];
    uint4 wq[2];
    dense_preload(P.d[di], row, wq);
    pdl_wait();
    dfk_tr_mark(trs, DFK_TR_SITE(10000), 0, 0);
    dense_row<DFK_MAX_ROWS>(P.d[di], row, P.M, wq, red);
}

/* The launch of n dense linears of M rows (0, or cudaErrorInvalidValue for a shape the kernel
 * does not take). */
static int dense_plan(int M, int n, const dfk_dlin *lins, dlaunch *P) {
    if (M < 1 || M > DFK_MAX_ROWS || n < 1 || n > DFK_QMAX) return (int)cudaErrorInvalidValue;
    *P = dlaunch{};
    P->n = n;
    P->M = M;
    int blocks = 0;
    for (int i = 0; i < n; i++) {
        if (lins[i].cols % 8 != 0 || (lins[i].wdtype != 0 && lins[i].wdtype != 1)) return (int)cudaErrorInvalidValue;
        P->d[i] = lins[i];
        P->start[i] = blocks;
        blocks += lins[i].rows;
    }
    P->start[n] = blocks;
    return 0;
}

static int dense_launch(const dlaunch &P) {
    return launch_pdl(k_lin_dense, dim3((unsigned)P.start[P.n]), dim3(256), 0, P);
}

extern "C" int dfk_linear_dense(int M, int n, const dfk_dlin *lins) {
    dlaunch P;
    const int st = dense_plan(M, n, lins, &P);
    return st ? st : dense_launch(P);
}
