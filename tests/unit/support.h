/* Helpers shared by the unit tests (cmocka). */
#ifndef DFLASH_TEST_SUPPORT_H
#define DFLASH_TEST_SUPPORT_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

/* Path of a fixture under $DFLASH_FIXTURES (the build tree's copy of tests/fixtures),
 * in a static buffer (valid until the next call). */
const char *tu_fixture(const char *rel);
/* Reads a whole file (malloc'd, NUL-terminated); NULL on failure. */
char *tu_read_file(const char *path, size_t *len);
/* Writes len bytes to path; 0 on success. */
int tu_write_file(const char *path, const void *data, size_t len);
/* A fresh temporary directory (static buffer). */
const char *tu_tmpdir(void);

struct df_sampling_params;
/* Sampling case i (0..3) of the tests that compare sampled decoding paths: temperature 1.5 or
 * 0.7, top-k 20 or 64, top-p 0.8 in case 1, min-p 0.05 in case 3, seed seed0 + i. */
void tu_sampling_case(struct df_sampling_params *p, int i, unsigned seed0);

#endif
