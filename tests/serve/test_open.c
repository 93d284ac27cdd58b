/* Backends by name and the one call that opens model, tokenizer and Engram map. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/serve/backend.h"
#include "common/serve/model_open.h"

Test(serve_backend, names_are_checked_and_cpu_opens_and_closes)
{
    di_error err;
    cr_assert_eq(serve_backend_check("cpu", &err), DI_OK);
    cr_assert_eq(serve_backend_check("tpu", &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "'tpu' is not cpu or cuda"), "%s", err.msg);
    cr_assert_eq(serve_backend_check(NULL, &err), DI_EINVAL);
    kern_backend be;
    memset(&be, 0x5a, sizeof be);
    cr_assert_eq(serve_backend_open("gpu", NULL, &be, &err), DI_EINVAL);
    serve_backend_options o = {.threads = 1};
    cr_assert_eq(serve_backend_open("cpu", &o, &be, &err), DI_OK, "%s", err.msg);
    cr_assert_str_eq(be.name, "cpu");
    serve_backend_close(&be);
    cr_assert_null(be.name, "closed and zeroed");
    serve_backend_close(&be);  /* again: a zeroed struct */
    serve_backend_close(NULL);
}

/* "cuda" is known everywhere; a build without it says so, one with it opens or fails with the
 * driver's reason (no GPU on CI), never crashes. */
Test(serve_backend, cuda_is_refused_or_opened_cleanly)
{
    di_error err;
    kern_backend be = {0};
    serve_backend_options o = {.threads = 1, .device = 63};
    di_status st = serve_backend_open("cuda", &o, &be, &err);
    if (st == DI_EUNSUPPORTED)
        cr_assert(strstr(err.msg, "no CUDA backend"), "%s", err.msg);
    else
        cr_assert_neq(st, DI_OK, "device 63 does not exist");
    serve_backend_close(&be);
}

Test(serve_model, random_weights_open_without_a_tokenizer, .timeout = 60)
{
    serve_model_options o = {.config = "tiny", .weights_seed = 3};
    serve_model m;
    di_error err;
    cr_assert_eq(serve_model_open(&o, &m, &err), DI_OK, "%s", err.msg);
    cr_assert_not_null(m.rm.w);
    cr_assert_null(m.tok, "no tokenizer named, none needed");
    cr_assert_eq(m.rm.w->config.vocab_size, 4096);
    serve_model_close(&m);
    cr_assert_null(m.rm.w);
    serve_model_close(&m);
    serve_model_close(NULL);
}

Test(serve_model, bad_inputs_fail_with_one_line_and_leave_nothing_open, .timeout = 60)
{
    serve_model m = {0};
    di_error err;
    serve_model_options o = {.config = "no-such-config"};
    cr_assert_neq(serve_model_open(&o, &m, &err), DI_OK);
    cr_assert_null(m.rm.w, "nothing written on failure");
    cr_assert_null(strchr(err.msg, '\n'), "%s", err.msg);
    o = (serve_model_options){.model_dir = "/nonexistent/model"};
    cr_assert_neq(serve_model_open(&o, &m, &err), DI_OK);
    cr_assert(strstr(err.msg, "/nonexistent/model"), "names the directory: %s", err.msg);
    cr_assert_eq(serve_model_open(NULL, &m, &err), DI_EINVAL);
    o = (serve_model_options){.config = "tiny", .tokenizer = "/nonexistent/tokenizer.json"};
    di_status st = serve_model_open(&o, &m, &err);
#ifdef DI_HAVE_TOKENIZER
    cr_assert_eq(st, DI_ENOENT, "%s", err.msg);
    cr_assert(strstr(err.msg, "tokenizer /nonexistent/tokenizer.json"), "%s", err.msg);
#else
    cr_assert_eq(st, DI_OK, "without the module a tokenizer is not opened: %s", err.msg);
    serve_model_close(&m);
#endif
}

#ifdef DI_HAVE_TOKENIZER
#include "common/tokenizer/tokenizer.h"

/* Text needs a tokenizer whose ids fit the model: the shipped one has 128,815 ids, tiny 4,096. */
Test(serve_model, a_tokenizer_must_fit_the_vocabulary_when_text_is_encoded, .timeout = 60)
{
    const char *path = tok_default_path();
    if (!path)
        cr_skip_test("no tokenizer installed (deploy/local/install-deps.sh fetches it)");
    serve_model m = {0};
    di_error err;
    serve_model_options o = {.config = "tiny", .tokenizer = path, .need_tokenizer = true};
    cr_assert_eq(serve_model_open(&o, &m, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "has 128815 ids but the model's vocabulary is 4096"), "%s",
              err.msg);
    o.need_tokenizer = false; /* ids only: the tokenizer is loaded for decoding */
    cr_assert_eq(serve_model_open(&o, &m, &err), DI_OK, "%s", err.msg);
    cr_assert_not_null(m.tok);
    serve_model_close(&m);
    cr_assert_null(m.tok);
}
#endif
