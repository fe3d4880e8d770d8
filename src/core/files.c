/* See files.h. */
#include "core/files.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int df_open_regular(const char *path, df_error *err) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        df_error_set(err, DF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    struct stat sb;
    const char *why = NULL;
    if (fstat(fd, &sb) != 0) why = strerror(errno);
    else if (S_ISDIR(sb.st_mode)) why = "is a folder, not a file";
    else if (!S_ISREG(sb.st_mode)) why = "not a regular file";
    if (!why) {
        const int fl = fcntl(fd, F_GETFL);
        if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) why = strerror(errno);
    }
    if (why) {
        close(fd);
        df_error_set(err, DF_ERR_IO, "%s: %s", path, why);
        return -1;
    }
    return fd;
}

int df_path_present(const char *path) {
    struct stat sb;
    return lstat(path, &sb) == 0;
}

FILE *df_fopen_regular(const char *path, df_error *err) {
    const int fd = df_open_regular(path, err);
    if (fd < 0) return NULL;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        df_error_set(err, DF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        close(fd);
    }
    return f;
}
