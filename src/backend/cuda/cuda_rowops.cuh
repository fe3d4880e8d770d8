/* Device helpers shared by cuda_kernels.cu and cuda_qlin.cu, so that the unfused RMSNorm and
 * the norm fused into the linears' input preparation compute the same bits. */
#ifndef DFLASH_CUDA_ROWOPS_CUH
#define DFLASH_CUDA_ROWOPS_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "backend/cuda/cuda_kernels.h"

/* Launches kernel<<<grid, block, smem>>> on the launchers' stream (dfk_get_stream), with the
 * programmatic stream serialization attribute when pdl is set: the next kernel may then be
 * scheduled early and must wait (griddepcontrol.wait) before reading what earlier kernels
 * wrote. Returns 0 or the CUDA error. */
template <typename... KArgs, typename... Args>
static int dfk_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, int pdl, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = (cudaStream_t)dfk_get_stream();
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
    if (e != cudaSuccess) {
        /* a failed launch also leaves its error as the thread's last error, where the next
         * launch's check (of any backend of the process) would take it for its own */
        (void)cudaGetLastError();
        return (int)e;
    }
    return (int)cudaGetLastError();
}

/* silu(x) = x / (1 + e^-x), float32. */
static __device__ __forceinline__ float dfk_silu(float x) { return x / (1.0f + expf(-x)); }

/* Part s (0 = hi, 1 = mid, 2 = lo) of the exact three-way bf16 split of x (x = hi + mid + lo),
 * as bits: the B operands of the bf16 tensor-core linear, written by dfk_prep and dfk_qprep
 * with these same operations. */
static __device__ __forceinline__ uint32_t dfk_split_part(float x, int s) {
    const __nv_bfloat16 hi = __float2bfloat16_rn(x);
    const float r1 = x - __bfloat162float(hi);
    const __nv_bfloat16 mid = __float2bfloat16_rn(r1);
    const float r2 = r1 - __bfloat162float(mid);
    const __nv_bfloat16 lo = __float2bfloat16_rn(r2);
    return (uint32_t)__bfloat16_as_ushort(s == 0 ? hi : (s == 1 ? mid : lo));
}

/* Σ v_i² over a row of `cols` floats, v = up ? silu(x)·up : x, for a block of 256 threads (every
 * thread gets the result). Order: thread tid adds v_i² for i = tid, tid + 256, ... in order
 * (loads issued 24 at a time, one round trip for rows up to 6144, through L2: see cuda_qlin.cu
 * on PDL), then an xor butterfly in
 * each warp, then the 8 warp sums in order 0..7. red8: 8 floats of shared memory. */
static __device__ __forceinline__ float dfk_row_sumsq(const float *xr, const float *ur, int cols, float *red8) {
    const int tid = threadIdx.x;
    float acc = 0.0f;
    for (int i0 = 0; i0 < cols; i0 += 24 * 256) {
        float v[24], u[24];
        /* one base pointer and constant offsets (not an index per load): the loads' addresses
         * take no instructions of their own */
        const float *xp = xr + i0 + tid, *upp = ur ? ur + i0 + tid : NULL;
        const int lim = cols - i0 - tid; /* element j * 256 of this thread exists iff j * 256 < lim */
#pragma unroll
        for (int j = 0; j < 24; j++) {
            v[j] = j * 256 < lim ? __ldcg(xp + j * 256) : 0.0f;
            u[j] = (upp && j * 256 < lim) ? __ldcg(upp + j * 256) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 24; j++) {
            if (j * 256 < lim) {
                const float w = ur ? dfk_silu(v[j]) * u[j] : v[j];
                acc = acc + w * w;
            }
        }
    }
    for (int off = 16; off > 0; off >>= 1) acc = acc + __shfl_xor_sync(0xffffffffu, acc, off);
    __syncthreads(); /* red8 may still be read from an earlier call */
    if ((tid & 31) == 0) red8[tid >> 5] = acc;
    __syncthreads();
    float s = red8[0];
    for (int k = 1; k < 8; k++) s = s + red8[k];
    return s;
}

/* The RMSNorm scale of a row from its sum of squares: 1 / sqrt(Σ/cols + eps). */
static __device__ __forceinline__ float dfk_rms_inv(float sumsq, int cols, float eps) {
    const float ms = sumsq / (float)cols;
    return 1.0f / sqrtf(ms + eps);
}

/* The K-slice reduction of the tensor-core linears (cuda_kernels.cu k_lin_mma, cuda_qlin.cu):
 * warp (rw, kw) of a CTA holds partial sums yv of its tiles; warp (rw, 0) gets the sum over
 * kw = 0..KW−1 in that order (warps rw·KW + kw adjacent). red: [8][TR·NT·2][32] floats of shared
 * memory. Every thread of the CTA calls it (it synchronizes; red may be reused right after). */
template <int TR, int NT>
static __device__ __forceinline__ void dfk_kslice_sum(float (*red)[TR * NT * 2][32], float (&yv)[TR][NT][2], int KW,
                                                      int kw, int warp, int lane) {
    __syncthreads(); /* red may still be read by an earlier reduction */
#pragma unroll
    for (int tr = 0; tr < TR; tr++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            red[warp][(tr * NT + nt) * 2][lane] = yv[tr][nt][0];
            red[warp][(tr * NT + nt) * 2 + 1][lane] = yv[tr][nt][1];
        }
    __syncthreads();
    if (kw != 0) return;
#pragma unroll
    for (int tr = 0; tr < TR; tr++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            float a0 = red[warp][(tr * NT + nt) * 2][lane], a1 = red[warp][(tr * NT + nt) * 2 + 1][lane];
            for (int k = 1; k < KW; k++) {
                a0 = a0 + red[warp + k][(tr * NT + nt) * 2][lane];
                a1 = a1 + red[warp + k][(tr * NT + nt) * 2 + 1][lane];
            }
            yv[tr][nt][0] = a0;
            yv[tr][nt][1] = a1;
        }
}

/* ---- mbarriers and bulk copies (shared-memory addresses as from __cvta_generic_to_shared) ---- */

static __device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_expect(uint32_t bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity) {
    uint32_t done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
/* bytes (a multiple of 16; both addresses 16-byte aligned) from global src to shared dst,
 * completing on mbarrier bar. */
static __device__ __forceinline__ void bulk_copy(uint32_t dst, const void *src, unsigned bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

#endif
