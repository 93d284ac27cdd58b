/* The metrics registry: the exposition parses as Prometheus text, histograms are cumulative
 * with +Inf = count, per-instance series add up to the total, label values are escaped, and
 * the series bound holds. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/metrics.h"

static const double B[] = {0.1, 1.0};
static const met_def DEFS[] = {
    {"vllm:time_to_first_token_seconds", MET_HISTOGRAM, "ttft", B, 2},
    {"vllm:prompt_tokens_total", MET_COUNTER, "prompt tokens", NULL, 0},
    {"vllm:num_requests_running", MET_GAUGE, "running", NULL, 0},
};

/* Finds the sample line "name{labels} value" and returns its value; -1 when absent. Checks
 * that every sample line has the shape NAME{k="v",...} NUMBER. */
static double sample(const char *text, const char *name_and_labels)
{
    double found = -1;
    char *copy = strdup(text);
    for (char *line = strtok(copy, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#') {
            cr_assert(strncmp(line, "# HELP ", 7) == 0 || strncmp(line, "# TYPE ", 7) == 0,
                      "bad comment line: %s", line);
            continue;
        }
        char *brace = strchr(line, '{'), *close = strrchr(line, '}');
        cr_assert(brace && close && close[1] == ' ', "bad sample line: %s", line);
        char *end;
        double v = strtod(close + 2, &end);
        cr_assert(*end == '\0' || strcmp(close + 2, "+Inf") == 0, "bad value: %s", line);
        if (strncmp(line, name_and_labels, strlen(name_and_labels)) == 0 &&
            line[strlen(name_and_labels)] == ' ')
            found = v;
    }
    free(copy);
    return found;
}

Test(metrics, exposition_counts_and_escapes)
{
    met_registry *r = NULL;
    di_error e = {0};
    cr_assert_eq(met_new(DEFS, 3, "m\"x", &r, &e), DI_OK, "%s", e.msg);
    met_observe(r, 0, "a:1", 0.05);
    met_observe(r, 0, "a:1", 0.5);
    met_observe(r, 0, "b:2", 5.0);
    met_observe(r, 0, NULL, 0.1); /* on the edge: le is inclusive */
    met_add(r, 1, "a:1", 10);
    met_add(r, 1, "b:2", 5);
    met_add(r, 1, "a:1", -3); /* a counter never goes down */
    met_add(r, 2, NULL, 2);
    met_add(r, 2, NULL, -1);
    char *t = met_render(r);
    cr_assert_not_null(t);
    cr_expect(strstr(t, "# TYPE vllm:time_to_first_token_seconds histogram\n") != NULL, "%s", t);
    cr_expect(strstr(t, "# TYPE vllm:prompt_tokens_total counter\n") != NULL);
    const char *tot = "{model_name=\"m\\\"x\"";
    char k[256];
    snprintf(k, sizeof k, "vllm:time_to_first_token_seconds_bucket%s,le=\"0.1\"}", tot);
    cr_expect_eq(sample(t, k), 2, "%s", t);
    snprintf(k, sizeof k, "vllm:time_to_first_token_seconds_bucket%s,le=\"1\"}", tot);
    cr_expect_eq(sample(t, k), 3);
    snprintf(k, sizeof k, "vllm:time_to_first_token_seconds_bucket%s,le=\"+Inf\"}", tot);
    cr_expect_eq(sample(t, k), 4);
    snprintf(k, sizeof k, "vllm:time_to_first_token_seconds_count%s}", tot);
    cr_expect_eq(sample(t, k), 4);
    snprintf(k, sizeof k, "vllm:time_to_first_token_seconds_bucket%s,rank=\"a:1\",le=\"1\"}",
             tot);
    cr_expect_eq(sample(t, k), 2);
    snprintf(k, sizeof k, "vllm:prompt_tokens_total%s}", tot);
    cr_expect_eq(sample(t, k), 15);
    snprintf(k, sizeof k, "vllm:prompt_tokens_total%s,rank=\"b:2\"}", tot);
    cr_expect_eq(sample(t, k), 5);
    snprintf(k, sizeof k, "vllm:num_requests_running%s}", tot);
    cr_expect_eq(sample(t, k), 1);
    cr_expect_eq(met_value(r, 1, "a:1"), 10);
    free(t);
    met_free(r);
}

Test(metrics, series_are_bounded_and_tables_checked)
{
    met_registry *r = NULL;
    di_error e = {0};
    cr_assert_eq(met_new(DEFS, 3, "m", &r, &e), DI_OK);
    char inst[32];
    for (int i = 0; i < MET_MAX_SERIES + 10; i++) {
        snprintf(inst, sizeof inst, "h%d:1", i);
        met_add(r, 1, inst, 1);
    }
    cr_expect_eq(met_value(r, 1, NULL), MET_MAX_SERIES + 10); /* the total has them all */
    cr_expect_eq(met_value(r, 1, "h70:1"), 0);                /* past the bound: no series */
    met_free(r);
    static const double bad_b[] = {1.0, 0.5};
    met_def bad = {"x", MET_HISTOGRAM, "x", bad_b, 2};
    cr_expect_eq(met_new(&bad, 1, "m", &r, &e), DI_EINVAL);
    met_free(NULL);
}
