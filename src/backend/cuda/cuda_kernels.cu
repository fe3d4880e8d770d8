/* CUDA kernels of the CUDA backend (interface and contracts: cuda_kernels.h).
 *
 * Exactness (ENGINEERING.md): every output element is computed by one thread (or one warp /
 * block with a fixed-order tree), with an order that depends on reduction lengths and on
 * constants fixed by the weight's shape, never on the number of rows M. The file is compiled
 * with --fmad=false: a*b+c is a rounded multiply then a rounded add, as on the CPU; FMAs are
 * never implied.
 *
 * The tensor-core linear: MODEL.md §2 asks for x' = Hn(signs ⊙ x) in float32 (the CPU backend
 * keeps it float32). A float32 value is the exact sum of three bf16 values (hi = bf16(x),
 * mid = bf16(x - hi), lo = bf16(x - hi - mid): 8 + 8 + 8 significand bits), and a 2/4-bit code
 * plus a small offset is an exact bf16, so mma.m16n8k16 (bf16 in, f32 accumulate) multiplies
 * the exact operands; the three partial sums are added in a fixed order. The B operand of
 * one n-tile (8 columns) carries two rows (tokens) x three splits; rows and columns of an MMA
 * never mix, so a token's result does not depend on the other tokens of the call.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_kernels.h"
#include "backend/top_draw.h"
#include "backend/cuda/cuda_rowops.cuh"
#include "backend/cuda/cuda_trace.cuh"

#define FULL_MASK 0xffffffffu

static __device__ __forceinline__ float h16_to_f32(uint32_t h, int bf16) {
    if (bf16) return __uint_as_float((h & 0xffffu) << 16);
    return __half2float(__ushort_as_half((unsigned short)(h & 0xffffu)));
}

static __device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
static __device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Sum over the block (blockDim.x a power of two, <= 1024) in a fixed tree; every thread
 * gets the total. red: blockDim.x floats of shared memory. */
static __device__ float block_sum(float v, float *red) {
    const int n = blockDim.x, tid = threadIdx.x;
    red[tid] = v;
    __syncthreads();
    for (int s = n / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] = red[tid] + red[tid + s];
        __syncthreads();
    }
    float r = red[0];
    __syncthreads();
    return r;
}

/* Sum over a warp by an xor butterfly: every lane computes the same additions (a + b and
 * b + a are the same float), so all lanes hold the same bits. */
static __device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v = v + __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

static int launch_status(void) { return (int)cudaGetLastError(); }

/* The stream every launcher uses (dfk_set_stream; 0 = the legacy default stream). */
static cudaStream_t g_stream = 0;
/* 1: use the shared-memory decode kernel k_lin_mma_dec for M <= 2 (DFLASH_CUDA_DEC=1). Off by
 * default: on the H200 it measured slower than k_lin_mma (docs/PERFORMANCE.md). */
static int g_use_dec = 0;
extern "C" void dfk_set_use_dec(int v) { g_use_dec = v; }
/* Resident CTAs per SM asked of the compiler for the one- and two-token instances of k_lin_mma
 * (__launch_bounds__ minimum blocks: 2 or 3; DFLASH_CUDA_OCC). Register allocation only: the
 * arithmetic and its order are the same in every instance, so the bits are too. */
static int g_occ = 2;
extern "C" void dfk_set_occupancy(int v) { g_occ = v == 3 ? 3 : 2; }

/* Programmatic dependent launch (as in cuda_qlin.cu): the kernels launched with launch_k let
 * the next kernel of the stream be scheduled at once, then wait for the previous one (its
 * writes visible) before reading anything; every load of data an earlier kernel wrote goes
 * through L2 only (__ldcg: an SM's L1 may hold a line an older, overlapping kernel cached). */
static __device__ __forceinline__ void k_pdl_begin_(unsigned site) {
    /* the trigger before the trace's load: the next kernel's launch waits for every CTA's */
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
    const dfk_tr_start trs = dfk_tr_begin();
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    dfk_tr_mark(trs, site, 0, 0);
}
/* k_pdl_begin at the start of a kernel: the trace record names its line */
#define k_pdl_begin() k_pdl_begin_(DFK_TR_SITE(0))
/* the trace record of a kernel launched without PDL (its inputs are ready at entry) */
#define K_TR_ENTRY() dfk_tr_mark(dfk_tr_begin(), DFK_TR_SITE(0), 0, 0)

/* kernel<<<grid, block, smem>>>(args) on g_stream, with PDL when it is on for every kernel
 * (dfk_set_pdl 1). */
template <typename... KArgs, typename... Args>
static int launch_k(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Args... args) {
    return dfk_launch(kernel, grid, block, smem, dfk_pdl_on() == 1, args...);
}

extern "C" void dfk_set_stream(void *stream) { g_stream = (cudaStream_t)stream; }
extern "C" void *dfk_get_stream(void) { return (void *)g_stream; }

/* ---- Hadamard in shared memory --------------------------------------------------------- */

/* In-place Sylvester Walsh–Hadamard butterflies on each hb-wide block of sm[0..n) (n a
 * multiple of hb), in the order of df_hadamard_inplace, then the scale. */
static __device__ void smem_hadamard(float *sm, int n, int hb, float hscale) {
    for (int h = 1; h < hb; h <<= 1) {
        for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
            int i = ((p & ~(h - 1)) << 1) | (p & (h - 1)); /* (p / h) * 2h + p % h, h a power of two */
            float a = sm[i], b = sm[i + h];
            sm[i] = a + b;
            sm[i + h] = a - b;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) sm[i] = sm[i] * hscale;
    __syncthreads();
}


/* ---- prep ---------------------------------------------------------------------------------- */

__global__ void k_prep(const float *__restrict__ x, int cols, const float *__restrict__ signs, int hb, float hscale,
                       int gs, int seg, float *__restrict__ xf, float *__restrict__ xs, uint32_t *__restrict__ xb) {
    K_TR_ENTRY();
    extern __shared__ float sm[];
    const int m = blockIdx.x, s0 = blockIdx.y * seg;
    const float *xr = x + (size_t)m * (size_t)cols + s0;
    /* 4 elements per thread per round, their loads issued together */
    for (int i0 = 0; i0 < seg; i0 += 4 * (int)blockDim.x) {
        float v[4], sg[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = i0 + j * (int)blockDim.x + (int)threadIdx.x;
            v[j] = i < seg ? __ldg(&xr[i]) : 0.0f;
            sg[j] = (hb > 0 && i < seg) ? __ldg(&signs[s0 + i]) : 1.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = i0 + j * (int)blockDim.x + (int)threadIdx.x;
            if (i < seg) sm[i] = hb > 0 ? v[j] * sg[j] : v[j];
        }
    }
    __syncthreads();
    if (hb > 0) smem_hadamard(sm, seg, hb, hscale);
    float *xo = xf + (size_t)m * (size_t)cols + s0;
    for (int i = threadIdx.x; i < seg; i += blockDim.x) xo[i] = sm[i];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (gs > 0) {
        const int ng = cols / gs;
        for (int g = warp; g < seg / gs; g += nw) {
            float acc = 0.0f;
            for (int i = lane; i < gs; i += 32) acc = acc + sm[g * gs + i];
            acc = warp_sum(acc);
            if (lane == 0) xs[(size_t)m * (size_t)ng + (size_t)(s0 / gs + g)] = acc;
        }
    }
    if (xb) {
        /* B fragments of this row: n-tile m/2, lanes g = 3*(m%2) + split, t = 0..3 */
        const int kbt = cols / 16, kb0 = s0 / 16, nkb = seg / 16;
        const int nt = m / 2, gbase = 3 * (m % 2);
        uint2 *dst = (uint2 *)xb;
        for (int it = threadIdx.x; it < nkb * 12; it += blockDim.x) {
            int kb = it / 12, r = it % 12, s = r / 4, t = r % 4;
            const float *v = sm + kb * 16;
            uint2 o;
            o.x = dfk_split_part(v[2 * t], s) | (dfk_split_part(v[2 * t + 1], s) << 16);
            o.y = dfk_split_part(v[2 * t + 8], s) | (dfk_split_part(v[2 * t + 9], s) << 16);
            int lane_o = (gbase + s) * 4 + t;
            dst[((size_t)nt * (size_t)kbt + (size_t)(kb0 + kb)) * 32 + (size_t)lane_o] = o;
        }
    }
}

extern "C" int dfk_prep(const float *x, int M, int cols, const float *signs, int hb, float hscale, int gs, int seg,
                        float *xf, float *xs, uint32_t *xb) {
    dim3 grid((unsigned)M, (unsigned)(cols / seg));
    k_prep<<<grid, 256, (size_t)seg * sizeof(float), g_stream>>>(x, cols, signs, hb, hscale, gs, seg, xf, xs, xb);
    return launch_status();
}

/* ---- weight repacking ------------------------------------------------------------------------- */

/* Code of (row, col) in an MLX row (bits in {2, 4, 8}: never straddles a word). */
static __device__ __forceinline__ uint32_t raw_code(const uint32_t *raw, size_t wpr, int row, int col, int bits) {
    size_t bit = (size_t)col * (size_t)bits;
    uint32_t w = raw[(size_t)row * wpr + bit / 32];
    return (w >> (bit % 32)) & ((1u << bits) - 1u);
}

/* Fragment coordinates: register j (0..3) of mma A for lane (g, t), half h (0 low, 1 high):
 * row g + 8*(j & 1), column 2t + 8*((j >> 1) & 1) + h within the 16-column block. */
static __device__ __forceinline__ int frag_row(int g, int j) { return g + 8 * (j & 1); }
static __device__ __forceinline__ int frag_col(int t, int j, int h) { return 2 * t + 8 * ((j >> 1) & 1) + h; }

/* One thread per output word. Word w of lane (g, t) for (tile, group) holds registers
 * r = w*RPW .. (RPW = 16/bits registers per word; register r = 4*kb + j): the low-half code
 * of register r at bit (r % RPW)*bits, the high-half code at 16 + that. */
__global__ void k_repack_quant(const uint32_t *__restrict__ raw, const uint16_t *__restrict__ scales,
                               const uint16_t *__restrict__ biases, int rows, int cols, int bits, int gs, int tiles,
                               uint32_t *__restrict__ codes, uint32_t *__restrict__ sb) {
    const int ng = cols / gs, wpl = bits * gs / 64, vec = wpl < 4 ? wpl : 4, rpw = 16 / bits;
    const size_t nwords = (size_t)tiles * (size_t)ng * 32 * (size_t)wpl;
    const size_t wpr = (size_t)cols * (size_t)bits / 32;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < nwords) {
        /* idx = (((tile*ng + group)*nvec + v)*32 + lane)*vec + e */
        size_t r = idx;
        int e = (int)(r % (size_t)vec);
        r /= (size_t)vec;
        int lane = (int)(r % 32);
        r /= 32;
        int nvec = wpl / vec;
        int v = (int)(r % (size_t)nvec);
        r /= (size_t)nvec;
        int group = (int)(r % (size_t)ng);
        int tile = (int)(r / (size_t)ng);
        int w = v * vec + e;
        int g = lane >> 2, t = lane & 3;
        uint32_t out = 0;
        for (int q = 0; q < rpw; q++) {
            int reg = w * rpw + q, kb = reg / 4, j = reg % 4;
            int row = tile * 16 + frag_row(g, j);
            if (row >= rows) continue;
            for (int h = 0; h < 2; h++) {
                int col = group * gs + kb * 16 + frag_col(t, j, h);
                uint32_t c = raw_code(raw, wpr, row, col, bits);
                out |= c << (16 * h + q * bits);
            }
        }
        codes[idx] = out;
    }
    const size_t nsb = (size_t)tiles * (size_t)ng * 16;
    if (idx < nsb) {
        /* idx = ((tile*ng + group)*8 + g)*2 + half */
        int half = (int)(idx % 2);
        int g = (int)((idx / 2) % 8);
        size_t tg = idx / 16;
        int group = (int)(tg % (size_t)ng);
        int tile = (int)(tg / (size_t)ng);
        int row = tile * 16 + g + 8 * half;
        uint32_t o = 0;
        if (row < rows) {
            size_t k = (size_t)row * (size_t)ng + (size_t)group;
            o = (uint32_t)scales[k] | ((uint32_t)biases[k] << 16);
        }
        sb[idx] = o;
    }
}

extern "C" int dfk_repack_quant(const uint32_t *raw, const uint16_t *scales, const uint16_t *biases, int rows,
                                int cols, int bits, int gs, uint32_t *codes, uint32_t *sb) {
    const int tiles = (rows + 15) / 16, ng = cols / gs;
    size_t nwords = (size_t)tiles * (size_t)ng * 32 * (size_t)(bits * gs / 64);
    size_t nsb = (size_t)tiles * (size_t)ng * 16;
    size_t n = nwords > nsb ? nwords : nsb;
    unsigned blocks = (unsigned)((n + 255) / 256);
    k_repack_quant<<<blocks, 256>>>(raw, scales, biases, rows, cols, bits, gs, tiles, codes, sb);
    return launch_status();
}

/* Dense bf16: word w = 4*kb_in_group + j of lane (g, t) (groups of 64 columns, vec 4) holds
 * register j of k-block kb: (W[row][c], W[row][c+1]). */
__global__ void k_repack_bf16(const uint16_t *__restrict__ raw, int rows, int cols, int tiles,
                              uint32_t *__restrict__ out) {
    const int ng = cols / 64;
    const size_t n = (size_t)tiles * (size_t)ng * 32 * 16;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    size_t r = idx;
    int j = (int)(r % 4);
    r /= 4;
    int lane = (int)(r % 32);
    r /= 32;
    int kbl = (int)(r % 4);
    r /= 4;
    int group = (int)(r % (size_t)ng);
    int tile = (int)(r / (size_t)ng);
    int g = lane >> 2, t = lane & 3;
    int row = tile * 16 + frag_row(g, j);
    uint32_t o = 0;
    if (row < rows) {
        int col = group * 64 + kbl * 16 + frag_col(t, j, 0);
        const uint16_t *p = raw + (size_t)row * (size_t)cols + (size_t)col;
        o = (uint32_t)p[0] | ((uint32_t)p[1] << 16);
    }
    out[idx] = o;
}

extern "C" int dfk_repack_bf16(const uint16_t *raw, int rows, int cols, uint32_t *out) {
    const int tiles = (rows + 15) / 16;
    size_t n = (size_t)tiles * (size_t)(cols / 64) * 32 * 16;
    k_repack_bf16<<<(unsigned)((n + 255) / 256), 256>>>(raw, rows, cols, tiles, out);
    return launch_status();
}

/* ---- tensor-core linear ------------------------------------------------------------------------ */

