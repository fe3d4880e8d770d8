/* The CUDA backend (H100/H200, sm_90): every op of backend.h on one GPU.
 *
 * Memory: alloc/dealloc are cudaMalloc/cudaFree (zeroed); activations, KV cache and GDN states
 * live on the device. Weights are the pack's host pointers (df_linear, df_vecf): each is
 * uploaded on first use and kept in a table keyed by host pointer, with a fingerprint (shape,
 * dtype and the first/middle/last bytes) so that a host buffer freed and reused for other
 * data is uploaded again. Quantized 2/4/8-bit weights with group 64/128 are repacked into the
 * fragment order of the fixed-point linear (cuda_qlin.cu: integer tensor cores, activations as
 * 16-bit fixed point per group, exact group sums); dense bf16 weights (cols % 64 == 0, the
 * drafter) run on bf16 mma.sync with the float32 activations split exactly into three bf16
 * parts (hi + mid + lo); dense f16/bf16 weights otherwise on a CUDA-core kernel; every other
 * format on the generic CUDA-core path. Environment variables read when the backend is created
 * (experiments and cross-checks; none changes a result's exactness): DFLASH_CUDA_LINEAR=simple
 * (every linear on CUDA cores), DFLASH_CUDA_LINEAR=bf16split (quantized weights on the bf16
 * path instead of the fixed-point one), DFLASH_CUDA_PDL=0 (no programmatic dependent launch; =linears: for the
 * linears' kernels only),
 * DFLASH_CUDA_QSMEM=0 (the fixed-point linear reads its input through L2 instead of shared
 * memory), DFLASH_CUDA_QRING=0 (the fixed-point linear on its register kernel instead of the
 * ring kernel), DFLASH_CUDA_QRING_MAXM=N (the ring kernel only up to N rows), DFLASH_CUDA_QCTAS=N
 * (the ring kernel's grid), DFLASH_CUDA_QPERSIST=1 (the register kernel on a persistent grid),
 * DFLASH_CUDA_KW / DFLASH_CUDA_KW_MAX / DFLASH_CUDA_TARGET_CTAS (work split), DFLASH_CUDA_QGRID=0 (the ring kernel on
 * the fewest CTAs with equal units instead of every CTA the device holds),
 * DFLASH_CUDA_ATTN_CHUNK=64 (attention chunks of 64 positions instead of 32: other bits, the same
 * for every M), DFLASH_CUDA_ATTN_DIAG=1|2 (timing experiments, wrong outputs: the attention
 * chunks' copies alone, or their arithmetic alone), DFLASH_CUDA_GRAPHS=0 (no CUDA graphs), DFLASH_CUDA_TRACE=FILE (a timeline of the
 * kernels of the last steps, written to FILE when the backend is destroyed: cuda_trace.cuh,
 * tools/trace_report.py).
 *
 * The backend also provides the fused ops of backend.h (`linears`: RMSNorm + several linears
 * of one input; `linear_add`: SwiGLU + linear + residual add) with the bits of the composition.
 *
 * Ops are recorded and run in steps at the next point where the host needs a result; a step
 * that repeats (a decode step, a verify pass of the same block size) is replayed as a CUDA
 * graph (DFLASH_CUDA_GRAPHS=0 disables graphs). Values that change between replays (token ids,
 * positions, cache lengths, host data) are read by the kernels from device memory.
 *
 * Exactness: see cuda_kernels.h. An op that fails (out of memory, CUDA error, unsupported
 * shape) sets be->failed; df_backend_cuda_last_error gives the message.
 */
#ifndef DFLASH_CUDA_BACKEND_H
#define DFLASH_CUDA_BACKEND_H

#include <stddef.h>

#include "backend/backend.h"

/* 1 if a CUDA device is usable (the runtime found one and the driver accepts this build). */
int df_cuda_available(void);

/* The message of the first failure of a CUDA backend's op ("" if none). */
const char *df_backend_cuda_last_error(df_backend *be);

typedef struct df_cuda_stats {
    size_t cur_bytes;      /* device memory held by this backend now (weights + buffers + scratch) */
    size_t peak_bytes;     /* the most it held since creation or the last reset */
    size_t weight_bytes;   /* of which uploaded weights (repacked size) */
    int n_weights;         /* weight entries uploaded */
    long steps;            /* recorded steps run (see cuda_backend.c: steps and graphs) */
    long graph_replays;    /* of which replayed as a CUDA graph */
    long graph_captures;   /* graphs captured */
    /* host time, ms, summed over the steps replayed as graphs: from the end of the previous
     * step (its wait for the device) to this step's run (the engine's work between steps and
     * the recording of the step's commands: the device has nothing queued then), and from there
     * to the graph's launch call's return (the step's lookup among the graphs, the launch) */
    double host_between_ms, host_launch_ms;
    /* with DFLASH_CUDA_HOST_PROFILE=1 (diagnostics; the timing costs host time itself): ms in
     * the weight table's lookups (with their fingerprints) and in recording commands, over all
     * steps; and the commands recorded (always counted) */
    double host_weights_ms, host_record_ms;
    long commands;
} df_cuda_stats;

void df_backend_cuda_stats(df_backend *be, df_cuda_stats *st);
/* Sets peak_bytes to cur_bytes. */
void df_backend_cuda_reset_peak(df_backend *be);
/* Runs the recorded ops and waits for all device work (for timing). */
void df_backend_cuda_sync(df_backend *be);

/* 1 (default): the GDN conv and recurrence in one kernel; 0: two (DFLASH_CUDA_GDN_FUSED=0).
 * The same bits either way (tests compare them); process-wide, set between steps. */
void df_backend_cuda_set_gdn_fused(df_backend *be, int on);

/* The attention chunk, 32 (default) or 64 positions (DFLASH_CUDA_ATTN_CHUNK): part of the
 * arithmetic, the same for every M. Process-wide; set between steps (tests compare both). */
void df_backend_cuda_set_attn_chunk(df_backend *be, int chunk);

/* Measures device-to-device copy bandwidth with a `bytes` buffer (read + written bytes per
 * second, GB/s). Errors: DF_ERR_NOMEM, DF_ERR_INTERNAL. */
df_status df_cuda_copy_bandwidth(size_t bytes, double *gbps, df_error *err);

/* Device name and memory (total bytes) of device 0. */
df_status df_cuda_device_info(char *name, size_t name_len, size_t *total_bytes, df_error *err);

#endif
