/* Helpers shared by the unit tests. */
#include "support.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *tu_fixture(const char *rel) {
    static char buf[4096];
    const char *base = getenv("DFLASH_FIXTURES");
    if (!base) base = "tests/fixtures";
    snprintf(buf, sizeof buf, "%s/%s", base, rel);
    return buf;
}

char *tu_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)n + 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) {
        p[n] = 0;
        if (len) *len = (size_t)n;
    }
    return p;
}

int tu_write_file(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, len, f);
    return (fclose(f) == 0 && w == len) ? 0 : -1;
}

const char *tu_tmpdir(void) {
    static char buf[256];
    snprintf(buf, sizeof buf, "/tmp/dflash-test-XXXXXX");
    if (!mkdtemp(buf)) return "/tmp";
    return buf;
}