static __device__ __forceinline__ void mma_bf16(float *d, const uint32_t *a, const uint32_t *b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* A fragment register r (= 4*kb + j) from the lane's words. 2- and 4-bit codes are moved to
 * the top of a bf16 mantissa under exponent `bits`: the register holds (2^bits + c_lo,
 * 2^bits + c_hi) exactly; the offset 2^bits is removed in the epilogue through the group sum.
 * 8-bit codes are converted through float (no offset). */
template <int MODE>
static __device__ __forceinline__ uint32_t a_reg(const uint32_t *wr, int r) {
    if (MODE == DFK_MMA_BF16) return wr[r];
    constexpr int RPW = 16 / MODE;
    const uint32_t w = wr[r / RPW];
    const int p = (r % RPW) * MODE;
    if (MODE == 8) {
        uint32_t lo = (w >> p) & 0xffu, hi = (w >> (16 + p)) & 0xffu;
        __nv_bfloat162 v = __floats2bfloat162_rn((float)lo, (float)hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    constexpr int TP = MODE < 7 ? 7 - MODE : 0; /* target bit of the code inside the 7-bit mantissa */
    constexpr uint32_t MASK = ((1u << MODE) - 1u) << TP;
    constexpr uint32_t MAGIC = MODE == 2 ? 0x40804080u : 0x41804180u; /* bf16 4.0 | 16.0, twice */
    uint32_t s = p >= TP ? (w >> (p - TP)) : (w << (TP - p));
    return (s & (MASK | (MASK << 16))) | MAGIC;
}

/* One launch of k_lin_mma: n linears of one prepared input (xb, xs) and M rows, the blocks of
 * linear i being start[i] .. start[i + 1) - 1 (a per-linear grid laid end to end). */
struct mma_launch {
    dfk_mlin d[DFK_QMAX];
    int start[DFK_QMAX + 1];
    int n, sb_bf16, ng, kbt, M;
    const uint2 *xb;
    const float *xs;
};

/* Compile-time shape of one k_lin_mma instance: TR tiles per warp, NT n-tiles (2 tokens each);
 * GP groups' codes are loaded at once (all loads of a warp in flight together), KC k-blocks of
 * B fragments at once. */
template <int MODE, int GS, int NT, int TR>
struct lin_cfg {
    static constexpr int KBG = GS / 16;
    static constexpr int WPL = MODE == DFK_MMA_BF16 ? KBG * 4 : MODE * GS / 64;
    static constexpr int VEC = WPL < 4 ? WPL : 4;
    static constexpr int NVEC = WPL / VEC;
    static constexpr int GP0 = 32 / (TR * WPL * (NT > 4 ? NT : (NT > 2 ? NT / 2 : 1)));
    static constexpr int GP = GP0 < 1 ? 1 : (GP0 > 8 ? 8 : GP0);
    static constexpr int KC0 = NT >= 4 ? 1 : 8 / NT;
    static constexpr int KC = KC0 < KBG ? (KC0 < 1 ? 1 : KC0) : KBG;
};

template <int VEC>
static __device__ __forceinline__ void load_words(const uint32_t *p, uint32_t *w) {
    if (VEC == 4) {
        uint4 q = __ldcs(reinterpret_cast<const uint4 *>(p));
        w[0] = q.x;
        w[VEC > 1 ? 1 : 0] = q.y;
        w[VEC > 2 ? 2 : 0] = q.z;
        w[VEC > 3 ? 3 : 0] = q.w;
    } else if (VEC == 2) {
        uint2 q = __ldcs(reinterpret_cast<const uint2 *>(p));
        w[0] = q.x;
        w[VEC > 1 ? 1 : 0] = q.y;
    } else {
        w[0] = __ldcs(p);
    }
}

/* One CTA = 8 warps = RW row-warps x KW K-slices; warp (rw, kw) handles TR tiles and the groups
 * g = kw, kw + KW, ... in order; the KW partial sums are added in order kw = 0..KW-1. KW is a
 * function of the weight's shape (cuda_backend.c), TR and the grid only distribute work. */
template <int MODE, int GS, int NT, int TR, int MINB>
__global__ void __launch_bounds__(256, MINB) k_lin_mma(const __grid_constant__ mma_launch P) {
    K_TR_ENTRY();
    /* the launch's linear of this block: blocks start[i] .. start[i + 1) - 1 */
    int wi = 0;
    while (wi + 1 < P.n && (int)blockIdx.x >= P.start[wi + 1]) wi++;
    const int bid = (int)blockIdx.x - P.start[wi];
    const uint32_t *__restrict__ codes = P.d[wi].codes;
    const uint32_t *__restrict__ sb = P.d[wi].sb;
    float *__restrict__ y = P.d[wi].y;
    const uint2 *__restrict__ xb = P.xb;
    const float *__restrict__ xs = P.xs;
    const int rows = P.d[wi].rows, tiles = (rows + 15) / 16, KW = P.d[wi].KW, add = P.d[wi].add;
    const int sb_bf16 = P.sb_bf16, ng = P.ng, kbt = P.kbt, M = P.M;
    typedef lin_cfg<MODE, GS, NT, TR> C;
    constexpr int WPL = C::WPL, VEC = C::VEC, NVEC = C::NVEC, KBG = C::KBG, GP = C::GP, KC = C::KC;
    __shared__ float red[8][TR * NT * 2][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kw = warp % KW, rw = warp / KW, RW = 8 / KW;
    const int tile0 = (bid * RW + rw) * TR;
    const float off = MODE == DFK_MMA_Q2 ? 4.0f : (MODE == DFK_MMA_Q4 ? 16.0f : 0.0f);
    bool tvalid[TR];
#pragma unroll
    for (int tr = 0; tr < TR; tr++) tvalid[tr] = tile0 + tr < tiles;

    float yv[TR][NT][2];
#pragma unroll
    for (int tr = 0; tr < TR; tr++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) yv[tr][nt][0] = yv[tr][nt][1] = 0.0f;

    for (int gbase = kw; gbase < ng; gbase += KW * GP) {
        /* every code load of the next GP groups first */
        uint32_t wr[GP][TR][WPL];
        uint32_t sbv[GP][TR][2];
#pragma unroll
        for (int gi = 0; gi < GP; gi++) {
            const int grp = gbase + gi * KW;
#pragma unroll
            for (int tr = 0; tr < TR; tr++) {
                if (grp < ng && tvalid[tr]) {
                    const size_t tg = (size_t)(tile0 + tr) * (size_t)ng + (size_t)grp;
                    const uint32_t *base = codes + tg * (size_t)(WPL * 32);
#pragma unroll
                    for (int v = 0; v < NVEC; v++)
                        load_words<VEC>(base + ((size_t)v * 32 + (size_t)lane) * VEC, &wr[gi][tr][v * VEC]);
                    if (MODE != DFK_MMA_BF16) {
                        uint2 s2 = __ldg(reinterpret_cast<const uint2 *>(sb + (tg * 8 + (size_t)g) * 2));
                        sbv[gi][tr][0] = s2.x;
                        sbv[gi][tr][1] = s2.y;
                    } else {
                        sbv[gi][tr][0] = sbv[gi][tr][1] = 0;
                    }
                } else {
#pragma unroll
                    for (int w = 0; w < WPL; w++) wr[gi][tr][w] = 0;
                    sbv[gi][tr][0] = sbv[gi][tr][1] = 0;
                }
            }
        }
        /* one-token-pair instances (NT == 1, all k-blocks of a group at once): the B fragments of
         * the next group and the group sums of the whole batch are loaded ahead, so that the
         * L2 round trips overlap the code loads and the MMAs instead of forming a chain per
         * group. Same operands, same MMA sequence, same epilogue: same bits. */
        constexpr bool PF = NT == 1 && KC == KBG;
        uint32_t bq[2][PF ? KBG : 1][2];
        float xsv[GP];
        (void)bq;
        (void)xsv;
        if constexpr (PF) {
#pragma unroll
            for (int gi = 0; gi < GP; gi++) {
                const int grp = gbase + gi * KW;
                xsv[gi] = (MODE != DFK_MMA_BF16 && grp < ng && t < 2 && t < M)
                              ? __ldg(&xs[(size_t)t * (size_t)ng + (size_t)grp])
                              : 0.0f;
            }
#pragma unroll
            for (int kc = 0; kc < KBG; kc++) {
                if (g < 6 && g / 3 < M) {
                    uint2 v = __ldg(&xb[((size_t)gbase * KBG + (size_t)kc) * 32 + (size_t)lane]);
                    bq[0][kc][0] = v.x;
                    bq[0][kc][1] = v.y;
                } else {
                    bq[0][kc][0] = bq[0][kc][1] = 0;
                }
            }
        }
#pragma unroll
        for (int gi = 0; gi < GP; gi++) {
            const int grp = gbase + gi * KW;
            if (grp >= ng) break;
            if constexpr (PF) {
                if (gi + 1 < GP && grp + KW < ng) {
#pragma unroll
                    for (int kc = 0; kc < KBG; kc++) {
                        if (g < 6 && g / 3 < M) {
                            uint2 v = __ldg(&xb[((size_t)(grp + KW) * KBG + (size_t)kc) * 32 + (size_t)lane]);
                            bq[(gi + 1) & 1][kc][0] = v.x;
                            bq[(gi + 1) & 1][kc][1] = v.y;
                        } else {
                            bq[(gi + 1) & 1][kc][0] = bq[(gi + 1) & 1][kc][1] = 0;
                        }
                    }
                }
            }
            float D[TR][NT][4];
#pragma unroll
            for (int tr = 0; tr < TR; tr++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) D[tr][nt][0] = D[tr][nt][1] = D[tr][nt][2] = D[tr][nt][3] = 0.0f;
#pragma unroll
            for (int kb0 = 0; kb0 < KBG; kb0 += KC) {
                uint32_t bf[KC][NT][2];
#pragma unroll
                for (int kc = 0; kc < KC; kc++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const int tok = 2 * nt + g / 3;
                        if constexpr (PF) {
                            bf[kc][nt][0] = bq[gi & 1][kb0 + kc][0];
                            bf[kc][nt][1] = bq[gi & 1][kb0 + kc][1];
                        } else if (g < 6 && tok < M) {
                            uint2 v = __ldg(&xb[((size_t)nt * (size_t)kbt + (size_t)(grp * KBG + kb0 + kc)) * 32 +
                                                (size_t)lane]);
                            bf[kc][nt][0] = v.x;
                            bf[kc][nt][1] = v.y;
                        } else {
                            bf[kc][nt][0] = bf[kc][nt][1] = 0;
                        }
                    }
#pragma unroll
                for (int kc = 0; kc < KC; kc++)
#pragma unroll
                    for (int tr = 0; tr < TR; tr++) {
                        uint32_t a[4];
#pragma unroll
                        for (int j = 0; j < 4; j++) a[j] = a_reg<MODE>(wr[gi][tr], 4 * (kb0 + kc) + j);
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) mma_bf16(D[tr][nt], a, bf[kc][nt]);
                    }
            }
            /* epilogue: token 2nt = columns 0,1,2 (lanes t = 0, 1), token 2nt+1 = columns 3,4,5
             * (lanes t = 1, 2); both summed as (hi + mid) + lo, owned by lanes t = 0 and t = 1 */
#pragma unroll
            for (int tr = 0; tr < TR; tr++) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const float *d = D[tr][nt];
                    float v0 = __shfl_down_sync(FULL_MASK, d[0], 1), v1 = __shfl_down_sync(FULL_MASK, d[1], 1);
                    float v2 = __shfl_down_sync(FULL_MASK, d[2], 1), v3 = __shfl_down_sync(FULL_MASK, d[3], 1);
                    float dg, dg8;
                    if (t == 0) {
                        dg = (d[0] + d[1]) + v0;
                        dg8 = (d[2] + d[3]) + v2;
                    } else {
                        dg = (d[1] + v0) + v1;
                        dg8 = (d[3] + v2) + v3;
                    }
                    if (MODE == DFK_MMA_BF16) {
                        yv[tr][nt][0] = yv[tr][nt][0] + dg;
                        yv[tr][nt][1] = yv[tr][nt][1] + dg8;
                    } else {
                        const int tok = 2 * nt + t;
                        float xsum = 0.0f;
                        if constexpr (PF) xsum = xsv[gi];
                        else if (t < 2 && tok < M) xsum = __ldg(&xs[(size_t)tok * (size_t)ng + (size_t)grp]);
                        float s0 = h16_to_f32(sbv[gi][tr][0], sb_bf16), b0 = h16_to_f32(sbv[gi][tr][0] >> 16, sb_bf16);
                        float s1 = h16_to_f32(sbv[gi][tr][1], sb_bf16), b1 = h16_to_f32(sbv[gi][tr][1] >> 16, sb_bf16);
                        float bb0 = b0 - off * s0, bb1 = b1 - off * s1;
                        yv[tr][nt][0] = yv[tr][nt][0] + (s0 * dg + bb0 * xsum);
                        yv[tr][nt][1] = yv[tr][nt][1] + (s1 * dg8 + bb1 * xsum);
                    }
                }
            }
        }
    }
    /* K-slices: warp (rw, kw) partials summed in order kw = 0..KW-1 by warp (rw, 0) */
    if (KW > 1) {
        dfk_kslice_sum<TR, NT>(red, yv, KW, kw, warp, lane);
        if (kw != 0) return;
    }
    if (t >= 2) return;
#pragma unroll
    for (int tr = 0; tr < TR; tr++) {
        const int tile = tile0 + tr;
        if (!tvalid[tr]) continue;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int tok = 2 * nt + t;
            if (tok >= M) continue;
            const int r0 = tile * 16 + g, r1 = r0 + 8;
            float *y0 = y + (size_t)tok * (size_t)rows + (size_t)r0, *y1 = y0 + 8;
            if (r0 < rows) *y0 = add ? *y0 + yv[tr][nt][0] : yv[tr][nt][0];
            if (r1 < rows) *y1 = add ? *y1 + yv[tr][nt][1] : yv[tr][nt][1];
        }
    }
}

/* The decode path (NT == 1: one or two tokens): a persistent grid of about two blocks per SM;
 * each block first copies the B fragments of the whole K range (the 24 lanes that carry data,
 * 192 bytes per 16 columns) into shared memory, then walks its tiles (tile = block, block +
 * grid, ...). Per tile the arithmetic is exactly k_lin_mma's with TR = 1 (same K-slices, same
 * group order, same MMA sequence, same epilogue, same K-slice sum), so its bits equal the
 * general kernel's for every row. */
