/* Status codes and error messages (see include/dflash/status.h). */
#include "dflash/status.h"

#include <stdio.h>
#include <string.h>

df_status df_error_set(df_error *err, df_status code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

df_status df_error_prefix(df_error *err, const char *fmt, ...) {
    if (!err) return DF_ERR_INTERNAL;
    char prefix[DF_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    char old[DF_ERROR_MSG_MAX];
    memcpy(old, err->msg, sizeof old);
    size_t np = strlen(prefix);
    if (np > sizeof err->msg - 3) np = sizeof err->msg - 3;
    memcpy(err->msg, prefix, np);
    memcpy(err->msg + np, ": ", 2);
    size_t room = sizeof err->msg - np - 3, no = strnlen(old, sizeof old);
    if (no > room) no = room;
    memcpy(err->msg + np + 2, old, no);
    err->msg[np + 2 + no] = 0;
    return err->code;
}

const char *df_status_name(df_status s) {
    switch (s) {
    case DF_OK: return "ok";
    case DF_ERR_IO: return "io";
    case DF_ERR_FORMAT: return "format";
    case DF_ERR_MODEL: return "model";
    case DF_ERR_INVALID_ARG: return "invalid_argument";
    case DF_ERR_NOMEM: return "out_of_memory";
    case DF_ERR_UNSUPPORTED: return "unsupported";
    case DF_ERR_RANGE: return "range";
    case DF_ERR_CANCELLED: return "cancelled";
    case DF_ERR_INTERNAL: return "internal";
    case DF_ERR_NUMERIC: return "numeric";
    }
    return "unknown";
}
