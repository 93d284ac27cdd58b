/* The shared checks of operator input: HOST:PORT parsing, sizes against this machine, and the
 * exit status of a binary whose output could not be written. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util/hostport.h"
#include "common/util/machine.h"
#include "common/util/outclose.h"

Test(hostport, good_addresses)
{
    di_hostport hp;
    di_error e;
    cr_assert_eq(di_hostport_parse("127.0.0.1:9470", false, &hp, &e), DI_OK, "%s", e.msg);
    cr_assert_str_eq(hp.host, "127.0.0.1");
    cr_assert_eq(hp.port, 9470);
    cr_assert(di_hostport_is_loopback(&hp));
    cr_assert_eq(di_hostport_parse("[::1]:65535", false, &hp, &e), DI_OK, "%s", e.msg);
    cr_assert_str_eq(hp.host, "[::1]");
    cr_assert_eq(hp.port, 65535);
    cr_assert(di_hostport_is_loopback(&hp));
    cr_assert_eq(di_hostport_parse("store-1.example.com:1", false, &hp, &e), DI_OK);
    cr_assert_eq(hp.port, 1);
    cr_assert_not(di_hostport_is_loopback(&hp));
    cr_assert_eq(di_hostport_parse("0.0.0.0:0", true, &hp, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(hp.port, 0);
    cr_assert_eq(di_hostport_parse("localhost:80", false, NULL, &e), DI_OK);
}

Test(hostport, junk_and_ports_out_of_range)
{
    static const struct {
        const char *in;
        bool zero;
        const char *why;
    } bad[] = {
        {"127.0.0.1:99999", true, "outside 0..65535"},
        {"127.0.0.1:65536", false, "outside 1..65535"},
        {"127.0.0.1:0", false, "outside 1..65535"},
        {"127.0.0.1", false, "no port"},
        {"127.0.0.1:", false, "no port"},
        {":9470", false, "no host"},
        {"", false, "empty"},
        {"127.0.0.1:80x", false, "not a number"},
        {"127.0.0.1:-1", false, "not a number"},
        {"127.0.0.1: 80", false, "not a number"},
        {"127.0.0.1:+80", false, "not a number"},
        {"::1:9470", false, "brackets"},
        {"[::1:9470", false, "[ADDR]:PORT"},
        {"[]:9470", false, "[ADDR]:PORT"},
        {"dns:///host:9470", false, "bad character"},
        {"ho st:9470", false, "bad character"},
        {"-host:9470", false, "cannot start"},
        {"127.0.0.1:184467440737095516170", false, "outside"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        di_hostport hp = {.host = "unchanged", .port = 7};
        di_error e;
        cr_assert_eq(di_hostport_parse(bad[i].in, bad[i].zero, &hp, &e), DI_EINVAL, "%s",
                     bad[i].in);
        cr_assert(strstr(e.msg, bad[i].why), "%s: %s", bad[i].in, e.msg);
        cr_assert(!strchr(e.msg, '\n'), "one line: %s", e.msg);
        cr_assert_str_eq(hp.host, "unchanged", "output untouched on failure");
        cr_assert_eq(hp.port, 7);
    }
    char longhost[400];
    memset(longhost, 'a', 300);
    strcpy(longhost + 300, ":80");
    di_error e;
    cr_assert_eq(di_hostport_parse(longhost, false, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "at most 253"), "%s", e.msg);
}

Test(machine, memory_and_disk_limits)
{
    uint64_t mem = di_machine_memory_bytes();
    cr_assert_gt(mem, 1u << 20, "physical memory %llu", (unsigned long long)mem);
    di_error e;
    cr_assert_eq(di_machine_check_memory("--x", mem / 2, &e), DI_OK);
    cr_assert_eq(di_machine_check_memory("--x", mem + 1, &e), DI_ERANGE);
    cr_assert(strstr(e.msg, "--x") && strstr(e.msg, "physical memory"), "%s", e.msg);
    cr_assert_eq(di_machine_check_memory("--x", 1ull << 60, &e), DI_ERANGE);
    cr_assert(strstr(e.msg, "1.00 EiB"), "%s", e.msg);

    char dir[] = "/tmp/di-machine-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    uint64_t free_here = 0, free_below = 0;
    cr_assert_eq(di_machine_free_bytes(dir, &free_here, &e), DI_OK, "%s", e.msg);
    cr_assert_gt(free_here, 0);
    char missing[128];
    snprintf(missing, sizeof(missing), "%s/not/yet/there", dir);
    /* A path not created yet is judged by its nearest existing parent. */
    cr_assert_eq(di_machine_free_bytes(missing, &free_below, &e), DI_OK, "%s", e.msg);
    cr_assert_gt(free_below, 0);
    cr_assert_eq(di_machine_check_disk("--out", missing, 4096, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(di_machine_check_disk("--out", missing, 1ull << 62, &e), DI_ENOSPC);
    cr_assert(strstr(e.msg, "--out") && strstr(e.msg, "free where") && strstr(e.msg, missing),
              "%s", e.msg);
    cr_assert_eq(di_machine_free_bytes("", &free_here, &e), DI_EINVAL);
    rmdir(dir);

    char buf[32];
    di_machine_format_bytes(512, buf, sizeof(buf));
    cr_assert_str_eq(buf, "512 B");
    di_machine_format_bytes(3ull << 29, buf, sizeof(buf));
    cr_assert_str_eq(buf, "1.50 GiB");
}

/* Runs di_close_stdout in a child whose stdout is `path` after printing `text`; returns the
 * exit status, its stderr in err. */
static int close_in_child(const char *path, const char *text, int rc, char *err, size_t cap)
{
    char errpath[] = "/tmp/di-outclose-XXXXXX";
    int efd = mkstemp(errpath);
    cr_assert_geq(efd, 0);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int fd = open(path, O_WRONLY);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(efd, 2) < 0)
            _exit(99);
        fputs(text, stdout);
        _exit(di_close_stdout("prog", rc));
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    ssize_t n = pread(efd, err, cap - 1, 0);
    err[n > 0 ? n : 0] = '\0';
    close(efd);
    unlink(errpath);
    cr_assert(WIFEXITED(status));
    return WEXITSTATUS(status);
}

Test(outclose, lost_output_is_a_failure)
{
    char err[512];
    cr_assert_eq(close_in_child("/dev/null", "fine\n", 0, err, sizeof(err)), 0);
    cr_assert_str_empty(err);
    cr_assert_eq(close_in_child("/dev/null", "fine\n", 3, err, sizeof(err)), 3);
    cr_assert_eq(close_in_child("/dev/full", "lost\n", 0, err, sizeof(err)), 1);
    cr_assert_str_eq(err, "prog: cannot write the output: No space left on device\n");
    /* An earlier failure keeps the status the program chose. */
    cr_assert_eq(close_in_child("/dev/full", "lost\n", 2, err, sizeof(err)), 2);
    cr_assert(strstr(err, "cannot write the output"), "%s", err);
    /* Output large enough to fail in an earlier write, before the close. */
    static char big[1 << 16];
    memset(big, 'x', sizeof(big) - 1);
    cr_assert_eq(close_in_child("/dev/full", big, 0, err, sizeof(err)), 1);
    cr_assert(strncmp(err, "prog: cannot write the output", 29) == 0, "%s", err);
}