template <int MODE, int GS>
__global__ void __launch_bounds__(256, 1) k_lin_mma_dec(const uint32_t *__restrict__ codes,
                                                     const uint32_t *__restrict__ sb, int sb_bf16, int rows, int tiles,
                                                     int ng, int kbt, const uint2 *__restrict__ xb,
                                                     const float *__restrict__ xs, int M, int KW,
                                                     float *__restrict__ y) {
    K_TR_ENTRY();
    typedef lin_cfg<MODE, GS, 1, 1> C;
    constexpr int WPL = C::WPL, VEC = C::VEC, NVEC = C::NVEC, KBG = C::KBG, GP = C::GP;
    extern __shared__ uint2 sxb[]; /* [kbt][24] */
    __shared__ float red[8][2][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kw = warp % KW, rw = warp / KW, RW = 8 / KW;
    const float off = MODE == DFK_MMA_Q2 ? 4.0f : (MODE == DFK_MMA_Q4 ? 16.0f : 0.0f);
    for (int i = threadIdx.x; i < kbt * 24; i += blockDim.x) {
        const int kb = i / 24, l = i % 24, tok = l / 12;
        uint2 v = make_uint2(0u, 0u);
        if (tok < M) v = __ldg(&xb[(size_t)kb * 32 + (size_t)l]);
        sxb[i] = v;
    }
    __syncthreads();
    const bool bvalid = g < 6 && g / 3 < M;
    for (int tbase = blockIdx.x * RW; tbase < tiles; tbase += gridDim.x * RW) {
        const int tile = tbase + rw;
        const bool tv = tile < tiles;
        float yv0 = 0.0f, yv1 = 0.0f;
        for (int gbase = kw; gbase < ng; gbase += KW * GP) {
            uint32_t wr[GP][WPL];
            uint32_t sbv[GP][2];
#pragma unroll
            for (int gi = 0; gi < GP; gi++) {
                const int grp = gbase + gi * KW;
                if (grp < ng && tv) {
                    const size_t tg = (size_t)tile * (size_t)ng + (size_t)grp;
                    const uint32_t *base = codes + tg * (size_t)(WPL * 32);
#pragma unroll
                    for (int v = 0; v < NVEC; v++)
                        load_words<VEC>(base + ((size_t)v * 32 + (size_t)lane) * VEC, &wr[gi][v * VEC]);
                    if (MODE != DFK_MMA_BF16) {
                        uint2 s2 = __ldg(reinterpret_cast<const uint2 *>(sb + (tg * 8 + (size_t)g) * 2));
                        sbv[gi][0] = s2.x;
                        sbv[gi][1] = s2.y;
                    } else {
                        sbv[gi][0] = sbv[gi][1] = 0;
                    }
                } else {
#pragma unroll
                    for (int w = 0; w < WPL; w++) wr[gi][w] = 0;
                    sbv[gi][0] = sbv[gi][1] = 0;
                }
            }
#pragma unroll
            for (int gi = 0; gi < GP; gi++) {
                const int grp = gbase + gi * KW;
                if (grp >= ng) break;
                float D[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int kb = 0; kb < KBG; kb++) {
                    uint32_t bf[2] = {0u, 0u};
                    if (bvalid) {
                        uint2 v = sxb[(grp * KBG + kb) * 24 + g * 4 + t];
                        bf[0] = v.x;
                        bf[1] = v.y;
                    }
                    uint32_t a[4];
#pragma unroll
                    for (int j = 0; j < 4; j++) a[j] = a_reg<MODE>(wr[gi], 4 * kb + j);
                    mma_bf16(D, a, bf);
                }
                float v0 = __shfl_down_sync(FULL_MASK, D[0], 1), v1 = __shfl_down_sync(FULL_MASK, D[1], 1);
                float v2 = __shfl_down_sync(FULL_MASK, D[2], 1), v3 = __shfl_down_sync(FULL_MASK, D[3], 1);
                float dg, dg8;
                if (t == 0) {
                    dg = (D[0] + D[1]) + v0;
                    dg8 = (D[2] + D[3]) + v2;
                } else {
                    dg = (D[1] + v0) + v1;
                    dg8 = (D[3] + v2) + v3;
                }
                if (MODE == DFK_MMA_BF16) {
                    yv0 = yv0 + dg;
                    yv1 = yv1 + dg8;
                } else {
                    const int tok = t;
                    float xsum = 0.0f;
                    if (t < 2 && tok < M) xsum = __ldg(&xs[(size_t)tok * (size_t)ng + (size_t)grp]);
                    float s0 = h16_to_f32(sbv[gi][0], sb_bf16), b0 = h16_to_f32(sbv[gi][0] >> 16, sb_bf16);
                    float s1 = h16_to_f32(sbv[gi][1], sb_bf16), b1 = h16_to_f32(sbv[gi][1] >> 16, sb_bf16);
                    float bb0 = b0 - off * s0, bb1 = b1 - off * s1;
                    yv0 = yv0 + (s0 * dg + bb0 * xsum);
                    yv1 = yv1 + (s1 * dg8 + bb1 * xsum);
                }
            }
        }
        if (KW > 1) {
            red[warp][0][lane] = yv0;
            red[warp][1][lane] = yv1;
            __syncthreads();
            if (kw == 0) {
                float a0 = red[warp][0][lane], a1 = red[warp][1][lane];
                for (int k = 1; k < KW; k++) {
                    a0 = a0 + red[warp + k][0][lane];
                    a1 = a1 + red[warp + k][1][lane];
                }
                yv0 = a0;
                yv1 = a1;
            }
            __syncthreads();
        }
        if (kw == 0 && t < 2 && tv && t < M) {
            const int r0 = tile * 16 + g, r1 = r0 + 8;
            if (r0 < rows) y[(size_t)t * (size_t)rows + (size_t)r0] = yv0;
            if (r1 < rows) y[(size_t)t * (size_t)rows + (size_t)r1] = yv1;
        }
    }
}

static int g_sms = 132;
extern "C" void dfk_set_sm_count(int n) { g_sms = n > 0 ? n : 132; }

/* Launches the decode kernel when it applies (NT == 1 and the fragments fit in shared memory);
 * returns 1 if launched (status in *st). */
template <int MODE, int GS>
static int launch_lin_dec(const uint32_t *codes, const uint32_t *sb, int sb_bf16, int rows, int cols,
                          const uint32_t *xb, const float *xs, int M, int KW, float *y, int *st) {
    const int kbt = cols / 16, tiles = (rows + 15) / 16, ng = cols / GS, RW = 8 / KW;
    const size_t smem = (size_t)kbt * 24 * sizeof(uint2);
    if (M > 2 || smem > 200 * 1024) return 0;
    static size_t smem_set = 0;
    if (smem > 48 * 1024 && smem > smem_set) {
        cudaFuncSetAttribute(k_lin_mma_dec<MODE, GS>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(200 * 1024));
        smem_set = 200 * 1024;
    }
    const int per_sm = smem <= 100 * 1024 ? 2 : 1;
    int blocks = g_sms * per_sm;
    const int sets = (tiles + RW - 1) / RW;
    if (blocks > sets) blocks = sets;
    k_lin_mma_dec<MODE, GS><<<(unsigned)blocks, 256, smem, g_stream>>>(codes, sb, sb_bf16, rows, tiles, ng, kbt,
                                                                       reinterpret_cast<const uint2 *>(xb), xs, M, KW,
                                                                       y);
    *st = launch_status();
    return 1;
}

/* The grid of P: each linear's blocks of RW·TR tiles, linear after linear (P.start). */
template <int MODE, int GS, int NT, int TR>
static int launch_lin(mma_launch &P) {
    int blocks = 0;
    for (int i = 0; i < P.n; i++) {
        const int tiles = (P.d[i].rows + 15) / 16, per_block = (8 / P.d[i].KW) * TR;
        P.start[i] = blocks;
        blocks += (tiles + per_block - 1) / per_block;
    }
    P.start[P.n] = blocks;
    if constexpr (NT <= 2 && TR <= 2) {
        if (g_occ == 3) {
            k_lin_mma<MODE, GS, NT, TR, 3><<<(unsigned)blocks, 256, 0, g_stream>>>(P);
            return launch_status();
        }
    }
    k_lin_mma<MODE, GS, NT, TR, 2><<<(unsigned)blocks, 256, 0, g_stream>>>(P);
    return launch_status();
}

/* TR choices per (mode, NT): the heavy formats (2-bit group 128, bf16) get 1, 2, 4, 8 tiles
 * per warp (as registers allow), the others 1. */
template <int MODE, int GS, int NT>
static int launch_lin_tr(mma_launch &P, int TR) {
    constexpr bool q2 = MODE == DFK_MMA_Q2 && GS == 128, bf = MODE == DFK_MMA_BF16;
    if constexpr (q2 && NT == 1) {
        if (TR >= 8) return launch_lin<MODE, GS, NT, 8>(P);
    }
    if constexpr ((q2 || bf) && NT == 1) {
        if (TR >= 4) return launch_lin<MODE, GS, NT, 4>(P);
    }
    if constexpr ((q2 || bf) && NT <= 2) {
        if (TR >= 2) return launch_lin<MODE, GS, NT, 2>(P);
    }
    return launch_lin<MODE, GS, NT, 1>(P);
}

/* NT = ceil(M/2) n-tiles: exact for the heavy formats (2-bit group 128, bf16), else rounded up
 * to a power of two (fewer instances). Padded n-tiles carry zero columns; a token's result
 * never depends on NT (columns of an MMA are independent). */
template <int MODE, int GS>
static int launch_lin_nt(mma_launch &P, int TR) {
    constexpr bool heavy = (MODE == DFK_MMA_Q2 && GS == 128) || MODE == DFK_MMA_BF16;
    const int M = P.M, pairs = (M + 1) / 2;
    int st = 0;
    if (pairs <= 1 && g_use_dec && P.n == 1 &&
        launch_lin_dec<MODE, GS>(P.d[0].codes, P.d[0].sb, P.sb_bf16, P.d[0].rows, P.kbt * 16,
                                 reinterpret_cast<const uint32_t *>(P.xb), P.xs, M, P.d[0].KW, P.d[0].y, &st))
        return st;
    if (pairs <= 1) return launch_lin_tr<MODE, GS, 1>(P, TR);
    if (pairs <= 2) return launch_lin_tr<MODE, GS, 2>(P, TR);
    if constexpr (heavy) {
        if (pairs == 3) return launch_lin_tr<MODE, GS, 3>(P, TR);
    }
    if (pairs <= 4) return launch_lin_tr<MODE, GS, 4>(P, TR);
    if constexpr (heavy) {
        if (pairs == 5) return launch_lin_tr<MODE, GS, 5>(P, TR);
        if (pairs == 6) return launch_lin_tr<MODE, GS, 6>(P, TR);
        if (pairs == 7) return launch_lin_tr<MODE, GS, 7>(P, TR);
    }
    return launch_lin_tr<MODE, GS, 8>(P, TR);
}

static int nt_of(int M) {
    const int pairs = (M + 1) / 2;
    return pairs <= 1 ? 1 : (pairs <= 2 ? 2 : (pairs <= 4 ? 4 : 8));
}

extern "C" int dfk_linear_mma_max_tr(int mode, int gs, int M) {
    const int nt = nt_of(M);
    const int q2 = mode == DFK_MMA_Q2 && gs == 128, bf = mode == DFK_MMA_BF16;
    if (!q2 && !bf) return 1;
    return nt <= 1 ? (q2 ? 8 : 4) : (nt <= 2 ? 2 : 1);
}

extern "C" int dfk_linear_mma_multi(int mode, int gs, int sb_bf16, int cols, const uint32_t *xb, const float *xs,
                                    int M, int TR, int n, const dfk_mlin *lins) {
    const int G = mode == DFK_MMA_BF16 ? 64 : gs;
    if (M < 1 || M > DFK_MAX_ROWS || TR < 1 || n < 1 || n > DFK_QMAX || (G != 64 && G != 128) || cols % G != 0)
        return (int)cudaErrorInvalidValue;
    mma_launch P;
    memset(&P, 0, sizeof P);
    P.n = n;
    P.sb_bf16 = sb_bf16;
    P.ng = cols / G;
    P.kbt = cols / 16;
    P.M = M;
    P.xb = reinterpret_cast<const uint2 *>(xb);
    P.xs = xs;
    for (int i = 0; i < n; i++) {
        const int KW = lins[i].KW;
        if ((KW != 1 && KW != 2 && KW != 4 && KW != 8) || lins[i].rows < 1) return (int)cudaErrorInvalidValue;
        P.d[i] = lins[i];
    }
    switch (mode) {
    case DFK_MMA_Q2:
        return gs == 128 ? launch_lin_nt<DFK_MMA_Q2, 128>(P, TR) : launch_lin_nt<DFK_MMA_Q2, 64>(P, TR);
    case DFK_MMA_Q4:
        return gs == 128 ? launch_lin_nt<DFK_MMA_Q4, 128>(P, TR) : launch_lin_nt<DFK_MMA_Q4, 64>(P, TR);
    case DFK_MMA_Q8:
        return gs == 128 ? launch_lin_nt<DFK_MMA_Q8, 128>(P, TR) : launch_lin_nt<DFK_MMA_Q8, 64>(P, TR);
    case DFK_MMA_BF16:
        return launch_lin_nt<DFK_MMA_BF16, 64>(P, TR);
    default:
        return (int)cudaErrorInvalidValue;
    }
}

extern "C" int dfk_linear_mma(int mode, int gs, const uint32_t *codes, const uint32_t *sb, int sb_bf16, int rows,
                              int cols, const uint32_t *xb, const float *xs, int M, int KW, int TR, float *y) {
    if (mode != DFK_MMA_Q2 && mode != DFK_MMA_Q4 && mode != DFK_MMA_Q8 && mode != DFK_MMA_BF16)
        return (int)cudaErrorInvalidValue;
    if (mode != DFK_MMA_BF16 && gs != 64 && gs != 128) return (int)cudaErrorInvalidValue;
    const dfk_mlin l = {codes, sb, rows, KW, 0, y};
    return dfk_linear_mma_multi(mode, gs, sb_bf16, cols, xb, xs, M, TR, 1, &l);
}

/* ---- CUDA-core linear (any format) ------------------------------------------------------------ */

static __device__ __forceinline__ float dense_at(const void *w, int wdtype, size_t i) {
    if (wdtype == 2) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    return h16_to_f32(h, wdtype == 1);
}

/* One block (256 threads) per output row: thread i takes columns i, i + 256, ... in order (four
 * loads in flight), then a fixed tree over the block per token row. */
/* Weight (row, c) of dfk_linear_simple: s * q + b (quantized, MLX layout) or the dense value. */
static __device__ __forceinline__ float lin_simple_w(const void *w, int wdtype, const uint16_t *scales,
                                                     const uint16_t *biases, int sb_bf16, int bits, int gs, int row,
                                                     int cols, size_t wpr, int ng, const uint32_t *qrow, int c) {
    (void)wpr;
    if (bits > 0) {
        size_t bit = (size_t)c * (size_t)bits;
        size_t wi = bit / 32;
        unsigned sh = (unsigned)(bit % 32);
        uint32_t v = qrow[wi] >> sh;
        if (sh + (unsigned)bits > 32) v |= qrow[wi + 1] << (32 - sh);
        v &= (1u << bits) - 1u;
        size_t k = (size_t)row * (size_t)ng + (size_t)(c / gs);
        float s = h16_to_f32(scales[k], sb_bf16), b = h16_to_f32(biases[k], sb_bf16);
        return s * (float)v + b;
    }
    return dense_at(w, wdtype, (size_t)row * (size_t)cols + (size_t)c);
}

__global__ void __launch_bounds__(256) k_lin_simple(const void *__restrict__ w, int wdtype,
                                                    const uint16_t *__restrict__ scales,
                                                    const uint16_t *__restrict__ biases, int sb_bf16, int bits,
                                                    int gs, int rows, int cols, const float *__restrict__ xf, int M,
                                                    float *__restrict__ y) {
    K_TR_ENTRY();
    __shared__ float red[DFK_MAX_ROWS][256];
    const int row = blockIdx.x, tid = threadIdx.x;
    float acc[DFK_MAX_ROWS];
#pragma unroll
    for (int m = 0; m < DFK_MAX_ROWS; m++) acc[m] = 0.0f;
    const size_t wpr = bits > 0 ? (size_t)cols * (size_t)bits / 32 : 0;
    const int ng = bits > 0 ? cols / gs : 0;
    const uint32_t *qrow = bits > 0 ? (const uint32_t *)w + (size_t)row * wpr : NULL;
    /* columns c = tid, tid + 256, ... in order; the weights of 8 of them are loaded (and the
     * matching x' values) before their products are added, so the loads overlap */
    for (int c0 = 0; c0 < cols; c0 += 8 * 256) {
        float wq[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int c = c0 + j * 256 + tid;
            wq[j] = c < cols ? lin_simple_w(w, wdtype, scales, biases, sb_bf16, bits, gs, row, cols, wpr, ng, qrow, c)
                             : 0.0f;
        }
#pragma unroll
        for (int m = 0; m < DFK_MAX_ROWS; m++) {
            if (m < M) {
                float xv[8];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const int c = c0 + j * 256 + tid;
                    xv[j] = c < cols ? xf[(size_t)m * (size_t)cols + (size_t)c] : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (c0 + j * 256 + tid < cols) acc[m] = acc[m] + wq[j] * xv[j];
            }
        }
    }
#pragma unroll
    for (int m = 0; m < DFK_MAX_ROWS; m++)
        if (m < M) red[m][tid] = acc[m];
    __syncthreads();
    for (int s2 = 128; s2 > 0; s2 >>= 1) {
        if (tid < s2)
            for (int m = 0; m < M; m++) red[m][tid] = red[m][tid] + red[m][tid + s2];
        __syncthreads();
    }
    if (tid < M) y[(size_t)tid * (size_t)rows + (size_t)row] = red[tid][0];
}

extern "C" int dfk_linear_simple(const void *w, int wdtype, const uint16_t *scales, const uint16_t *biases,
                                 int sb_bf16, int bits, int gs, int rows, int cols, const float *xf, int M, float *y) {
    k_lin_simple<<<(unsigned)rows, 256, 0, g_stream>>>(w, wdtype, scales, biases, sb_bf16, bits, gs, rows, cols, xf,
                                                       M, y);
    return launch_status();
}

/* ---- embedding --------------------------------------------------------------------------------- */

/* Block (m, s): columns [s·seg, (s + 1)·seg) of row m (seg: the Hadamard block, or the whole
 * row without one): the dequantized codes (or dense values), rotated in their block, as fp16
 * values like MLX's embedding. The rotation blocks are independent, so the split changes no bit. */
__global__ void k_embed(const uint32_t *__restrict__ codes, const uint16_t *__restrict__ scales,
                        const uint16_t *__restrict__ biases, int sb_bf16, int bits, int gs, const void *dense,
                        int wdtype, int rows, int cols, int seg, const float *__restrict__ signs, int hb,
                        float hscale, const int32_t *__restrict__ ids, float *__restrict__ out) {
    K_TR_ENTRY();
    extern __shared__ float sm[];
    const int m = blockIdx.x, id = ids[m], c0 = (int)blockIdx.y * seg;
    float *o = out + (size_t)m * (size_t)cols + (size_t)c0;
    if (id < 0 || id >= rows) {
        for (int i = threadIdx.x; i < seg; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    if (bits > 0) {
        const size_t wpr = (size_t)cols * (size_t)bits / 32;
        const int ng = cols / gs;
        const uint32_t *row = codes + (size_t)id * wpr;
        for (int j = threadIdx.x; j < seg; j += blockDim.x) {
            const int i = c0 + j;
            size_t bit = (size_t)i * (size_t)bits;
            size_t wi = bit / 32;
            unsigned sh = (unsigned)(bit % 32);
            uint32_t v = row[wi] >> sh;
            if (sh + (unsigned)bits > 32) v |= row[wi + 1] << (32 - sh);
            v &= (1u << bits) - 1u;
            size_t k = (size_t)id * (size_t)ng + (size_t)(i / gs);
            float s = h16_to_f32(scales[k], sb_bf16), b = h16_to_f32(biases[k], sb_bf16);
            sm[j] = __half2float(__float2half_rn(s * (float)v + b));
        }
    } else {
        for (int j = threadIdx.x; j < seg; j += blockDim.x)
            sm[j] = dense_at(dense, wdtype, (size_t)id * (size_t)cols + (size_t)(c0 + j));
    }
    __syncthreads();
    if (hb > 0) {
        smem_hadamard(sm, seg, hb, hscale);
        for (int j = threadIdx.x; j < seg; j += blockDim.x)
            sm[j] = __half2float(__float2half_rn(sm[j] * signs[c0 + j]));
        __syncthreads();
    }
    for (int j = threadIdx.x; j < seg; j += blockDim.x) o[j] = sm[j];
}

extern "C" int dfk_embed(const uint32_t *codes, const uint16_t *scales, const uint16_t *biases, int sb_bf16, int bits,
                         int gs, const void *dense, int wdtype, int rows, int cols, const float *signs, int hb,
                         float hscale, const int32_t *ids, int M, float *out) {
    /* a block per rotation block of a row (one per row without a rotation, or where the
     * rotation blocks do not tile the row) */
    const int seg = hb > 0 && cols % hb == 0 ? hb : cols;
    const dim3 grid((unsigned)M, (unsigned)(cols / seg));
    k_embed<<<grid, 256, (size_t)seg * sizeof(float), g_stream>>>(codes, scales, biases, sb_bf16, bits, gs, dense,
                                                                  wdtype, rows, cols, seg, signs, hb, hscale, ids, out);
    return launch_status();
}

/* ---- norms and elementwise ------------------------------------------------------------------- */

/* One block of 256 threads per row: the sum of squares of dfk_row_sumsq (cuda_rowops.cuh, the
 * order shared with the norm fused into dfk_qprep), then y = (x · inv) · w. */
__global__ void __launch_bounds__(256) k_rmsnorm(const float *x, const float *w, int width, float eps, float *y) {
    K_TR_ENTRY();
    __shared__ float red8[8];
    const float *xr = x + (size_t)blockIdx.x * (size_t)width;
    float *yr = y + (size_t)blockIdx.x * (size_t)width;
    const int tid = threadIdx.x;
    const float inv = dfk_rms_inv(dfk_row_sumsq(xr, NULL, width, red8), width, eps);
    for (int i0 = 0; i0 < width; i0 += 8 * 256) {
        float v[8], wv[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int i = i0 + j * 256 + tid;
            v[j] = i < width ? xr[i] : 0.0f;
            wv[j] = (w && i < width) ? __ldg(&w[i]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int i = i0 + j * 256 + tid;
            if (i < width) yr[i] = w ? (v[j] * inv) * wv[j] : v[j] * inv;
        }
    }
}
extern "C" int dfk_rmsnorm(const float *x, const float *w, int rows, int width, float eps, float *y) {
    k_rmsnorm<<<(unsigned)rows, 256, 0, g_stream>>>(x, w, width, eps, y);
    return launch_status();
}

__global__ void k_add(float *y, const float *x, size_t n) {
    K_TR_ENTRY();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = y[i] + x[i];
}

__global__ void k_swiglu(const float *gate, const float *up, size_t n, float *out) {
    K_TR_ENTRY();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = silu_f(gate[i]) * up[i];
}

static unsigned ew_blocks(size_t n) {
    size_t b = (n + 255) / 256;
    if (b > 4096) b = 4096;
    return (unsigned)(b ? b : 1);
}

extern "C" int dfk_add(float *y, const float *x, size_t n) {
    k_add<<<ew_blocks(n), 256, 0, g_stream>>>(y, x, n);
    return launch_status();
}

extern "C" int dfk_swiglu(const float *gate, const float *up, size_t n, float *out) {
    k_swiglu<<<ew_blocks(n), 256, 0, g_stream>>>(gate, up, n, out);
    return launch_status();
}

/* ---- argmax ------------------------------------------------------------------------------------ */

/* Tree merge of (value, index) pairs in shared memory, n a power of two: the larger value
 * wins, ties go to the lower index, index -1 = empty; a NaN wins over any number (so that a
 * NaN anywhere in the row reaches the result, see am_result). */
static __device__ void am_merge(float *bv, int *bi, int tid, int n) {
    for (int s = n / 2; s > 0; s >>= 1) {
        if (tid < s) {
            const float ov = bv[tid + s];
            const int oi = bi[tid + s];
            const int take = oi >= 0 && (bi[tid] < 0 || ov > bv[tid] || (ov == bv[tid] && oi < bi[tid]) ||
                                         (isnan(ov) && !isnan(bv[tid])));
            if (take) {
                bv[tid] = ov;
                bi[tid] = oi;
            }
        }
        __syncthreads();
    }
}

/* A thread's scan of xr[i] for i = lo, lo + step, ... < hi: strictly greater replaces (so ties
 * keep the lowest index) and a NaN sticks (nothing is greater than it), then the block's tree
 * merge; the result is in bv[0], bi[0] (index -1: nothing scanned). Every thread of the block
 * (n threads, a power of two) calls it. */
static __device__ void am_block(const float *xr, int lo, int hi, int step, float *bv, int *bi, int tid, int n) {
    float best = 0.0f;
    int besti = -1;
    for (int i = lo; i < hi; i += step) {
        const float v = xr[i];
        if (besti < 0 || v > best || isnan(v)) {
            best = v;
            besti = i;
        }
    }
    bv[tid] = best;
    bi[tid] = besti;
    __syncthreads();
    am_merge(bv, bi, tid, n);
}

/* The id of a merged row: `bad` (df_argmax: -1) when its maximum is not finite (a NaN in the
 * row, or an infinite maximum). */
static __device__ int32_t am_result(float v, int i, int32_t bad) { return i < 0 ? 0 : isfinite(v) ? i : bad; }

__global__ void k_argmax(const float *x, int width, int32_t *out, int32_t bad) {
    K_TR_ENTRY();
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    const float *xr = x + (size_t)blockIdx.x * (size_t)width;
    const int tid = threadIdx.x;
    am_block(xr, tid, width, (int)blockDim.x, bv, bi, tid, (int)blockDim.x);
    if (tid == 0) out[blockIdx.x] = am_result(bv[0], bi[0], bad);
}

/* Two-stage argmax for up to DFK_MAX_ROWS rows: AM_PARTS blocks per row each take a contiguous
 * slice with the rule of k_argmax (strictly greater replaces; ties and merges keep the lowest
 * index), then one block per row merges the slices' (value, index) pairs with the same rule:
 * the same index as a sequential scan for any split. */
#define AM_PARTS 128
__device__ float g_am_v[DFK_MAX_ROWS * AM_PARTS];
__device__ int g_am_i[DFK_MAX_ROWS * AM_PARTS];

__global__ void __launch_bounds__(256) k_argmax_part(const float *x, int width) {
    K_TR_ENTRY();
    __shared__ float bv[256];
    __shared__ int bi[256];
    const int row = blockIdx.y, part = blockIdx.x, tid = threadIdx.x;
    const int chunk = (width + AM_PARTS - 1) / AM_PARTS, lo = part * chunk;
    const int hi = lo + chunk < width ? lo + chunk : width;
    const float *xr = x + (size_t)row * (size_t)width;
    am_block(xr, lo + tid, hi, 256, bv, bi, tid, 256);
    if (tid == 0) {
        g_am_v[row * AM_PARTS + part] = bv[0];
        g_am_i[row * AM_PARTS + part] = bi[0];
    }
}

__global__ void __launch_bounds__(AM_PARTS) k_argmax_merge(int32_t *out, int32_t bad) {
    K_TR_ENTRY();
    __shared__ float bv[AM_PARTS];
    __shared__ int bi[AM_PARTS];
    const int row = blockIdx.x, tid = threadIdx.x;
    bv[tid] = g_am_v[row * AM_PARTS + tid];
    bi[tid] = g_am_i[row * AM_PARTS + tid];
    __syncthreads();
    am_merge(bv, bi, tid, AM_PARTS);
    if (tid == 0) out[row] = am_result(bv[0], bi[0], bad);
}

extern "C" int dfk_argmax(const float *x, int rows, int width, int32_t *out, int32_t bad) {
    if (rows <= DFK_MAX_ROWS && width >= 64 * AM_PARTS) {
        k_argmax_part<<<dim3(AM_PARTS, (unsigned)rows), 256, 0, g_stream>>>(x, width);
        k_argmax_merge<<<(unsigned)rows, AM_PARTS, 0, g_stream>>>(out, bad);
        return launch_status();
    }
    k_argmax<<<(unsigned)rows, 1024, 0, g_stream>>>(x, width, out, bad);
    return launch_status();
}

/* Top k of one row (backend.h `top_k`): TK_PARTS blocks each sort their slice (up to TK_SORT
 * entries) as 64-bit keys (the value's order bits, then the complement of the index, so that a
 * larger key ranks higher: value descending, lower index first on ties) by a bitonic network in
 * shared memory and keep their 64 best; one block sorts those and writes the k best (each value
 * read back from the row, as it is: -0 stays -0). A NaN
 * anywhere gives ids[0] = -1. The order is exact (a total order on keys), so any split gives
 * the same list. */
#define TK_PARTS 64
#define TK_SORT 4096
__device__ unsigned long long g_tk_key[TK_PARTS * 64];
__device__ int g_tk_nan[TK_PARTS];

static __device__ unsigned long long tk_key(float v, int i) {
    unsigned u = __float_as_uint(v == 0.0f ? 0.0f : v); /* -0 and +0: one key, ties by index */
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (unsigned long long)(~(unsigned)i);
}

/* Sorts n (a power of two) keys of shared memory in descending order; every thread calls it. */
static __device__ void tk_sort_desc(unsigned long long *k, int n) {
    for (int size = 2; size <= n; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
                const int i = 2 * t - (t & (stride - 1)), j = i + stride;
                const unsigned long long a = k[i], b = k[j];
                if ((a < b) == ((i & size) == 0)) {
                    k[i] = b;
                    k[j] = a;
                }
            }
            __syncthreads();
        }
}

/* Puts into k[0..) a set of keys holding the 64 largest of those that the threads of the block
 * offer in mine[0..PER) (blockDim.x = 64·L, L <= 32: 64 groups of L consecutive lanes), sorted
 * descending; returns its size (a power of
 * two, at most cap; entries beyond the set are 0). The 64 group maxima are 64 distinct keys, so
 * at least 64 keys reach the smallest of them, T: only the keys >= T are sorted (a few hundred for
 * random rows instead of every key), unless more than cap / 2 do. Keys are distinct (the index
 * is part of the key), so the set and its order do not depend on the split. */
template <int PER>
static __device__ int tk_select(const unsigned long long (&mine)[PER], unsigned long long *k, int cap, int *cnt,
                                unsigned long long *wmin) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (int)blockDim.x >> 5;
    const int lpg = (int)blockDim.x / 64; /* lanes per group (8 or 16 here) */
    unsigned long long m = 0;
#pragma unroll
    for (int j = 0; j < PER; j++) m = mine[j] > m ? mine[j] : m;
    for (int o = 1; o < lpg; o <<= 1) { /* the group's maximum */
        const unsigned long long x = __shfl_xor_sync(FULL_MASK, m, o);
        m = x > m ? x : m;
    }
    for (int o = lpg; o < 32; o <<= 1) { /* the smallest group maximum of the warp */
        const unsigned long long x = __shfl_xor_sync(FULL_MASK, m, o);
        m = x < m ? x : m;
    }
    if (threadIdx.x == 0) *cnt = 0;
    if (lane == 0) wmin[warp] = m;
    __syncthreads();
    unsigned long long T = wmin[0];
    for (int w = 1; w < nw; w++) T = wmin[w] < T ? wmin[w] : T;
#pragma unroll
    for (int j = 0; j < PER; j++)
        if (mine[j] >= T) {
            const int pos = atomicAdd(cnt, 1);
            if (pos < cap) k[pos] = mine[j];
        }
    __syncthreads();
    const int c = *cnt;
    if (c > cap / 2) { /* too many above T (padding among the groups): every key */
        __syncthreads();
#pragma unroll
        for (int j = 0; j < PER; j++) k[threadIdx.x + j * blockDim.x] = mine[j];
        __syncthreads();
        tk_sort_desc(k, cap);
        return cap;
    }
    int n = 64;
    while (n < c) n <<= 1;
    for (int t = c + (int)threadIdx.x; t < n; t += blockDim.x) k[t] = 0ull;
    __syncthreads();
    tk_sort_desc(k, n);
    return n;
}

__global__ void __launch_bounds__(512) k_topk_part(const float *x, int width, int chunk) {
    K_TR_ENTRY();
    __shared__ unsigned long long keys[TK_SORT];
    __shared__ unsigned long long wmin[16];
    __shared__ int cnt;
    const int lo = (int)blockIdx.x * chunk, hi = lo + chunk < width ? lo + chunk : width;
    int nan = 0;
    constexpr int PER = TK_SORT / 512;
    unsigned long long mine[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) { /* thread t: entries t + 512j; a group of 8 threads: 64 entries */
        const int i = lo + (int)threadIdx.x + 512 * j;
        unsigned long long key = 0; /* below every real key: padding */
        if (i < hi) {
            const float v = x[i];
            if (isnan(v)) nan = 1;
            else key = tk_key(v, i);
        }
        mine[j] = key;
    }
    nan = __syncthreads_or(nan);
    tk_select<PER>(mine, keys, TK_SORT, &cnt, wmin);
    for (int t = threadIdx.x; t < 64; t += blockDim.x) g_tk_key[blockIdx.x * 64 + t] = keys[t];
    if (threadIdx.x == 0) g_tk_nan[blockIdx.x] = nan;
}

__global__ void __launch_bounds__(1024) k_topk_merge(const float *x, int parts, int k, int32_t *ids, float *vals,
                                                     const dfk_draw d) {
    K_TR_ENTRY();
    __shared__ unsigned long long keys[TK_PARTS * 64];
    __shared__ int32_t sid[64];
    __shared__ float sv[64], sp[64];
    __shared__ unsigned long long wmin[32];
    __shared__ int cnt;
    int nan = 0;
    constexpr int PER = TK_PARTS * 64 / 1024;
    unsigned long long mine[PER]; /* thread t: entries 4t..4t+3, so a group of 16 threads is a part's list */
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int t = PER * (int)threadIdx.x + j;
        mine[j] = t < parts * 64 ? g_tk_key[t] : 0ull;
    }
    for (int t = threadIdx.x; t < parts; t += blockDim.x) nan |= g_tk_nan[t];
    nan = __syncthreads_or(nan);
    tk_select<PER>(mine, keys, TK_PARTS * 64, &cnt, wmin);
    for (int t = threadIdx.x; t < k; t += blockDim.x) {
        const int32_t i = (int32_t)(~(unsigned)(keys[t] & 0xffffffffu));
        const float v = x[i];
        vals[t] = v;
        ids[t] = nan && t == 0 ? -1 : i;
        sid[t] = i;
        sv[t] = v;
    }
    if (!d.out) return;
    __syncthreads();
    const bool bad = nan || !isfinite(sv[0]);
    /* df_sample_top_list (backend/top_draw.h, the host's text): the terms a thread each, then
     * the filters and the draw by one */
    if ((int)threadIdx.x < k && !bad) sp[threadIdx.x] = df_top_term(sv[threadIdx.x], sv[0], d.temperature);
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint64_t u = (uint64_t)d.u[0] | ((uint64_t)d.u[1] << 32);
        d.out[0] = bad ? -1 : df_top_draw_terms(sid, sp, k, d.top_p, d.min_p, u);
    }
}

