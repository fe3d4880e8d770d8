/* Opening the files of a pack (and other files the engine reads whole) without the hazards of
 * special files: a FIFO, a device or a folder gets a clear error instead of a read that blocks
 * forever or fails obscurely. */
#ifndef DFLASH_CORE_FILES_H
#define DFLASH_CORE_FILES_H

#include <stdio.h>

#include "dflash/status.h"

/* Opens `path` for binary reading if it is a regular file. The open itself never blocks (it is
 * made non-blocking, and blocking again once the file is known to be regular). Returns the
 * stream, or NULL with err set: DF_ERR_IO "PATH: cannot open: REASON", "PATH: is a folder, not a file" or
 * "PATH: not a regular file". */
FILE *df_fopen_regular(const char *path, df_error *err);

/* 1 when something is at path: a file of any kind, or a symbolic link even one that leads
 * nowhere or in a loop (lstat), so that a broken optional file is reported when it is opened
 * rather than taken for an absent one; 0 when nothing is there. */
int df_path_present(const char *path);

/* As df_fopen_regular, the file descriptor (O_RDONLY | O_CLOEXEC, blocking), or -1 with err
 * set. */
int df_open_regular(const char *path, df_error *err);

#endif
