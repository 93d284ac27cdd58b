/* di-generate: offline generation with the V4.1 forward pass on the CPU (see --help). */
#include <stdio.h>
#include <unistd.h>

#include "common/util/outclose.h"
#include "tools/generate/gen.h"

int main(int argc, char **argv)
{
    gen_args a;
    gen_args_default(&a);
    di_error err = {0};
    di_status st = gen_args_parse(argc, argv, &a, &err);
    if (st == DI_ECANCELED) {
        gen_args_free(&a);
        return di_close_stdout("di-generate", 0); /* --help */
    }
    if (st == DI_OK && a.n_prompts == 0 && !isatty(STDIN_FILENO))
        st = gen_read_prompts("-", &a, &err);
    if (st == DI_OK)
        st = gen_run(&a, &err);
    gen_args_free(&a);
    if (st != DI_OK) {
        fprintf(stderr, "di-generate: %s\n", err.msg[0] ? err.msg : di_status_str(st));
        return di_close_stdout("di-generate", st == DI_EINVAL ? 2 : 1);
    }
    return di_close_stdout("di-generate", 0);
}
