#include <criterion/criterion.h>
#include <string.h>

#include "common/util/status.h"

Test(status, names_messages_and_mappings)
{
    cr_assert_str_eq(di_status_name(DI_EINVAL), "EINVAL");
    cr_assert_str_eq(di_status_str(DI_OK), "ok");
    cr_assert_eq(di_status_grpc(DI_ETIMEDOUT), 4);
    cr_assert_eq(di_status_grpc(DI_ECORRUPT), 15);
    cr_assert_eq(di_status_http(DI_ENOENT), 404);
    cr_assert_str_eq(di_status_str((di_status)-999), "unknown status");
}

Test(status, fail_formats_and_strips_newlines)
{
    di_error e;
    di_error_clear(&e);
    di_status st = di_fail(&e, DI_EINVAL, "top_p %g outside (0, 1]\nnext line", 1.5);
    cr_assert_eq(st, DI_EINVAL);
    cr_assert_eq(e.code, DI_EINVAL);
    cr_assert_null(strchr(e.msg, '\n'));
    cr_assert_str_eq(e.msg, "top_p 1.5 outside (0, 1] next line");
    di_error_prefix(&e, "request %d: ", 7);
    cr_assert_str_eq(e.msg, "request 7: top_p 1.5 outside (0, 1] next line");
    cr_assert_eq(di_fail(NULL, DI_ENOMEM, "x"), DI_ENOMEM);
}

Test(status, long_messages_truncate_safely)
{
    di_error e;
    char big[2000];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = 0;
    di_fail(&e, DI_EIO, "%s", big);
    cr_assert_eq(strlen(e.msg), sizeof(e.msg) - 1);
    di_error_prefix(&e, "ctx: ");
    cr_assert_eq(strlen(e.msg), sizeof(e.msg) - 1);
    cr_assert(strncmp(e.msg, "ctx: ", 5) == 0);
}
