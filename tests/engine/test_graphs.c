#include <criterion/criterion.h>

#include "common/engine/graphs.h"

Test(graphs, four_seqs_nextn5)
{
    graph_sizes g;
    di_error e;
    cr_assert_eq(graph_sizes_init(&g, 4, 5, 8, &e), DI_OK, "%s", e.msg);
    const uint32_t want[] = {1, 2, 4, 8, 16, 24};
    cr_assert_eq(g.count, 6);
    for (size_t i = 0; i < 6; i++)
        cr_assert_eq(g.sizes[i], want[i]);
    cr_assert_eq(graph_sizes_select(&g, 24), 24);
    cr_assert_eq(graph_sizes_select(&g, 25), 0);
    cr_assert_eq(graph_sizes_select(&g, 0), 1);
    cr_assert_eq(graph_sizes_select(&g, 3), 4);
    graph_sizes_free(&g);
}

Test(graphs, sixty_four_seqs_37_rows_use_40)
{
    graph_sizes g;
    cr_assert_eq(graph_sizes_init(&g, 64, 5, 8, NULL), DI_OK);
    cr_assert_eq(g.max_rows, 384);
    cr_assert_eq(g.sizes[g.count - 1], 384);
    cr_assert_eq(graph_sizes_select(&g, 37), 40);
    cr_assert_eq(g.count, 4 + 384 / 8 - 1, "1,2,4,8 then 16..384");
    for (uint32_t r = 1; r <= 384; r++) {
        uint32_t s = graph_sizes_select(&g, r);
        cr_assert(s >= r && s - r < 8, "rows %u -> graph %u pads at most 7", r, s);
    }
    graph_sizes_free(&g);
}

Test(graphs, odd_limits_and_errors)
{
    graph_sizes g;
    cr_assert_eq(graph_sizes_init(&g, 5, 1, 8, NULL), DI_OK); /* max 10 */
    const uint32_t want[] = {1, 2, 4, 8, 10};
    cr_assert_eq(g.count, 5);
    for (size_t i = 0; i < 5; i++)
        cr_assert_eq(g.sizes[i], want[i]);
    graph_sizes_free(&g);
    cr_assert_eq(graph_sizes_init(&g, 1, 0, 8, NULL), DI_OK); /* max 1 */
    cr_assert_eq(g.count, 1);
    cr_assert_eq(g.sizes[0], 1);
    graph_sizes_free(&g);
    cr_assert_eq(graph_sizes_init(&g, 2, 5, 32, NULL), DI_OK); /* max 12 < interval */
    const uint32_t w2[] = {1, 2, 4, 8, 12};
    cr_assert_eq(g.count, 5);
    for (size_t i = 0; i < 5; i++)
        cr_assert_eq(g.sizes[i], w2[i]);
    graph_sizes_free(&g);
    di_error e;
    cr_assert_eq(graph_sizes_init(&g, 0, 5, 8, &e), DI_EINVAL);
    cr_assert_eq(graph_sizes_init(&g, 4, 5, 0, &e), DI_EINVAL);
}
