/* Unit tests: status codes and messages. */
#include "support.h"

#include <string.h>

#include "dflash/status.h"

static void test_set_and_prefix(void **state) {
    (void)state;
    df_error err = {0};
    assert_int_equal(df_error_set(&err, DF_ERR_FORMAT, "tensor %s: bad", "x"), DF_ERR_FORMAT);
    assert_string_equal(err.msg, "tensor x: bad");
    df_error_prefix(&err, "file %s", "a.safetensors");
    assert_string_equal(err.msg, "file a.safetensors: tensor x: bad");
    assert_string_equal(df_status_name(DF_ERR_MODEL), "model");
}

static void test_truncation(void **state) {
    (void)state;
    df_error err = {0};
    char big[2000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    df_error_set(&err, DF_ERR_IO, "%s", big);
    assert_int_equal(strlen(err.msg), DF_ERROR_MSG_MAX - 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_set_and_prefix),
        cmocka_unit_test(test_truncation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
