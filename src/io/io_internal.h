/* Helpers shared by the files of src/io (not part of the public API). */
#ifndef DFLASH_IO_INTERNAL_H
#define DFLASH_IO_INTERNAL_H

#include <jansson.h>
#include <stddef.h>

#include "dflash/pack.h"
#include "dflash/status.h"

/* "dir/name" (malloc'd; NULL when out of memory). */
char *df_path_join(const char *dir, const char *name);

/* Reads a whole text file (at most max_bytes) into a malloc'd NUL-terminated buffer.
 * Errors: DF_ERR_IO naming path (missing, unreadable, too large), DF_ERR_NOMEM. */
df_status df_read_text_file(const char *path, size_t max_bytes, char **out, df_error *err);
/* The most bytes of a pack's JSON files (config.json, generation_config.json). */
#define DF_CONFIG_MAX_BYTES ((size_t)64 << 20)

/* df_text_config_parse on an already parsed config.json root. */
df_status df_text_config_parse_json(df_text_config *cfg, json_t *root, df_error *err);

#endif
