/* The CUDA backend (H100/H200, sm_90): every op of backend.h on one GPU.
 *
 * Memory: alloc/dealloc are cudaMalloc/cudaFree (zeroed); activations, KV cache and GDN states
 * live on the device. Weights are the pack's host pointers (df_linear, df_vecf): each is
 * uploaded on first use and kept in a table keyed by host pointer, with a fingerprint (shape,
 * dtype and the first/middle/last bytes) so that a host buffer freed and reused for other
 * data is uploaded again. Quantized 2/4/8-bit weights with group 64/128 and dense bf16
 * weights (cols % 64 == 0) are repacked on the device into tensor-core fragment order and run
 * on mma.sync (bf16 operands that represent the float32 activations exactly: hi+mid+lo); every
 * other format runs on CUDA cores. Setting the environment variable DFLASH_CUDA_LINEAR=simple
 * before creating the backend forces the CUDA-core path for all linears (a cross-check).
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
} df_cuda_stats;

void df_backend_cuda_stats(df_backend *be, df_cuda_stats *st);
/* Sets peak_bytes to cur_bytes. */
void df_backend_cuda_reset_peak(df_backend *be);
/* Runs the recorded ops and waits for all device work (for timing). */
void df_backend_cuda_sync(df_backend *be);

/* Measures device-to-device copy bandwidth with a `bytes` buffer (read + written bytes per
 * second, GB/s). Errors: DF_ERR_NOMEM, DF_ERR_INTERNAL. */
df_status df_cuda_copy_bandwidth(size_t bytes, double *gbps, df_error *err);

/* Device name and memory (total bytes) of device 0. */
df_status df_cuda_device_info(char *name, size_t name_len, size_t *total_bytes, df_error *err);

#endif
