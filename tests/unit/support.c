/* Helpers shared by the unit tests. */
#include "support.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dflash/generate.h"

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

void tu_sampling_case(df_sampling_params *p, int i, unsigned seed0) {
    p->temperature = i % 2 ? 0.7f : 1.5f;
    p->top_k = i < 2 ? 20 : 64;
    p->top_p = i == 1 ? 0.8f : 1.0f;
    p->min_p = i == 3 ? 0.05f : 0.0f;
    p->seed = seed0 + (unsigned)i;
    p->has_seed = 1;
}