extern "C" int dfk_top_k_max_width(void) { return TK_PARTS * TK_SORT; }

extern "C" int dfk_top_k_draw(const float *x, int width, int k, int32_t *ids, float *vals, const dfk_draw *d) {
    if (width < 1 || width > TK_PARTS * TK_SORT || k < 1 || k > 64 || k > width) return (int)cudaErrorInvalidValue;
    if (d && (!d->u || !d->out || !(d->temperature > 0.0f))) return (int)cudaErrorInvalidValue;
    const int chunk = (width + TK_PARTS - 1) / TK_PARTS;
    k_topk_part<<<TK_PARTS, 512, 0, g_stream>>>(x, width, chunk);
    k_topk_merge<<<1, 1024, 0, g_stream>>>(x, TK_PARTS, k, ids, vals, d ? *d : dfk_draw{});
    return launch_status();
}

extern "C" int dfk_top_k(const float *x, int width, int k, int32_t *ids, float *vals) {
    return dfk_top_k_draw(x, width, k, ids, vals, NULL);
}

/* ---- attention ----------------------------------------------------------------------------- */

#define QK_PREP_THREADS 128
#define QK_PREP_PER (1024 / QK_PREP_THREADS) /* elements per thread at most (hd <= 1024) */
__global__ void __launch_bounds__(QK_PREP_THREADS)
    k_qk_prep(float *q, int qstride, int nh, float *k, const float *v, int nkv, int hd, const float *q_norm,
              const float *k_norm, int rot, float theta, float eps, const int32_t *positions, float *k_cache,
              float *v_cache) {
    __shared__ float sv[1024];
    __shared__ float red[128];
    const int m = blockIdx.x, h = blockIdx.y;
    const int nq = q ? nh : 0;
    float *vec;
    const float *nw;
    int kh = -1;
    if (h < nq) {
        vec = q + ((size_t)m * (size_t)nh + (size_t)h) * (size_t)qstride;
        nw = q_norm;
    } else {
        kh = h - nq;
        vec = k + ((size_t)m * (size_t)nkv + (size_t)kh) * (size_t)hd;
        nw = k_norm;
    }
    /* before waiting for the previous kernel: the norm weights, and the rotation's angles from
     * the positions (the step's parameter block, copied before its first kernel) */
    const int half = rot / 2;
    const int pos0 = __ldcg(&positions[DFK_MAX_ROWS]);
    const int32_t pos = __ldcg(&positions[m]);
    float nwv[QK_PREP_PER], rcs[QK_PREP_PER / 2], rsn[QK_PREP_PER / 2];
#pragma unroll
    for (int k2 = 0; k2 < QK_PREP_PER; k2++) {
        const int i = (int)threadIdx.x + k2 * QK_PREP_THREADS;
        nwv[k2] = nw && i < hd ? nw[i] : 0.0f;
    }
#pragma unroll
    for (int k2 = 0; k2 < QK_PREP_PER / 2; k2++) {
        const int i = (int)threadIdx.x + k2 * QK_PREP_THREADS;
        rcs[k2] = rsn[k2] = 0.0f;
        if (i < half) {
            double inv_freq = pow((double)theta, -2.0 * (double)i / (double)rot);
            float f = (float)((double)pos * inv_freq);
            rcs[k2] = cosf(f);
            rsn[k2] = sinf(f);
        }
    }
    k_pdl_begin();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) sv[i] = __ldcg(&vec[i]);
    __syncthreads();
    if (nw) {
        float acc = 0.0f;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) acc = acc + sv[i] * sv[i];
        float ms = block_sum(acc, red) / (float)hd;
        float inv = 1.0f / sqrtf(ms + eps);
