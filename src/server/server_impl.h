/* dflash server: state shared by the API layer (server.c) and the HTTP transport (http.c).
 * Private to src/server. */
#ifndef DFLASH_SERVER_IMPL_H
#define DFLASH_SERVER_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "dflash/server.h"

#define DF_SERVER_MAX_PRIVATE 4

struct df_server {
    df_engine *eng;
    df_session *session;          /* the one session, used under gen_lock */
    pthread_mutex_t gen_lock;
    df_server_options opt;        /* string fields point at the copies below */
    char *host, *model_id, *api_key;
    /* Local paths and the public names that replace them in logs and responses,
     * longest path first. */
    char *private_paths[DF_SERVER_MAX_PRIVATE];
    const char *public_names[DF_SERVER_MAX_PRIVATE];
    int n_private;
    atomic_int stopping;          /* set by df_server_stop: cancels generation */
    atomic_int in_flight;         /* requests begun and not yet answered (http.c) */
    atomic_uint_fast64_t id_counter;
    uint64_t id_seed;
    time_t created;
    void *daemon;                 /* struct MHD_Daemon * while listening */
    int bound_port;
};

/* Formats a log line, replaces local paths, and hands it to the log callback. */
void df_server_log(const df_server *srv, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Copies in to out (capacity cap, always NUL-terminated) with every private path replaced
 * by its public name. */
void df_server_redact(const df_server *srv, const char *in, char *out, size_t cap);

#endif
