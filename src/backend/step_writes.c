/* dflash: a step's table of the state buffers its kernels write (see step_writes.h). */
#include "backend/step_writes.h"

#include <limits.h>
#include <stdint.h>
#include <string.h>

void df_step_writes_init(df_step_writes *t) {
    memset(t, 0, sizeof *t);
    t->gen = 1; /* no zeroed slot is current */
}

void df_step_writes_reset(df_step_writes *t) {
    t->n = 0;
    t->full = 0;
    if (++t->gen == 0) /* wrapped: no slot may look current */
        df_step_writes_init(t);
}

/* The index of p's slot: p's own, or the free slot where it would go; -1 when the table is full. */
static int slot_of(const df_step_writes *t, const void *p) {
    size_t h = (size_t)(((uintptr_t)p >> 6) * 0x9e3779b97f4a7c15ULL) & (DF_STEP_WRITES_SLOTS - 1);
    for (int k = 0; k < DF_STEP_WRITES_SLOTS; k++, h = (h + 1) & (DF_STEP_WRITES_SLOTS - 1))
        if (t->slot[h].gen != t->gen || t->slot[h].p == p) return (int)h;
    return -1;
}

void df_step_writes_note(df_step_writes *t, const void *p, int row) {
    const int i = slot_of(t, p);
    if (i >= 0 && t->slot[i].gen == t->gen) { /* noted before: the lower row counts */
        if (row < t->slot[i].row) t->slot[i].row = row;
        return;
    }
    if (i < 0 || t->n >= DF_STEP_WRITES_SLOTS / 2) { /* kept half empty: probes stay short */
        t->full = 1;
        return;
    }
    t->slot[i].gen = t->gen;
    t->slot[i].p = p;
    t->slot[i].row = row;
    t->n++;
}

int df_step_writes_first(const df_step_writes *t, const void *p) {
    if (t->full) return 0;
    const int i = slot_of(t, p);
    if (i < 0) return 0;
    return t->slot[i].gen == t->gen ? t->slot[i].row : INT_MAX;
}
