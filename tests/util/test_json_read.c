#include <criterion/criterion.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
#include <string.h>

#include "common/util/json_read.h"

static json_t *parse(const char *s)
{
    json_t *j = NULL;
    di_error e;
    cr_assert_eq(di_json_parse(s, strlen(s), "test", &j, &e), DI_OK, "%s", e.msg);
    return j;
}

Test(json_read, typed_reads_and_clear_errors)
{
    json_t *j = parse("{\"n\": 3, \"x\": 2.5, \"b\": true, \"s\": \"hi\", \"a\": [1,2,3],"
                      " \"bad\": [1, \"x\"], \"z\": null}");
    di_error e;
    int64_t n = -1;
    cr_assert_eq(di_json_int(j, "n", &n, &e), DI_OK);
    cr_assert_eq(n, 3);
    double x = 0;
    cr_assert_eq(di_json_num(j, "x", &x, &e), DI_OK);
    cr_assert_float_eq(x, 2.5, 1e-12);
    cr_assert_eq(di_json_int(j, "x", &n, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "'x'") != NULL, "%s", e.msg);
    cr_assert_eq(n, 3, "output must be untouched on failure");
    cr_assert_eq(di_json_int(j, "missing", &n, &e), DI_EINVAL);
    cr_assert_str_eq(e.msg, "missing key 'missing'");
    n = 99;
    cr_assert_eq(di_json_int_opt(j, "z", &n, &e), DI_OK);
    cr_assert_eq(n, 99);
    cr_assert_eq(di_json_int_range(j, "n", 4, 10, &n, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "outside [4, 10]") != NULL, "%s", e.msg);
    const char *s = NULL;
    cr_assert_eq(di_json_str(j, "s", &s, &e), DI_OK);
    cr_assert_str_eq(s, "hi");
    cr_assert_eq(di_json_str(j, "n", &s, &e), DI_EINVAL);
    cr_assert_str_eq(e.msg, "key 'n': expected a string, got integer");
    int64_t *arr = NULL;
    size_t len = 0;
    cr_assert_eq(di_json_int_array(j, "a", &arr, &len, &e), DI_OK);
    cr_assert_eq(len, 3);
    cr_assert_eq(arr[2], 3);
    free(arr);
    cr_assert_eq(di_json_int_array(j, "bad", &arr, &len, &e), DI_EINVAL);
    cr_assert_str_eq(e.msg, "key 'bad'[1]: expected an integer, got string");
    json_decref(j);
}

Test(json_read, parse_errors_name_the_place)
{
    json_t *j = NULL;
    di_error e;
    cr_assert_eq(di_json_parse("{\"a\": }", 7, "input", &j, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "line 1") != NULL, "%s", e.msg);
    cr_assert_null(j);
    cr_assert_eq(di_json_parse("{\"a\":1,\"a\":2}", 13, "input", &j, &e), DI_EINVAL);
    cr_assert_eq(di_json_load_file("/nonexistent/file.json", &j, &e), DI_ENOENT);
}

/* A path that is not a regular file (a FIFO nobody writes, a device) is refused at once
 * rather than read: a FIFO would block forever. */
Test(json_read, special_files_are_refused, .timeout = 10)
{
    char dir[] = "/tmp/di_json_fifo_XXXXXX", fifo[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(fifo, sizeof fifo, "%s/x.json", dir);
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    json_t *j = NULL;
    di_error e;
    cr_assert_eq(di_json_load_file(fifo, &j, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "not a regular file"), "%s", e.msg);
    cr_assert_eq(di_json_load_file("/dev/zero", &j, &e), DI_EINVAL);
    cr_assert_null(j);
    unlink(fifo);
    rmdir(dir);
}
