/* Thread pool (see threads.h). Workers sleep on a condition variable between jobs and
 * claim tasks from an atomic counter. */
#include "core/threads.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

struct df_pool {
    int n_threads;
    pthread_t *workers;
    struct worker_arg *args;
    pthread_mutex_t mu;
    pthread_cond_t cv_start, cv_done;
    unsigned long generation;   /* bumped for each job */
    int stop;
    /* the current job */
    df_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next_task;
    int active;                 /* workers still in the current job */
};

static void run_tasks(df_pool *p, int worker) {
    for (;;) {
        int t = atomic_fetch_add(&p->next_task, 1);
        if (t >= p->n_tasks) break;
        p->fn(p->ctx, t, p->n_tasks, worker);
    }
}

typedef struct worker_arg {
    df_pool *pool;
    int index;
} worker_arg;

static void *worker_main(void *arg) {
    worker_arg *wa = arg;
    df_pool *p = wa->pool;
    const int index = wa->index;
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->cv_start, &p->mu);
        if (p->stop) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        run_tasks(p, index);
        pthread_mutex_lock(&p->mu);
        if (--p->active == 0) pthread_cond_signal(&p->cv_done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

df_status df_pool_init(df_pool **out, int n_threads, df_error *err) {
    *out = NULL;
    if (n_threads < 1) n_threads = 1;
    df_pool *p = calloc(1, sizeof *p);
    if (!p) return df_error_set(err, DF_ERR_NOMEM, "thread pool: out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_start, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    atomic_init(&p->next_task, 0);
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        p->args = calloc((size_t)n_threads - 1, sizeof *p->args);
        if (!p->workers || !p->args) {
            df_pool_free(p);
            return df_error_set(err, DF_ERR_NOMEM, "thread pool: out of memory");
        }
        for (int i = 0; i < n_threads - 1; i++) {
            p->args[i].pool = p;
            p->args[i].index = i + 1;
            if (pthread_create(&p->workers[i], NULL, worker_main, &p->args[i]) != 0) {
                p->n_threads = i + 1; /* only i workers exist */
                df_pool_free(p);
                return df_error_set(err, DF_ERR_INTERNAL, "thread pool: cannot start thread %d", i);
            }
        }
    }
    *out = p;
    return DF_OK;
}

void df_pool_free(df_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; p->workers && i < p->n_threads - 1; i++) pthread_join(p->workers[i], NULL);
    free(p->workers);
    free(p->args);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_start);
    pthread_cond_destroy(&p->cv_done);
    free(p);
}

int df_pool_size(const df_pool *p) { return p ? p->n_threads : 1; }

void df_pool_run(df_pool *p, int n_tasks, df_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, n_tasks, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next_task, 0);
    p->active = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    run_tasks(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->active > 0) pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

int df_cpu_count(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (int)n;
}

double df_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}