#pragma unroll
        for (int k2 = 0; k2 < QK_PREP_PER; k2++) {
            const int i = (int)threadIdx.x + k2 * QK_PREP_THREADS;
            if (i < hd) sv[i] = (sv[i] * inv) * nwv[k2];
        }
        __syncthreads();
    }
#pragma unroll
    for (int k2 = 0; k2 < QK_PREP_PER / 2; k2++) {
        const int i = (int)threadIdx.x + k2 * QK_PREP_THREADS;
        if (i < half) {
            float a = sv[i], b = sv[i + half];
            sv[i] = a * rcs[k2] - b * rsn[k2];
            sv[i + half] = b * rcs[k2] + a * rsn[k2];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) vec[i] = sv[i];
    if (kh >= 0) {
        size_t o = ((size_t)(pos0 + m) * (size_t)nkv + (size_t)kh) * (size_t)hd;
        const float *vr = v + ((size_t)m * (size_t)nkv + (size_t)kh) * (size_t)hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            k_cache[o + i] = sv[i];
            v_cache[o + i] = __ldcg(&vr[i]);
        }
    }
}

extern "C" int dfk_qk_prep(float *q, int qstride, int nh, float *k, const float *v, int nkv, int hd,
                           const float *q_norm, const float *k_norm, int rot, float theta, float eps,
                           const int32_t *positions, int M, float *k_cache, float *v_cache) {
    dim3 grid((unsigned)M, (unsigned)((q ? nh : 0) + nkv));
    return launch_k(k_qk_prep, grid, dim3(QK_PREP_THREADS), 0, q, qstride, nh, k, v, nkv, hd, q_norm, k_norm, rot,
                    theta, eps, positions, k_cache, v_cache);
}

/* ---- attention --------------------------------------------------------------------------------
 *
 * Attention over the KV cache in chunks of g_attn_chunk positions: part[m, h, c] = (o[0..hd),
 * max, sum) of query head h of row m over chunk c, computed by k_attn_tile, then k_attn_combine
 * merges a row's chunks. The chunk is part of the arithmetic, the same for every row and every
 * M (process-wide, set between steps), so never of batch invariance. */
#define ATTN_MAX_G 16
static int g_attn_chunk = 32; /* measured best at 1k context (docs/PERFORMANCE.md) */
extern "C" void dfk_set_attn_chunk(int chunk) {
    if (chunk == 32 || chunk == 64) g_attn_chunk = chunk;
}
extern "C" int dfk_attn_chunk(void) { return g_attn_chunk; }

/* k_attn_tile: a block of ATTN_THREADS per (group of rows: up to ATTN_QM query heads of one KV
 * head, that is rg = ATTN_QM / G rows; chunk of CH positions; KV head). The chunk's K and V rows
 * are copied into shared memory once (a bulk copy per row, all in flight together), the group's
 * q while they are in flight. Arithmetic per query head of a row (the same wherever and with
 * whatever rows it runs, so each row's bits are those of a one-row call):
 *   scores: the head dimension in DP = 256 / CH parts of DT = hd / DP dims; a thread per (part p,
 *     position t) holds K[t][p·DT ..] in registers, s_p = Σ_d q[d]·K[t][d] over its dims in
 *     ascending order (fused multiply-adds), s = ((s_0 + s_1) + ...) + s_{DP−1}, times scale
 *     (the block's two halves take alternate groups of four query heads);
 *   softmax over the chunk: a warp per query head, lane l holding positions l, l + 32, ...
 *     (masked beyond the row's positions: −inf / 0), max and exp-sum by xor trees;
 *   outputs: o[d] = Σ_t p_t·V[t][d] in ascending t (fused multiply-adds), a thread per (d, head
 *     slot) (attn_pv_pass).
 * Two blocks fit an SM at CH = 32 with head_dim 256 (99 KB of shared memory, 64 registers), one
 * at CH = 64. */
#define ATTN_QM 16 /* query heads per k_attn_tile block */
/* Timing experiments only (DFLASH_CUDA_ATTN_DIAG; wrong outputs): 1 = k_attn_tile copies the
 * chunk and stops; 2 = it computes over whatever shared memory holds, without the copies. */
static int g_attn_diag = 0;
extern "C" void dfk_set_attn_diag(int v) { g_attn_diag = v; }

/* Dynamic shared memory of k_attn_tile (floats): K rows (stride hd + 4: the score loads of a
 * warp's 32 positions fall in distinct banks), V rows, the group's q (stride hd + 4), the
 * partial scores [DP][ATTN_QM][CH] (their first part becomes the exponentials). */
static size_t attn_tile_smem(int ch, int hd) {
    const size_t dp = (size_t)(256 / ch);
    return ((size_t)ch * (size_t)(hd + 4) + (size_t)ch * (size_t)hd + (size_t)ATTN_QM * (size_t)(hd + 4) +
            dp * ATTN_QM * (size_t)ch) *
           4;
}

/* Outputs of NK heads of a row at dim d: o_j = Σ_{t<n} p_j[t]·V[t][d] in ascending t (fused
 * multiply-adds), p_j = pe + j·ps (exponentials in shared memory, 16-byte aligned), V rows at
 * sv + t·hd; o_j stored at po + j·os. */
template <int NK>
static __device__ __forceinline__ void attn_pv_pass(const float *pe, int ps, const float *sv, int hd, int d, int n,
                                                    float *po, size_t os) {
    float acc[NK];
#pragma unroll
    for (int j = 0; j < NK; j++) acc[j] = 0.0f;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        const float v0 = sv[t * hd + d], v1 = sv[(t + 1) * hd + d], v2 = sv[(t + 2) * hd + d], v3 = sv[(t + 3) * hd + d];
#pragma unroll
        for (int j = 0; j < NK; j++) {
            const float4 pp = *reinterpret_cast<const float4 *>(pe + j * ps + t);
            acc[j] = __fmaf_rn(pp.x, v0, acc[j]);
            acc[j] = __fmaf_rn(pp.y, v1, acc[j]);
            acc[j] = __fmaf_rn(pp.z, v2, acc[j]);
            acc[j] = __fmaf_rn(pp.w, v3, acc[j]);
        }
    }
    for (; t < n; t++) {
        const float v = sv[t * hd + d];
#pragma unroll
        for (int j = 0; j < NK; j++) acc[j] = __fmaf_rn(pe[j * ps + t], v, acc[j]);
    }
#pragma unroll
    for (int j = 0; j < NK; j++) po[(size_t)j * os] = acc[j];
}

