/* A fixed-size pthread pool with a blocking parallel-for.
 *
 * Determinism: a parallel-for hands out whole tasks; each task computes a disjoint set of
 * output elements with the same arithmetic whichever thread runs it, so results never
 * depend on the number of threads (ENGINEERING.md, exactness rules).
 */
#ifndef DFLASH_CORE_THREADS_H
#define DFLASH_CORE_THREADS_H

#include "dflash/status.h"

typedef struct df_pool df_pool;

/* Body of a parallel-for: runs task index `task` of `n_tasks` on worker `worker`
 * (0 = the calling thread, < df_pool_size) — for per-worker scratch, never for results. */
typedef void (*df_task_fn)(void *ctx, int task, int n_tasks, int worker);

/* Starts a pool of n_threads (>= 1; the caller thread counts as one, so n_threads-1 workers
 * are created). Errors: DF_ERR_NOMEM, DF_ERR_INTERNAL (pthread failure). */
df_status df_pool_init(df_pool **out, int n_threads, df_error *err);
void df_pool_free(df_pool *pool);
int df_pool_size(const df_pool *pool);

/* Runs fn(ctx, t, n_tasks, worker) for t = 0..n_tasks-1 on the pool and returns when all are done.
 * Not reentrant: one parallel-for at a time per pool (tasks must not call it). */
void df_pool_run(df_pool *pool, int n_tasks, df_task_fn fn, void *ctx);

/* Number of online CPUs (>= 1). */
int df_cpu_count(void);

/* Monotonic wall clock in milliseconds. */
double df_now_ms(void);

#endif
