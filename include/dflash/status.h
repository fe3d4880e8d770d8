/* dflash: status codes and error messages.
 *
 * Every library function that can fail returns a df_status and, when it fails, fills a
 * caller-owned df_error with a human-readable message naming what is wrong and where
 * (file, tensor, field, position). Library code never prints and never exits.
 */
#ifndef DFLASH_STATUS_H
#define DFLASH_STATUS_H

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum df_status {
    DF_OK = 0,
    DF_ERR_IO,          /* a file could not be opened, read or mapped */
    DF_ERR_FORMAT,      /* a file's content is malformed (header, JSON, offsets, dtype) */
    DF_ERR_MODEL,       /* a pack does not match its architecture (tensor missing/wrong/unexpected) */
    DF_ERR_INVALID_ARG, /* a caller passed an invalid value (request field, option, token id) */
    DF_ERR_NOMEM,       /* an allocation failed */
    DF_ERR_UNSUPPORTED, /* a valid but unsupported feature (e.g. a quantization mode) */
    DF_ERR_RANGE,       /* a size limit was exceeded (context length, request size) */
    DF_ERR_CANCELLED,   /* the caller asked to stop */
    DF_ERR_INTERNAL,    /* a bug: an invariant did not hold */
    DF_ERR_NUMERIC      /* the model computed non-finite values (NaN or infinite logits) */
} df_status;

#define DF_ERROR_MSG_MAX 512

/* A status with its message. Zero-initialise before use: `df_error err = {0};`. */
typedef struct df_error {
    df_status code;
    char msg[DF_ERROR_MSG_MAX];
} df_error;

/* Sets err (if non-NULL) to code with a printf-style message and returns code.
 * The message is truncated to DF_ERROR_MSG_MAX-1 bytes. */
df_status df_error_set(df_error *err, df_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prepends "prefix: " to an already-set message (for adding context such as a file name). */
df_status df_error_prefix(df_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A short constant name for a status ("io", "format", ...). */
const char *df_status_name(df_status s);

#ifdef __cplusplus
}
#endif
#endif