#define ATTN_THREADS 512
template <int CH, int DT>
__global__ void __launch_bounds__(ATTN_THREADS, CH == 32 ? 2 : 1)
    k_attn_tile(const float *q, int qstride, int nh, int nkv, int hd, const float *k_cache, const float *v_cache,
                float scale, int causal, const int32_t *pos0p, int M, int nchunk, int rg, float *part, int diag) {
    constexpr int DP = 256 / CH; /* score parts */
    /* pos0 and `stable` lie in the step's parameter block, copied before the step's first
     * kernel: read before waiting for the previous kernel, so that blocks past the rows exit at
     * once, and the cache rows below `stable` (no kernel of the step writes them) are copied
     * while the previous kernels run */
    const int pos0 = __ldcg(pos0p), stable = __ldcg(pos0p + 1);
    extern __shared__ __align__(16) float ast[];
    __shared__ float smx[ATTN_QM], ssum[ATTN_QM];
    __shared__ int sn[ATTN_QM];
    __shared__ __align__(8) uint64_t kv_bar;
    const int c = blockIdx.y, kvh = blockIdx.z, G = nh / nkv;
    const int m0 = (int)blockIdx.x * rg, nr = M - m0 < rg ? M - m0 : rg, nq = nr * G;
    const int t0 = c * CH, lmax = causal ? pos0 + m0 + nr : pos0 + M; /* the group's longest row */
    if (t0 >= lmax) return;
    const int nmax = (lmax < t0 + CH ? lmax : t0 + CH) - t0, kst = hd + 4;
    float *sk = ast, *sv = sk + CH * kst, *sq = sv + CH * hd, *sp = sq + ATTN_QM * kst;
    const size_t kstride = (size_t)nkv * (size_t)hd, off = (size_t)t0 * kstride + (size_t)kvh * (size_t)hd;
    const uint32_t bar = (uint32_t)__cvta_generic_to_shared(&kv_bar);
    if (threadIdx.x == 0) {
        mbar_init(bar, 1u);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        mbar_expect(bar, diag == 2 ? 0u : (unsigned)(2 * nmax * hd * 4));
    }
    if ((int)threadIdx.x < nr) {
        const int r = threadIdx.x, len = causal ? pos0 + m0 + r + 1 : lmax;
        sn[r] = t0 >= len ? 0 : (len < t0 + CH ? len : t0 + CH) - t0;
    }
    __syncthreads();
    /* rows t < npre before the wait, the others (written by this step's kernels) after */
    const int npre = stable - t0 < 0 ? 0 : (stable - t0 < nmax ? stable - t0 : nmax);
    for (int i = threadIdx.x; i < 2 * npre && diag != 2; i += blockDim.x) {
        const int w = i >= npre, t = w ? i - npre : i;
        bulk_copy((uint32_t)__cvta_generic_to_shared(w ? sv + t * hd : sk + t * kst),
                  (w ? v_cache : k_cache) + off + (size_t)t * kstride, (unsigned)(hd * 4), bar);
    }
    k_pdl_begin(); /* the cache's new rows and q come from the previous kernels */
    for (int i = threadIdx.x; i < 2 * (nmax - npre) && diag != 2; i += blockDim.x) {
        const int w = i >= nmax - npre, t = npre + (w ? i - (nmax - npre) : i);
        bulk_copy((uint32_t)__cvta_generic_to_shared(w ? sv + t * hd : sk + t * kst),
                  (w ? v_cache : k_cache) + off + (size_t)t * kstride, (unsigned)(hd * 4), bar);
    }
    { /* q while the copies are in flight: four floats per thread, hd / 4 threads per head */
        const int h4 = hd >> 2, per = (int)blockDim.x / h4, d = ((int)threadIdx.x % h4) * 4;
        for (int qi = (int)threadIdx.x / h4; qi < nq; qi += per) {
            const int r = qi / G, gi = qi - r * G;
            const float4 v = __ldcg(reinterpret_cast<const float4 *>(
                q + ((size_t)(m0 + r) * (size_t)nh + (size_t)(kvh * G + gi)) * (size_t)qstride + (size_t)d));
            *reinterpret_cast<float4 *>(sq + qi * kst + d) = v;
        }
    }
    __syncthreads();
    mbar_wait(bar, 0u);
    if (diag == 1) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    { /* partial scores of thread (part p, position t): the 256-thread halves of the block take
       * alternate groups of four query heads */
        const int half = warp >> 3, p = (warp & 7) % DP, t = ((warp & 7) / DP) * 32 + lane;
        float kr[DT];
        const float *kp = sk + t * kst + p * DT;
#pragma unroll
        for (int i = 0; i < DT; i += 4) {
            const float4 v = *reinterpret_cast<const float4 *>(kp + i);
            kr[i] = v.x, kr[i + 1] = v.y, kr[i + 2] = v.z, kr[i + 3] = v.w;
        }
        for (int q0 = 4 * half; q0 < nq; q0 += 8) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < DT; i += 4) {
#pragma unroll
                for (int j = 0; j < 4; j++) { /* rows beyond nq: in bounds, never stored */
                    const float4 qv = *reinterpret_cast<const float4 *>(sq + (q0 + j) * kst + p * DT + i);
                    acc[j] = __fmaf_rn(qv.x, kr[i], acc[j]);
                    acc[j] = __fmaf_rn(qv.y, kr[i + 1], acc[j]);
                    acc[j] = __fmaf_rn(qv.z, kr[i + 2], acc[j]);
                    acc[j] = __fmaf_rn(qv.w, kr[i + 3], acc[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (q0 + j < nq) sp[(p * ATTN_QM + q0 + j) * CH + t] = acc[j];
        }
    }
    __syncthreads();
    for (int qi = warp; qi < nq; qi += ATTN_THREADS / 32) { /* softmax: a warp per query head */
        const int n = sn[qi / G];
        float s[CH / 32], mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < CH / 32; j++) {
            const int t = lane + 32 * j;
            float v = sp[qi * CH + t];
#pragma unroll
            for (int p = 1; p < DP; p++) v = v + sp[(p * ATTN_QM + qi) * CH + t];
            s[j] = t < n ? v * scale : -INFINITY;
            mx = fmaxf(mx, s[j]);
        }
        for (int o2 = 16; o2 > 0; o2 >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o2));
        float l = 0.0f;
#pragma unroll
        for (int j = 0; j < CH / 32; j++) {
            const int t = lane + 32 * j;
            const float e = t < n ? expf(s[j] - mx) : 0.0f;
            sp[qi * CH + t] = e;
            l = l + e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            smx[qi] = mx;
            ssum[qi] = l;
        }
    }
    __syncthreads();
    /* outputs: thread (slot, d); a slot takes heads slot, slot + slots, ... of each row */
    const int slots = (int)blockDim.x / hd, slot = (int)threadIdx.x / hd, d = (int)threadIdx.x - slot * hd;
    const size_t gstride = (size_t)nchunk * (size_t)(hd + 2);
    for (int r = 0; r < nr && slot < slots; r++) {
        const int n = sn[r];
        if (n == 0) continue;
        float *pr = part + (((size_t)(m0 + r) * (size_t)nh + (size_t)(kvh * G)) * (size_t)nchunk + (size_t)c) *
                               (size_t)(hd + 2);
        /* heads slot, slot + slots, ... in passes of up to four */
        const int hps = (G - slot + slots - 1) / slots;
        for (int k0 = 0; k0 < hps; k0 += 4) {
            const int nk = hps - k0 < 4 ? hps - k0 : 4, g0 = slot + k0 * slots;
            const float *pe = sp + (r * G + g0) * CH; /* head g0 + j·slots at pe + j·slots·CH */
            float *po = pr + (size_t)g0 * gstride + (size_t)d;
            if (nk == 4) attn_pv_pass<4>(pe, slots * CH, sv, hd, d, n, po, slots * gstride);
            else if (nk == 3) attn_pv_pass<3>(pe, slots * CH, sv, hd, d, n, po, slots * gstride);
            else if (nk == 2) attn_pv_pass<2>(pe, slots * CH, sv, hd, d, n, po, slots * gstride);
            else attn_pv_pass<1>(pe, slots * CH, sv, hd, d, n, po, slots * gstride);
        }
    }
    for (int i = threadIdx.x; i < nq; i += blockDim.x) {
        const int r = i / G;
        if (sn[r] == 0) continue;
        float *pr = part + (((size_t)(m0 + r) * (size_t)nh + (size_t)(kvh * G + i - r * G)) * (size_t)nchunk +
                            (size_t)c) *
                               (size_t)(hd + 2);
        pr[hd] = smx[i];
        pr[hd + 1] = ssum[i];
    }
}

/* Launches k_attn_tile for head_dim hd (64, 128 or 256) at the chunk in use (32 or 64); -1 for
 * other shapes. */
static int attn_tile_launch(const float *q, int qstride, int nh, int nkv, int hd, const float *k_cache,
                            const float *v_cache, float scale, int causal, const int32_t *pos0, int M, int nchunk,
                            float *part) {
    typedef void (*tile_fn)(const float *, int, int, int, int, const float *, const float *, float, int,
                            const int32_t *, int, int, int, float *, int);
    const int ch = g_attn_chunk, hi = hd == 64 ? 0 : hd == 128 ? 1 : hd == 256 ? 2 : -1;
    if (hi < 0 || (ch != 32 && ch != 64)) return -1;
    static const tile_fn fns[2][3] = {{k_attn_tile<32, 8>, k_attn_tile<32, 16>, k_attn_tile<32, 32>},
                                      {k_attn_tile<64, 16>, k_attn_tile<64, 32>, k_attn_tile<64, 64>}};
    static int raised[2][3];
    const tile_fn kern = fns[ch == 64][hi];
    const size_t smem = attn_tile_smem(ch, hd);
    if (!raised[ch == 64][hi]) {
        const int st = (int)cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (st) return st;
        raised[ch == 64][hi] = 1;
    }
    const int G = nh / nkv, rg = G < ATTN_QM ? ATTN_QM / G : 1;
    /* the groups of a chunk adjacent in launch order: the later ones read it from L2 */
    dim3 grid((unsigned)((M + rg - 1) / rg), (unsigned)nchunk, (unsigned)nkv);
    return launch_k(kern, grid, dim3(ATTN_THREADS), smem, q, qstride, nh, nkv, hd, k_cache, v_cache, scale, causal,
                    pos0, M, nchunk, rg, part, g_attn_diag);
}

/* One block per (head, row, 32 output dims): 256 threads = 8 chunk groups x 32 dims. The
 * maximum of the chunk maxima (exact in any order); the weights w_c = exp(m_c − max); the
 * denominator Σ w_c·s_c (each thread its chunks c = tid, tid + 256, ... in order, an xor tree
 * per warp, the 8 warp sums in order); per dim d, Σ w_c·o_c[d] over the chunks c ≡ g (mod 8) of
 * group g in order, then the 8 group sums in order. The chunks are spread over the threads so
 * that long contexts (hundreds of chunks) do not run one chunk at a time. */
#define ATTN_WSM 1024
__global__ void __launch_bounds__(256) k_attn_combine(const float *q, int qstride, int gated, int nh, int hd,
                                                      int causal, const int32_t *pos0p, int M, int nchunk, int chunk,
                                                      const float *part, float *out) {
    const int pos0 = __ldcg(pos0p); /* the step's parameters: before the wait (k_attn_tile) */
    k_pdl_begin();
    __shared__ float wsm[ATTN_WSM];
    __shared__ float red[8];
    __shared__ float psum[8][32];
    const int h = blockIdx.x, m = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int len = causal ? pos0 + m + 1 : pos0 + M;
    const int nc = (len + chunk - 1) / chunk;
    const size_t st = (size_t)(hd + 2);
    const float *pr = part + ((size_t)m * (size_t)nh + (size_t)h) * (size_t)nchunk * st;
    float mx = -INFINITY;
    for (int c = tid; c < nc; c += 256) mx = fmaxf(mx, __ldcg(&pr[(size_t)c * st + (size_t)hd]));
    for (int o2 = 16; o2 > 0; o2 >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o2));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
    for (int k = 1; k < 8; k++) mx = fmaxf(mx, red[k]);
    __syncthreads(); /* red is reused below */
    float l = 0.0f;
    for (int c = tid; c < nc; c += 256) {
        const float w = expf(__ldcg(&pr[(size_t)c * st + (size_t)hd]) - mx);
        if (c < ATTN_WSM) wsm[c] = w;
        l = l + w * __ldcg(&pr[(size_t)c * st + (size_t)hd + 1]);
    }
    l = warp_sum(l);
    if (lane == 0) red[warp] = l;
    __syncthreads();
    l = red[0];
    for (int k = 1; k < 8; k++) l = l + red[k];
    const float inv = 1.0f / l;
    const int d = (int)blockIdx.z * 32 + lane;
    float acc = 0.0f;
    if (d < hd)
        for (int c = warp; c < nc; c += 8) {
            const float w = c < ATTN_WSM ? wsm[c] : expf(__ldcg(&pr[(size_t)c * st + (size_t)hd]) - mx);
            acc = acc + w * __ldcg(&pr[(size_t)c * st + (size_t)d]);
        }
    psum[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && d < hd) {
        float r = psum[0][lane];
        for (int k = 1; k < 8; k++) r = r + psum[k][lane];
        r = r * inv;
        const float *gate = q + ((size_t)m * (size_t)nh + (size_t)h) * (size_t)qstride + (size_t)hd;
        out[((size_t)m * (size_t)nh + (size_t)h) * (size_t)hd + (size_t)d] = gated ? r * sigmoid_f(__ldcg(&gate[d])) : r;
    }
}

extern "C" int dfk_attention_shape_ok(int nh, int nkv, int hd) {
    return nkv > 0 && nh % nkv == 0 && nh / nkv <= ATTN_MAX_G && (hd == 64 || hd == 128 || hd == 256);
}

extern "C" int dfk_attention(const float *q, int qstride, int gated, int nh, int nkv, int hd, const float *k_cache,
                             const float *v_cache, int causal, const int32_t *pos0, int M, int nchunk, float *part,
                             float *out) {
    const float scale = 1.0f / sqrtf((float)hd);
    if (!dfk_attention_shape_ok(nh, nkv, hd)) return -1;
    int st = attn_tile_launch(q, qstride, nh, nkv, hd, k_cache, v_cache, scale, causal, pos0, M, nchunk, part);
    if (st) return st;
    dim3 g2((unsigned)nh, (unsigned)M, (unsigned)((hd + 31) / 32));
    return launch_k(k_attn_combine, g2, dim3(256), 0, q, qstride, gated, nh, hd, causal, pos0, M, nchunk,
                    g_attn_chunk, part, out);
}

/* ---- DFlash2 grouped dynamic convolution ---------------------------------------------------- */

/* One thread per (row t, channel): the CPU's order (per tap o: base term, then dynamic term). */
__global__ void k_dyn_conv(const float *x, const float *dyn, int dyn_stride, const float *base, int K, int gs, int M,
                           int H, float *out) {
    K_TR_ENTRY();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)M * (size_t)H) return;
    const int t = (int)(i / (size_t)H), ch = (int)(i % (size_t)H), G = H / gs;
    const float *d = dyn + (size_t)t * (size_t)dyn_stride;
    float o = 0.0f;
    for (int k = 0; k < K && k <= t; k++) {
        const float xv = x[(size_t)(t - k) * (size_t)H + (size_t)ch];
        o = o + base[(size_t)k * (size_t)H + (size_t)ch] * xv;
        o = o + d[k * G + ch / gs] * xv;
    }
    out[i] = o;
}

extern "C" int dfk_dyn_conv(const float *x, const float *dyn, int dyn_stride, const float *base, int K, int gs, int M,
                            int H, float *out) {
    const size_t n = (size_t)M * (size_t)H;
    k_dyn_conv<<<(unsigned)((n + 255) / 256), 256, 0, g_stream>>>(x, dyn, dyn_stride, base, K, gs, M, H, out);
    return launch_status();
}

