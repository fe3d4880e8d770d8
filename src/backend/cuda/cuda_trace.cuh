/* Kernel timeline records for experiments (DFLASH_CUDA_TRACE, docs/PERFORMANCE.md): when a
 * trace buffer is bound, thread 0 of every CTA of the step's kernels appends one record at the
 * point where its inputs are ready (after griddepcontrol.wait, or at entry for kernels launched
 * without PDL), and the fixed-point linear a second record at its end. Records go into a ring
 * (the newest kept) through one atomic counter; nothing is recorded when no buffer is bound
 * (one load of a device pointer per CTA). The records change no result. Included by each .cu
 * file; each keeps its own copy of the pointers (dfk_trace_bind_* sets them). */
#ifndef DFLASH_CUDA_TRACE_CUH
#define DFLASH_CUDA_TRACE_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "backend/cuda/cuda_kernels.h"

static __device__ dfk_trace_rec *g_tr_buf;
static __device__ unsigned *g_tr_ctr;
static __device__ unsigned g_tr_mask;

/* Points this file's copies of the trace pointers at buf/ctr (NULL: off). Returns 0 or the
 * CUDA error. */
static int dfk_tr_bind_here(dfk_trace_rec *buf, unsigned *ctr, unsigned mask) {
    int st = (int)cudaMemcpyToSymbol(g_tr_buf, &buf, sizeof(buf));
    if (!st) st = (int)cudaMemcpyToSymbol(g_tr_ctr, &ctr, sizeof(ctr));
    if (!st) st = (int)cudaMemcpyToSymbol(g_tr_mask, &mask, sizeof(mask));
    return st;
}

/* The global nanosecond timer (32 ns ticks on the H200, one clock for every SM). */
static __device__ __forceinline__ uint64_t dfk_tr_gtime(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
static __device__ __forceinline__ uint64_t dfk_tr_gridid(void) {
    uint64_t g;
    asm volatile("mov.u64 %0, %%gridid;\n" : "=l"(g));
    return g;
}
static __device__ __forceinline__ unsigned dfk_tr_smid(void) {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(s));
    return s;
}

/* A CTA's start: its cycle count (0 when no trace is bound or not thread 0). */
struct dfk_tr_start {
    long long clk;
};
static __device__ __forceinline__ dfk_tr_start dfk_tr_begin(void) {
    dfk_tr_start s;
    s.clk = (threadIdx.x == 0 && g_tr_buf) ? clock64() : 0;
    return s;
}
/* Appends the record of this CTA at source line `site` (kind: 0 = inputs ready, 1 = end; aux:
 * a kernel-defined count), from thread 0 only. */
static __device__ __forceinline__ void dfk_tr_mark(const dfk_tr_start &s, unsigned site, unsigned kind,
                                                   unsigned aux) {
    if (threadIdx.x != 0 || !g_tr_buf) return;
    const long long now = clock64();
    const unsigned i = atomicAdd(g_tr_ctr, 1u) & g_tr_mask;
    dfk_trace_rec r;
    r.grid = dfk_tr_gridid();
    r.gtime = dfk_tr_gtime();
    r.clk = (uint64_t)now;
    r.dclk = (uint32_t)(now - s.clk);
    r.site = (uint16_t)site;
    r.kind = (uint16_t)kind;
    r.sm = (uint16_t)dfk_tr_smid();
    r.cta = (uint16_t)(blockIdx.x + gridDim.x * blockIdx.y);
    r.aux = (uint32_t)aux;
    g_tr_buf[i] = r;
}

#define DFK_TR_SITE(base) ((unsigned)(base) + (unsigned)__LINE__)

/* Phase records for experiments, compiled in only with -DDFLASH_TRACE_PHASES (CMAKE_CUDA_FLAGS):
 * DFK_TR_PHASES_BEGIN() at a kernel's start, then DFK_TR_PHASE(base, n) appends a record of
 * kind 2 with aux = n (tools/trace_report.py --phases: microseconds after the launch's ready).
 * Each costs thread 0 an atomic on the trace counter, which delays its warp: compare phases
 * with each other, not a traced span with an untraced one. */
#ifdef DFLASH_TRACE_PHASES
#define DFK_TR_PHASES_BEGIN() const dfk_tr_start dfk_trs_phases = dfk_tr_begin()
#define DFK_TR_PHASE(base, n) dfk_tr_mark(dfk_trs_phases, DFK_TR_SITE(base), 2, (n))
#else
#define DFK_TR_PHASES_BEGIN() ((void)0)
#define DFK_TR_PHASE(base, n) ((void)0)
#endif

#endif
