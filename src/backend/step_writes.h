/* dflash: a step's table of the state buffers its kernels write, and from which row.
 *
 * A backend that lets a kernel start before the previous one has finished (CUDA's programmatic
 * dependent launch) may have it read, before it waits, only data that no kernel since the last
 * host synchronization wrote. The backend notes each recorded kernel's writes to state buffers
 * (GDN states, KV caches) here and asks before letting a kernel read early. Open addressing on
 * the buffer's address; a generation number resets the table in O(1) at each step's end.
 */
#ifndef DFLASH_STEP_WRITES_H
#define DFLASH_STEP_WRITES_H

#define DF_STEP_WRITES_SLOTS 2048 /* a power of two; at most half of them are used */

typedef struct df_step_writes {
    struct {
        const void *p;
        int row;
        unsigned gen; /* the slot holds p when gen is the table's */
    } slot[DF_STEP_WRITES_SLOTS];
    unsigned gen;
    int n;    /* buffers noted in this step */
    int full; /* a buffer could not be noted: every answer is "written from row 0" */
} df_step_writes;

/* An empty table (t: any memory). */
void df_step_writes_init(df_step_writes *t);

/* Empties the table (at a step's end: every kernel recorded so far has finished). */
void df_step_writes_reset(df_step_writes *t);

/* Notes that a kernel recorded in this step writes buffer p from row `row` on (0: all of it). */
void df_step_writes_note(df_step_writes *t, const void *p, int row);

/* The first row of buffer p that a kernel recorded in this step writes: INT_MAX when none does,
 * 0 when the step's writes are not all known (the table overflowed). */
int df_step_writes_first(const df_step_writes *t, const void *p);

#endif