/* ---- Gated DeltaNet ------------------------------------------------------------------------------ */

#define GDN_MAX_K 16

/* The causal depthwise conv + SiLU of channel ch for rows m0 .. m0 + n − 1 (n <= 16), the
 * window win [K − 1] (the channel's state, advanced here) and weights wk [K] in registers;
 * row r's output to out[r · ostride]. The arithmetic of every conv kernel here. */
template <int KM, int NR = 16>
static __device__ __forceinline__ void gdn_conv_rows(const float *qkv, int C, int K, int ch, int m0, int n,
                                                     float (&win)[KM], const float (&wk)[KM], float *out,
                                                     size_t ostride) {
    float xr[NR]; /* the inputs of the rows, loaded together */
#pragma unroll
    for (int r = 0; r < NR; r++) xr[r] = r < n ? __ldcg(&qkv[(size_t)(m0 + r) * (size_t)C + (size_t)ch]) : 0.0f;
#pragma unroll
    for (int r = 0; r < NR; r++) {
        if (r >= n) break;
        const float xin = xr[r];
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < KM; j++) {
            if (j < K - 1) s = s + wk[j] * win[j];
            else if (j == K - 1) s = s + wk[j] * xin;
        }
        out[(size_t)r * ostride] = silu_f(s);
#pragma unroll
        for (int j = 0; j < KM - 1; j++)
            if (j < K - 1) win[j] = (j + 1 < K - 1) ? win[j + 1] : xin;
    }
}

/* Channel ch's conv window and weights into registers. */
template <int KM>
static __device__ __forceinline__ void gdn_conv_load(const float *w, int C, int K, int ch, const float *state_in,
                                                     float (&win)[KM], float (&wk)[KM]) {
#pragma unroll
    for (int j = 0; j < KM; j++) {
        win[j] = (j < K - 1) ? __ldcg(&state_in[(size_t)j * (size_t)C + (size_t)ch]) : 0.0f;
        wk[j] = (j < K) ? w[(size_t)ch * (size_t)K + (size_t)j] : 0.0f;
    }
}

/* Channel ch's advanced window back to the state. */
template <int KM>
static __device__ __forceinline__ void gdn_conv_store(int C, int K, int ch, const float (&win)[KM], float *state) {
#pragma unroll
    for (int j = 0; j < KM; j++)
        if (j < K - 1) state[(size_t)j * (size_t)C + (size_t)ch] = win[j];
}

/* The conv of channel block blockIdx.x (k_gdn_conv, k_gdn_conv_multi), with windows of KM
 * registers (K <= KM). */
template <int KM = GDN_MAX_K>
static __device__ __forceinline__ void gdn_conv_block(const float *qkv, const float *w, int C, int K, int M,
                                                      const float *state_in, float *state, float *out) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    float win[KM], wk[KM];
    gdn_conv_load(w, C, K, ch, state_in, win, wk);
    for (int m0 = 0; m0 < M; m0 += 16)
        gdn_conv_rows(qkv, C, K, ch, m0, M - m0 < 16 ? M - m0 : 16, win, wk, out + (size_t)m0 * (size_t)C + (size_t)ch,
                      (size_t)C);
    gdn_conv_store(C, K, ch, win, state);
}

__global__ void k_gdn_conv(const float *qkv, const float *w, int C, int K, int M, const float *state_in, float *state,
                           float *out) {
    k_pdl_begin();
    gdn_conv_block(qkv, w, C, K, M, state_in, state, out);
}

/* Layer blockIdx.y of a job table: its conv, in place, into its own conv_out; windows of KM
 * registers; KM = 4 for the usual K <= 4, at four blocks per SM (64 registers, where the
 * compiler takes 98: a settle's 40 x 48 blocks in fewer waves; the same arithmetic). */
template <int KM>
__global__ void __launch_bounds__(256, KM <= 4 ? 4 : 1) k_gdn_conv_multi(const dfk_gdn_job *jobs, int C, int K, int M) {
    k_pdl_begin();
    const dfk_gdn_job &J = jobs[blockIdx.y];
    gdn_conv_block<KM>(J.qkv, J.conv_w, C, K, M, J.conv_state, J.conv_state, J.conv_out);
}

extern "C" int dfk_gdn_conv(const float *qkv, const float *conv_w, int C, int K, int M, const float *state_in,
                            float *conv_state, float *conv_out) {
    if (K < 1 || K > GDN_MAX_K) return (int)cudaErrorInvalidValue;
    return launch_k(k_gdn_conv, dim3((unsigned)((C + 255) / 256)), dim3(256), 0, qkv, conv_w, C, K, M, state_in,
                    conv_state, conv_out);
}

static __device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Rows per batch of the recurrence kernels (their normalized q/k in shared memory). */
#define GDN_RB 16

/* Shared memory of k_gdn_rec / k_gdn_rec_multi (floats): qs, ks [GDN_RB][dk], o [GDN_RB][dv],
 * two [4][dv] partial-sum buffers, beta and decay [GDN_RB]. */
static size_t gdn_rec_smem(int dk, int dv) {
    return (size_t)(2 * GDN_RB * dk + GDN_RB * dv + 8 * dv + 2 * GDN_RB) * sizeof(float);
}

/* One block per value head j: 4 x dv threads; thread (grp, v) keeps S[grp*SPT .. +SPT)[v] in
 * registers (SPT = dk/4). Rows in batches of RB (GDN_RB; 4 in k_gdn_fused's short instance,
 * whose unrolled conv has less code): first, a warp per row, the row's
 * L2-normalized q (times 1/sqrt(dk)) and k (lanes over the elements in order, then an xor
 * tree), β = σ(b) and the decay exp(A·softplus(a + dt_bias)), which do not depend on the
 * state; then per row, in order: decay, m = Sᵀk (4 partial sums added in order), d = (v − m)·β,
 * S += k ⊗ d, o = Sᵀq (same); last, a warp per row, the gated RMSNorm of o. Each row's
 * arithmetic is the same whatever M: two block barriers per row. */
/* The conv of a fused recurrence block (FUSED of gdn_rec_block): the projections qkv [M, C],
 * conv weights, kernel size, the state to read and the one to write. */
struct gdn_fconv {
    const float *qkv, *w, *state_in;
    float *state;
    int K;
};

/* Tickets of k_gdn_fused's key heads (at most GDN_MAX_KH): the blocks of a key head's value
 * heads count in once their conv has used the head's q/k windows; the last in writes the
 * advanced windows at its end and sets the count back to zero (launches of the stream run one
 * after the other past their waits, so one array serves every launch). */
#define GDN_MAX_KH DFK_GDN_MAX_KH
static __device__ unsigned g_gdn_tickets[GDN_MAX_KH];

template <int SPT, bool FUSED, int KMC = GDN_MAX_K, int RB = GDN_RB>
static __device__ __forceinline__ void gdn_rec_block(const float *conv_out, const float *z, const float *a,
                                                     const float *b, const float *A_log, const float *dt_bias,
                                                     const float *norm_w, int nk, int nv, int dv, float eps, int M,
                                                     const float *S_in, float *S, float *out, const gdn_fconv &fc,
                                                     unsigned pdl_site = 0) {
    constexpr int DK = 4 * SPT, PL = (DK + 31) / 32;
    extern __shared__ float gsm[];
    float *qs = gsm;                 /* [GDN_RB][DK] */
    float *ks = qs + GDN_RB * DK;    /* [GDN_RB][DK] */
    float *osm = ks + GDN_RB * DK;   /* [GDN_RB][dv] */
    float *part = osm + GDN_RB * dv; /* [4][dv] */
    float *part2 = part + 4 * dv;    /* [4][dv] */
    float *bet = part2 + 4 * dv;     /* [GDN_RB] */
    float *dec = bet + GDN_RB;       /* [GDN_RB] */
    float *cbuf = dec + GDN_RB;      /* FUSED: [GDN_RB][2·DK + dv], this head's conv outputs */
    const int j = blockIdx.x, kh = j / (nv / nk);
    const int tid = threadIdx.x, v = tid % dv, grp = tid / dv, lane = tid & 31, warp = tid >> 5;
    DFK_TR_PHASES_BEGIN(); /* phases: 1 conv, 2 q/k and gates, 3 recurrence, 4 norm, 5 stores */
    const int nwarps = (int)(blockDim.x >> 5);
    const int Kd = nk * DK, Vd = nv * dv, C = 2 * Kd + Vd;
    const float *Sj_in = S_in + (size_t)j * (size_t)DK * (size_t)dv;
    float *Sj = S + (size_t)j * (size_t)DK * (size_t)dv;
    float s[SPT];
#pragma unroll
    for (int i = 0; i < SPT; i++) s[i] = __ldcg(&Sj_in[(size_t)(grp * SPT + i) * (size_t)dv + (size_t)v]);
    const float qscale = 1.0f / sqrtf((float)DK);
    const float A = -expf(A_log[j]);
    const float dtb = dt_bias[j];
    /* FUSED: thread t < 2·DK + dv convolves one of the head's channels (its q, k, then v
     * channels), with the arithmetic of k_gdn_conv */
    const int nch = 2 * DK + dv;
    const int cch = tid < DK ? kh * DK + tid : (tid < 2 * DK ? Kd + kh * DK + (tid - DK) : 2 * Kd + j * dv + (tid - 2 * DK));
    float cwin[KMC], cwk[KMC];
    unsigned ticket = 0;
    const int ticket_tid = (int)blockDim.x - 32; /* lane 0 of the last warp */
    if constexpr (FUSED)
        if (tid < nch) gdn_conv_load(fc.w, C, fc.K, cch, fc.state_in, cwin, cwk);
    /* pdl_site (the calling kernel's trace site, DFK_TR_SITE: never 0): the states and weights
     * above were loaded before waiting for the previous kernel (no kernel of the step before this
     * one writes them: the caller knows); 0: the caller waited already */
    /* the gated norm's weights into shared memory now (weights: no kernel writes them), so that
     * the norm at the end reads them without a round trip to L2 on its path (dv <= 256) */
    __shared__ float nws[256];
    if (out && tid < dv) nws[tid] = __ldg(&norm_w[tid]);
    if (pdl_site) k_pdl_begin_(pdl_site);
    for (int m0 = 0; m0 < M; m0 += RB) {
        const int nb = M - m0 < RB ? M - m0 : RB;
        /* this warp's first row's gate inputs, loaded now: their latency overlaps the conv's */
        const float bin0 = lane == 0 && warp < nb ? __ldcg(&b[(size_t)(m0 + warp) * (size_t)nv + (size_t)j]) : 0.0f;
        const float ain0 = lane == 0 && warp < nb ? __ldcg(&a[(size_t)(m0 + warp) * (size_t)nv + (size_t)j]) : 0.0f;
        /* silu(z) of this warp's first row of the batch for the gated norm at the end (dv <= 256:
         * 8 per lane at most), loaded and computed now, while the state's loads are in flight,
         * instead of after the recurrence (the same values) */
        float zsl[8] = {};
        if (out && warp < nb) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int e = lane + 32 * i;
                if (e < dv) zsl[i] = silu_f(__ldcg(&z[(size_t)(m0 + warp) * (size_t)Vd + (size_t)j * (size_t)dv + (size_t)e]));
            }
        }
        if constexpr (FUSED) {
            if (tid < nch) gdn_conv_rows<KMC, RB>(fc.qkv, C, fc.K, cch, m0, nb, cwin, cwk, cbuf + tid, (size_t)nch);
            __syncthreads();
            DFK_TR_PHASE(0, 1);
            /* the windows are read (their values used by the conv, before the barrier): this
             * block's ticket of its key head (its value needed only at the end), after a fence
             * that orders the block's window loads before it; taken by the last warp, which has
             * a row below only when the batch has all GDN_RB rows (the fence and the atomic's
             * round trip are off the first rows' path) */
            if (m0 == 0 && tid == ticket_tid && nv > nk) {
                __threadfence();
                ticket = atomicAdd(&g_gdn_tickets[kh], 1u);
            }
        }
        for (int r = warp; r < nb; r += nwarps) {
            const float bin = r == warp ? bin0 : lane == 0 ? __ldcg(&b[(size_t)(m0 + r) * (size_t)nv + (size_t)j]) : 0.0f;
            const float ain = r == warp ? ain0 : lane == 0 ? __ldcg(&a[(size_t)(m0 + r) * (size_t)nv + (size_t)j]) : 0.0f;
            const float *row = FUSED ? NULL : conv_out + (size_t)(m0 + r) * (size_t)C;
            float qv[PL], kv[PL], sq = 0.0f, sk = 0.0f;
#pragma unroll
            for (int i = 0; i < PL; i++) {
                const int e = lane + 32 * i;
                if constexpr (FUSED) {
                    qv[i] = e < DK ? cbuf[r * nch + e] : 0.0f;
                    kv[i] = e < DK ? cbuf[r * nch + DK + e] : 0.0f;
                } else {
                    qv[i] = e < DK ? __ldcg(&row[(size_t)kh * DK + (size_t)e]) : 0.0f;
                    kv[i] = e < DK ? __ldcg(&row[(size_t)Kd + (size_t)kh * DK + (size_t)e]) : 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < PL; i++) {
                sq = sq + qv[i] * qv[i];
                sk = sk + kv[i] * kv[i];
            }
            const float qn = 1.0f / sqrtf(warp_sum(sq) + 1e-6f), kn = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
#pragma unroll
            for (int i = 0; i < PL; i++) {
                const int e = lane + 32 * i;
                if (e < DK) {
                    qs[r * DK + e] = (qv[i] * qn) * qscale;
                    ks[r * DK + e] = kv[i] * kn;
                }
            }
            if (lane == 0) {
                bet[r] = sigmoid_f(bin);
                dec[r] = expf(A * softplus_f(ain + dtb));
            }
        }
        __syncthreads();
        DFK_TR_PHASE(0, 2);
        const float *vcol = FUSED ? NULL : conv_out + 2 * (size_t)Kd + (size_t)j * (size_t)dv + (size_t)v;
        float vin_n = FUSED ? cbuf[2 * DK + v] : __ldcg(&vcol[(size_t)m0 * (size_t)C]);
        for (int r = 0; r < nb; r++) {
            const float vin = vin_n;
            if (r + 1 < nb)
                vin_n = FUSED ? cbuf[(r + 1) * nch + 2 * DK + v] : __ldcg(&vcol[(size_t)(m0 + r + 1) * (size_t)C]);
            const float decay = dec[r], beta = bet[r];
            const float *kr = ks + r * DK + grp * SPT, *qr = qs + r * DK + grp * SPT;
            float mp = 0.0f;
#pragma unroll
            for (int i = 0; i < SPT; i++) {
                s[i] = s[i] * decay;
                mp = mp + s[i] * kr[i];
            }
            part[grp * dv + v] = mp;
            __syncthreads();
            const float mem = ((part[v] + part[dv + v]) + part[2 * dv + v]) + part[3 * dv + v];
            const float d = (vin - mem) * beta;
            float op = 0.0f;
#pragma unroll
            for (int i = 0; i < SPT; i++) {
                s[i] = s[i] + kr[i] * d;
                op = op + s[i] * qr[i];
            }
            part2[grp * dv + v] = op;
            __syncthreads();
            if (grp == 0) osm[r * dv + v] = ((part2[v] + part2[dv + v]) + part2[2 * dv + v]) + part2[3 * dv + v];
        }
        DFK_TR_PHASE(0, 3);
        if (out) {
            __syncthreads(); /* osm */
            for (int r = warp; r < nb; r += nwarps) {
                const size_t m = (size_t)(m0 + r);
                float ss = 0.0f;
                for (int e = lane; e < dv; e += 32) ss = ss + osm[r * dv + e] * osm[r * dv + e];
                const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)dv + eps);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int e = lane + 32 * i;
                    if (e >= dv) break;
                    const size_t oi = m * (size_t)Vd + (size_t)j * (size_t)dv + (size_t)e;
                    const float sz = r == warp ? zsl[i] : silu_f(__ldcg(&z[oi]));
                    out[oi] = (nws[e] * (osm[r * dv + e] * inv)) * sz;
                }
            }
        }
        __syncthreads(); /* the batch's shared arrays are rewritten by the next */
        DFK_TR_PHASE(0, 4);
    }
