/* The table of a step's state-buffer writes (src/backend/step_writes.h): what a backend asks
 * before letting a kernel read a buffer ahead of its wait for the previous kernel. A wrong
 * answer would let a kernel read a stale buffer, so the table must never forget a write of the
 * current step, and must say "written from row 0" when it cannot know. */
#include "support.h"

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>

#include "backend/step_writes.h"

static df_step_writes *new_table(void) {
    df_step_writes *t = malloc(sizeof *t);
    assert_non_null(t);
    df_step_writes_init(t);
    return t;
}

/* a buffer address: i-th of a run spaced by `stride` bytes */
static const void *buf(size_t i, size_t stride) { return (const void *)(uintptr_t)(0x7f0000000000ULL + i * stride); }

static void test_rows(void **state) {
    (void)state;
    df_step_writes *t = new_table();
    const void *a = buf(1, 4096), *b = buf(2, 4096);
    assert_int_equal(df_step_writes_first(t, a), INT_MAX); /* nothing written */
    df_step_writes_note(t, a, 600);
    assert_int_equal(df_step_writes_first(t, a), 600);
    assert_int_equal(df_step_writes_first(t, b), INT_MAX);
    df_step_writes_note(t, a, 616); /* a later, higher write: the first row stays */
    assert_int_equal(df_step_writes_first(t, a), 600);
    df_step_writes_note(t, a, 37);  /* a lower one: it counts */
    assert_int_equal(df_step_writes_first(t, a), 37);
    df_step_writes_note(t, b, 0);
    assert_int_equal(df_step_writes_first(t, b), 0);
    df_step_writes_reset(t); /* the step ran: nothing of it is pending */
    assert_int_equal(df_step_writes_first(t, a), INT_MAX);
    assert_int_equal(df_step_writes_first(t, b), INT_MAX);
    df_step_writes_note(t, b, 5);
    assert_int_equal(df_step_writes_first(t, b), 5);
    free(t);
}

/* Buffers that share hash slots (addresses alike in their low bits, spaced by large powers of
 * two; some addresses recur under two spacings) are all kept apart, over several steps: each
 * answer is the lowest row noted for that address (a linear search of the notes is the
 * reference). */
static void test_collisions(void **state) {
    (void)state;
    df_step_writes *t = new_table();
    const size_t strides[] = {(size_t)1 << 6, (size_t)1 << 20, (size_t)1 << 30, 48 * 4096};
    enum { NS = 4, NB = 200 };
    const void *addr[NS * NB];
    int row[NS * NB];
    for (int step = 0; step < 3; step++) {
        int n = 0;
        for (size_t s = 0; s < NS; s++)
            for (size_t i = 0; i < NB; i++) {
                addr[n] = buf(i, strides[s]);
                row[n] = (int)((i * 7 + s * 13 + (size_t)step) % 97);
                df_step_writes_note(t, addr[n], row[n]);
                n++;
            }
        for (int k = 0; k < n; k++) {
            int want = INT_MAX;
            for (int m = 0; m < n; m++)
                if (addr[m] == addr[k] && row[m] < want) want = row[m];
            const int got = df_step_writes_first(t, addr[k]);
            if (got != want) fail_msg("step %d, note %d: first row %d, want %d", step, k, got, want);
        }
        assert_int_equal(df_step_writes_first(t, buf(12345, 8)), INT_MAX);
        df_step_writes_reset(t);
        assert_int_equal(df_step_writes_first(t, buf(3, strides[1])), INT_MAX);
    }
    free(t);
}

/* More buffers than the table keeps: from then on every answer is "written from row 0" (no
 * early reads) until the step ends; the next step starts empty. */
static void test_overflow(void **state) {
    (void)state;
    df_step_writes *t = new_table();
    const int n = DF_STEP_WRITES_SLOTS; /* twice what it keeps */
    for (int i = 0; i < n; i++) df_step_writes_note(t, buf((size_t)i, 256), 100);
    assert_true(t->full);
    assert_int_equal(df_step_writes_first(t, buf(0, 256)), 0);
    assert_int_equal(df_step_writes_first(t, buf(99999, 256)), 0); /* never noted, but unknown */
    df_step_writes_reset(t);
    assert_false(t->full);
    assert_int_equal(df_step_writes_first(t, buf(0, 256)), INT_MAX);
    free(t);
}

/* The generation counter wraps: slots of old steps never look current. */
static void test_generation_wrap(void **state) {
    (void)state;
    df_step_writes *t = new_table();
    t->gen = UINT_MAX;
    df_step_writes_note(t, buf(7, 64), 3);
    assert_int_equal(df_step_writes_first(t, buf(7, 64)), 3);
    df_step_writes_reset(t); /* gen wraps to 0: the table starts over */
    assert_true(t->gen != 0);
    assert_int_equal(df_step_writes_first(t, buf(7, 64)), INT_MAX);
    df_step_writes_note(t, buf(7, 64), 9);
    assert_int_equal(df_step_writes_first(t, buf(7, 64)), 9);
    free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows),
        cmocka_unit_test(test_collisions),
        cmocka_unit_test(test_overflow),
        cmocka_unit_test(test_generation_wrap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
