/* bench_pdl_gap: how soon a dependent kernel may go on after the kernel before it ends, on the
 * GPU of this process (issue 6, docs/PERFORMANCE.md).
 *
 *   bench_pdl_gap [--iters N]
 *
 * Kernel A (264 CTAs of 256 threads, two per SM on the H200, as the fixed-point linears) spins
 * for a while (2 or 6 µs, a little longer on some CTAs), then each CTA records its end (the
 * global timer, ns). Kernel B (17 CTAs, as the largest input preparation of the 27B pack) is
 * launched after it with programmatic dependent launch and waits for A in one of two ways:
 *   - PDL: griddepcontrol.wait (A's grid has ended and its memory is visible);
 *   - flag: each CTA of A adds one to a counter after a fence; thread 0 of each CTA of B polls
 *     the counter with acquire loads until all of A's CTAs have counted in.
 * Printed per mode: B's first ready minus A's last end, mean and minimum over the iterations
 * after 20 of warm-up. At 2 µs B's CTAs are still being placed when A ends; at 6 µs they wait
 * in place, the case of the step's kernels. Timing only: no output is checked.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NA 264
#define NB 17

static __device__ __forceinline__ unsigned long long gtimer(void) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void k_a(unsigned long long *ends, unsigned *flag, int use_flag, int spin_ns, float *junk) {
    asm volatile("griddepcontrol.launch_dependents;");
    const unsigned long long t0 = gtimer(), lim = (unsigned long long)spin_ns + (blockIdx.x % 7) * 100ull;
    float a = (float)threadIdx.x;
    while (gtimer() - t0 < lim) a = a * 1.0001f + 1.0f;
    junk[blockIdx.x * blockDim.x + threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.x == 0) {
        if (use_flag) {
            __threadfence();
            atomicAdd(flag, 1u);
        }
        ends[blockIdx.x] = gtimer();
    }
}

__global__ void k_b(unsigned long long *readys, unsigned *flag, int use_flag, unsigned n, const float *junk,
                    float *out) {
    asm volatile("griddepcontrol.launch_dependents;");
    if (use_flag) {
        if (threadIdx.x == 0) {
            unsigned v;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
            } while (v < n);
        }
        __syncthreads();
    } else {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    if (threadIdx.x == 0) readys[blockIdx.x] = gtimer();
    out[blockIdx.x * blockDim.x + threadIdx.x] = __ldcg(junk + blockIdx.x * blockDim.x + threadIdx.x);
}

__global__ void k_reset(unsigned *flag) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    *flag = 0u;
}

/* kernel<<<grid, block>>>(args) with the programmatic-dependent-launch attribute. */
template <typename... KArgs, typename... Args>
static cudaError_t launch_pdl(void (*kernel)(KArgs...), unsigned grid, unsigned block, Args... args) {
    cudaLaunchConfig_t c;
    memset(&c, 0, sizeof c);
    c.gridDim = dim3(grid);
    c.blockDim = dim3(block);
    cudaLaunchAttribute at;
    at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at.val.programmaticStreamSerializationAllowed = 1;
    c.attrs = &at;
    c.numAttrs = 1;
    return cudaLaunchKernelEx(&c, kernel, args...);
}

static int check(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 1;
    fprintf(stderr, "bench_pdl_gap: %s: %s\n", what, cudaGetErrorString(e));
    return 0;
}

int main(int argc, char **argv) {
    int iters = 200;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
            iters = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: bench_pdl_gap [--iters N]\n");
            return 2;
        }
    }
    if (iters < 21) iters = 21;
    unsigned long long *ends = NULL, *readys = NULL;
    unsigned *flag = NULL;
    float *junk = NULL, *out = NULL;
    if (!check(cudaMalloc((void **)&ends, NA * sizeof *ends), "cudaMalloc") ||
        !check(cudaMalloc((void **)&readys, NB * sizeof *readys), "cudaMalloc") ||
        !check(cudaMalloc((void **)&flag, sizeof *flag), "cudaMalloc") ||
        !check(cudaMalloc((void **)&junk, NA * 256 * sizeof *junk), "cudaMalloc") ||
        !check(cudaMalloc((void **)&out, NB * 256 * sizeof *out), "cudaMalloc") ||
        !check(cudaMemset(flag, 0, sizeof *flag), "cudaMemset"))
        return 1;
    static unsigned long long he[NA], hr[NB];
    const int spins[2] = {2000, 6000};
    printf("B ready - A last end (ns), %d iterations after 20 of warm-up\n", iters - 20);
    for (int si = 0; si < 2; si++) {
        for (int use_flag = 0; use_flag < 2; use_flag++) {
            double sum = 0.0, lo = 1e18;
            int n = 0;
            for (int it = 0; it < iters; it++) {
                if (!check(launch_pdl(k_reset, 1, 32, flag), "launch") ||
                    !check(launch_pdl(k_a, NA, 256, ends, flag, use_flag, spins[si], junk), "launch") ||
                    !check(launch_pdl(k_b, NB, 256, readys, flag, use_flag, (unsigned)NA, (const float *)junk, out),
                           "launch") ||
                    !check(cudaDeviceSynchronize(), "kernels") ||
                    !check(cudaMemcpy(he, ends, sizeof he, cudaMemcpyDeviceToHost), "cudaMemcpy") ||
                    !check(cudaMemcpy(hr, readys, sizeof hr, cudaMemcpyDeviceToHost), "cudaMemcpy"))
                    return 1;
                unsigned long long last_end = 0, first_ready = ~0ull;
                for (int i = 0; i < NA; i++) last_end = he[i] > last_end ? he[i] : last_end;
                for (int i = 0; i < NB; i++) first_ready = hr[i] < first_ready ? hr[i] : first_ready;
                if (it < 20) continue;
                const double d = (double)(long long)(first_ready - last_end);
                sum += d;
                lo = d < lo ? d : lo;
                n++;
            }
            printf("  A spins %d ns, B waits by %-4s: mean %6.0f  min %6.0f\n", spins[si], use_flag ? "flag" : "PDL",
                   sum / n, lo);
        }
    }
    return 0;
}