#pragma unroll
    for (int i = 0; i < SPT; i++) Sj[(size_t)(grp * SPT + i) * (size_t)dv + (size_t)v] = s[i];
    /* FUSED: the advanced conv states. A q/k channel is shared by the R = nv/nk heads of its key
     * head, which all read its window and compute the same advanced one; with the states in
     * place, it may be written only once every one of them has read it, and a block of the
     * launch may start after another has ended (more heads than the device holds at once): so
     * the last of the R blocks to take a ticket writes it (a ticket per key head, taken once the
     * block's conv has used its window values, after a fence; the last one fences again before
     * its stores, and sets the count back to zero for the next launch, which reaches its
     * tickets only after this launch has ended). */
    if constexpr (FUSED) {
        __shared__ int last_in;
        const unsigned R = (unsigned)(nv / nk);
        if (R > 1) {
            if (tid == ticket_tid) {
                last_in = ticket == R - 1;
                if (ticket == R - 1) {
                    g_gdn_tickets[kh] = 0u;
                    __threadfence();
                }
            }
            __syncthreads();
        }
        if (tid < nch && (tid >= 2 * DK || R == 1 || last_in)) gdn_conv_store(C, fc.K, cch, cwin, fc.state);
    }
    DFK_TR_PHASE(0, 5);
}

template <int SPT>
__global__ void __launch_bounds__(512) k_gdn_rec(const float *conv_out, const float *z, const float *a, const float *b,
                                                 const float *A_log, const float *dt_bias, const float *norm_w, int nk,
                                                 int nv, int dv, float eps, int M, const float *S_in, float *S,
                                                 float *out) {
    k_pdl_begin();
    const gdn_fconv fc = {};
    gdn_rec_block<SPT, false>(conv_out, z, a, b, A_log, dt_bias, norm_w, nk, nv, dv, eps, M, S_in, S, out, fc);
}

/* The conv and the recurrence in one kernel: block j convolves its head's q, k and v channels
 * into shared memory (same bits as k_gdn_conv), then runs k_gdn_rec's recurrence on them. pre:
 * the states (S_in, conv_in) are loaded before waiting for the previous kernel. */
template <int SPT, int KMC, int RB>
__global__ void __launch_bounds__(512) k_gdn_fused(const float *qkv, const float *conv_w, int K, const float *conv_in,
                                                   float *conv_state, const float *z, const float *a, const float *b,
                                                   const float *A_log, const float *dt_bias, const float *norm_w,
                                                   int nk, int nv, int dv, float eps, int M, const float *S_in,
                                                   float *S, float *out, int pre) {
    const unsigned site = DFK_TR_SITE(0);
    if (!pre) k_pdl_begin_(site);
    const gdn_fconv fc = {qkv, conv_w, conv_in, conv_state, K};
    gdn_rec_block<SPT, true, KMC, RB>(NULL, z, a, b, A_log, dt_bias, norm_w, nk, nv, dv, eps, M, S_in, S, out, fc,
                                      pre ? site : 0u);
}

/* Layer blockIdx.y of a job table: its recurrence, states only, in place. Two blocks per SM
 * (at most 64 registers a thread): a settle's 48 x 48 blocks run in half the waves of one block
 * per SM (the compiler's choice without the bound: 127 registers), for a few bytes of spills;
 * register allocation only, so the same bits. */
template <int SPT>
__global__ void __launch_bounds__(512, 2) k_gdn_rec_multi(const dfk_gdn_job *jobs, int nk, int nv, int dv, float eps,
                                                       int M) {
    k_pdl_begin();
    const dfk_gdn_job &J = jobs[blockIdx.y];
    const gdn_fconv fc = {};
    gdn_rec_block<SPT, false>(J.conv_out, J.z, J.a, J.b, J.A_log, J.dt_bias, J.norm_w, nk, nv, dv, eps, M, J.S, J.S, NULL,
                              fc);
}

extern "C" int dfk_gdn_recurrence(const float *conv_out, const float *z, const float *a, const float *b,
                                  const float *A_log, const float *dt_bias, const float *norm_w, int nk, int nv,
                                  int dk, int dv, float eps, int M, const float *S_in, float *S, float *out) {
    const int threads = 4 * dv;
    if (dv < 1 || threads > 1024 || (threads & (threads - 1)) != 0 || dk > threads || nv % nk != 0) return -1;
    const size_t smem = gdn_rec_smem(dk, dv);
    int st;
    switch (dk) {
    case 32:
        st = launch_k(k_gdn_rec<8>, dim3((unsigned)nv), dim3((unsigned)threads), smem, conv_out, z, a, b, A_log,
                      dt_bias, norm_w, nk, nv, dv, eps, M, S_in, S, out);
        break;
    case 64:
        st = launch_k(k_gdn_rec<16>, dim3((unsigned)nv), dim3((unsigned)threads), smem, conv_out, z, a, b, A_log,
                      dt_bias, norm_w, nk, nv, dv, eps, M, S_in, S, out);
        break;
    case 128:
        st = launch_k(k_gdn_rec<32>, dim3((unsigned)nv), dim3((unsigned)threads), smem, conv_out, z, a, b, A_log,
                      dt_bias, norm_w, nk, nv, dv, eps, M, S_in, S, out);
        break;
    default:
        return -1;
    }
    return st;
}

static int g_gdn_small = 1;
extern "C" void dfk_set_gdn_small(int on) { g_gdn_small = on ? 1 : 0; }

/* k_gdn_fused for key head dim dk (32, 64, 128) with conv windows of KMC registers; for up to 4
 * rows (decode steps, short verify passes) its instance with batches of 4 rows (dfk_set_gdn_small),
 * whose shorter code runs faster (the kernel's code is run about once per launch; measured on the
 * H200: docs/PERFORMANCE.md). The rows are one batch either way: the same bits. */
template <int KMC>
static int gdn_fused_launch(int dk, size_t smem, int threads, const float *qkv, const float *conv_w, int K,
                            const float *conv_in, float *conv_state, const float *z, const float *a, const float *b,
                            const float *A_log, const float *dt_bias, const float *norm_w, int nk, int nv, int dv,
                            float eps, int M, const float *S_in, float *S, float *out, int pre) {
    void (*kern)(const float *, const float *, int, const float *, float *, const float *, const float *,
                 const float *, const float *, const float *, const float *, int, int, int, float, int, const float *,
                 float *, float *, int) =
        g_gdn_small && M <= 4
            ? (dk == 32 ? k_gdn_fused<8, KMC, 4> : (dk == 64 ? k_gdn_fused<16, KMC, 4> : k_gdn_fused<32, KMC, 4>))
            : (dk == 32 ? k_gdn_fused<8, KMC, GDN_RB> : (dk == 64 ? k_gdn_fused<16, KMC, GDN_RB> : k_gdn_fused<32, KMC, GDN_RB>));
    if (dk != 32 && dk != 64 && dk != 128) return -1;
    static bool attr[6];
    const int ai = (dk == 32 ? 0 : (dk == 64 ? 1 : 2)) + (g_gdn_small && M <= 4 ? 3 : 0);
    if (!attr[ai]) {
        if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024) != cudaSuccess)
            return (int)cudaGetLastError();
        attr[ai] = true;
    }
    return launch_k(kern, dim3((unsigned)nv), dim3((unsigned)threads), smem, qkv, conv_w, K, conv_in, conv_state, z,
                    a, b, A_log, dt_bias, norm_w, nk, nv, dv, eps, M, S_in, S, out, pre);
}

extern "C" int dfk_gdn_fused(const float *qkv, const float *conv_w, int K, const float *conv_in, float *conv_state,
                             const float *z, const float *a, const float *b, const float *A_log, const float *dt_bias,
                             const float *norm_w, int nk, int nv, int dk, int dv, float eps, int M, const float *S_in,
                             float *S, float *out, int pre) {
    const int threads = 4 * dv;
    if (K < 1 || K > GDN_MAX_K || dv < 1 || threads > 1024 || (threads & (threads - 1)) != 0 || dk > threads ||
        nv % nk != 0 || 2 * dk + dv > threads || nk > GDN_MAX_KH || M < 1)
        return -1;
    const size_t smem = gdn_rec_smem(dk, dv) + (size_t)GDN_RB * (size_t)(2 * dk + dv) * sizeof(float);
    return K <= 4 ? gdn_fused_launch<4>(dk, smem, threads, qkv, conv_w, K, conv_in, conv_state, z, a, b, A_log,
                                          dt_bias, norm_w, nk, nv, dv, eps, M, S_in, S, out, pre)
                  : gdn_fused_launch<GDN_MAX_K>(dk, smem, threads, qkv, conv_w, K, conv_in, conv_state, z, a, b,
                                                A_log, dt_bias, norm_w, nk, nv, dv, eps, M, S_in, S, out, pre);
}

extern "C" int dfk_gdn_multi(const dfk_gdn_job *jobs, int n, int C, int K, int nk, int nv, int dk, int dv, float eps,
                             int M) {
    const int threads = 4 * dv;
    if (n < 1 || n > 65535 || K < 1 || K > GDN_MAX_K || dv < 1 || threads > 1024 || (threads & (threads - 1)) != 0 ||
        dk > threads || nv % nk != 0)
        return -1;
    const dim3 cgrid((unsigned)((C + 255) / 256), (unsigned)n);
    int st = K <= 4 ? launch_k(k_gdn_conv_multi<4>, cgrid, dim3(256), 0, jobs, C, K, M)
                    : launch_k(k_gdn_conv_multi<GDN_MAX_K>, cgrid, dim3(256), 0, jobs, C, K, M);
    if (st) return st;
    const size_t smem = gdn_rec_smem(dk, dv);
    const dim3 grid((unsigned)nv, (unsigned)n);
    switch (dk) {
    case 32: return launch_k(k_gdn_rec_multi<8>, grid, dim3((unsigned)threads), smem, jobs, nk, nv, dv, eps, M);
    case 64: return launch_k(k_gdn_rec_multi<16>, grid, dim3((unsigned)threads), smem, jobs, nk, nv, dv, eps, M);
    case 128: return launch_k(k_gdn_rec_multi<32>, grid, dim3((unsigned)threads), smem, jobs, nk, nv, dv, eps, M);
    default: return -1;
    }
}

/* ---- copy bandwidth ------------------------------------------------------------------------- */

/* ---- timeline trace -------------------------------------------------------------------------- */

static dfk_trace_rec *g_tr_host_buf;
static unsigned *g_tr_host_ctr;
static unsigned g_tr_host_cap;

static int trace_bind(dfk_trace_rec *buf, unsigned *ctr, unsigned mask) {
    int st = dfk_tr_bind_here(buf, ctr, mask);
    if (!st) st = dfk_trace_bind_qlin(buf, ctr, mask);
    return st;
}

extern "C" int dfk_trace_start(int log2_records) {
    if (log2_records < 10 || log2_records > 24) return (int)cudaErrorInvalidValue;
    if (g_tr_host_buf) return 0;
    const unsigned cap = 1u << log2_records;
    void *b = NULL, *c = NULL;
    int st = (int)cudaMalloc(&b, (size_t)cap * sizeof(dfk_trace_rec));
    if (!st) st = (int)cudaMalloc(&c, sizeof(unsigned));
    if (!st) st = (int)cudaMemset(c, 0, sizeof(unsigned));
    if (!st) st = trace_bind((dfk_trace_rec *)b, (unsigned *)c, cap - 1);
    if (st) {
        cudaFree(b);
        cudaFree(c);
        return st;
    }
    g_tr_host_buf = (dfk_trace_rec *)b;
    g_tr_host_ctr = (unsigned *)c;
    g_tr_host_cap = cap;
    return 0;
}

extern "C" int dfk_trace_dump(const char *path) {
    if (!g_tr_host_buf) return 0;
    unsigned n = 0;
    int st = (int)cudaDeviceSynchronize();
    if (!st) st = (int)cudaMemcpy(&n, g_tr_host_ctr, sizeof(n), cudaMemcpyDeviceToHost);
    const unsigned cap = g_tr_host_cap, count = n < cap ? n : cap, first = n < cap ? 0 : n & (cap - 1);
    dfk_trace_rec *h = st ? NULL : (dfk_trace_rec *)malloc((size_t)cap * sizeof(dfk_trace_rec));
    if (!st && !h) st = -1;
    if (!st) st = (int)cudaMemcpy(h, g_tr_host_buf, (size_t)cap * sizeof(dfk_trace_rec), cudaMemcpyDeviceToHost);
    if (!st) {
        FILE *f = fopen(path, "wb");
        const uint32_t hdr[2] = {count, (uint32_t)sizeof(dfk_trace_rec)};
        int ok = f && fwrite("DFTRACE1", 1, 8, f) == 8 && fwrite(hdr, sizeof(hdr), 1, f) == 1;
        for (unsigned i = 0; ok && i < count; i++) ok = fwrite(&h[(first + i) & (cap - 1)], sizeof(*h), 1, f) == 1;
        if (f && fclose(f) != 0) ok = 0;
        if (!ok) st = -1;
    }
    free(h);
    trace_bind(NULL, NULL, 0);
    cudaFree(g_tr_host_buf);
    cudaFree(g_tr_host_ctr);
    g_tr_host_buf = NULL;
    g_tr_host_ctr = NULL;
    return st;
}

extern "C" int dfk_copy_bandwidth(size_t bytes, int reps, double *gbps) {
    void *a = NULL, *b = NULL;
    cudaEvent_t e0, e1;
    int st = (int)cudaMalloc(&a, bytes);
    if (!st) st = (int)cudaMalloc(&b, bytes);
    if (!st) st = (int)cudaMemset(a, 1, bytes);
    if (!st) st = (int)cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    if (!st) {
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaEventRecord(e0, 0);
        for (int i = 0; i < reps; i++) cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, 0);
        cudaEventRecord(e1, 0);
        st = (int)cudaEventSynchronize(e1);
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, e0, e1);
        *gbps = 2.0 * (double)bytes * (double)reps / ((double)ms * 1e-3) / 1e9;
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    cudaFree(a);
    cudaFree(b);
    return st;
}
