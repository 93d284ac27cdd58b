/* Crash test: a writer keeps committing blocks while the store is killed with SIGKILL at random
 * moments; after every restart every acknowledged block (durability wal or fsync, alternating
 * by cycle) must read back bit-exact, and no key may ever be served with other bytes than the
 * ones written (a block whose commit was not acknowledged is either absent or complete). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util/philox.h"
#include "tests/kvstore/harness.h"
#include "tests/kvstore/helpers.h"

#define BLOCK 4224
#define CYCLES 24
#define BATCH 8
#define MAX_KEYS 200000
#define SEED 20261129

typedef struct killer {
    pid_t pid;          /* the store to kill */
    unsigned delay_ms;  /* after this long */
    atomic_int fired;   /* set once the signal is sent */
} killer;

static void *killer_main(void *arg)
{
    killer *k = arg;
    usleep(k->delay_ms * 1000u);
    kill(k->pid, SIGKILL);
    atomic_store(&k->fired, 1);
    return NULL;
}

/* Outcome of every key ever attempted. */
enum { NEVER = 0, ATTEMPTED = 1, ACKED = 2 };

typedef struct run {
    uint8_t *state;       /* per key */
    uint64_t next;        /* next key to write */
    uint64_t acked;       /* keys acknowledged */
    uint64_t attempted;   /* keys sent without acknowledgement */
    uint64_t absent_unacked; /* unacknowledged keys found absent after restarts */
    uint64_t present_unacked; /* unacknowledged keys found complete after restarts */
    kv_geometry g;
} run;

static void write_until_killed(run *r, kvc_client *c, killer *k)
{
    kvc_item items[BATCH];
    uint8_t *bufs = malloc((size_t)BATCH * BLOCK);
    while (!atomic_load(&k->fired) && r->next + BATCH < MAX_KEYS) {
        for (int i = 0; i < BATCH; i++) {
            uint64_t id = r->next + (uint64_t)i;
            kvkey key = th_key(id);
            th_fill_object(bufs + (size_t)i * BLOCK, BLOCK, KV_BLOCK_MAGIC, &r->g, &key, id);
            items[i] = (kvc_item){.cls = KVKEY_BLOCK, .key = key,
                                  .buf = bufs + (size_t)i * BLOCK, .cap = BLOCK};
            r->state[id] = ATTEMPTED;
        }
        di_error e;
        kvc_put(c, items, BATCH, &e);
        for (int i = 0; i < BATCH; i++)
            if (items[i].status == DI_OK)
                r->state[r->next + (uint64_t)i] = ACKED;
        r->next += BATCH;
    }
    free(bufs);
}

/* Reads back every key written so far. Acknowledged ones must match; others must match or be
 * absent. */
static void verify_all(run *r, kvc_client *c, int cycle)
{
    uint8_t *bufs = malloc((size_t)KVC_MAX_BATCH * BLOCK);
    uint8_t *want = malloc(BLOCK);
    kvc_item items[256];
    r->absent_unacked = r->present_unacked = 0;
    for (uint64_t base = 0; base < r->next; base += 256) {
        size_t n = r->next - base < 256 ? (size_t)(r->next - base) : 256;
        for (size_t i = 0; i < n; i++)
            items[i] = (kvc_item){.cls = KVKEY_BLOCK, .key = th_key(base + i),
                                  .buf = bufs + i * BLOCK, .cap = BLOCK};
        di_error e;
        cr_assert_eq(kvc_get(c, items, n, &e), DI_OK, "cycle %d: get batch at %llu: %s", cycle,
                     (unsigned long long)base, e.msg);
        for (size_t i = 0; i < n; i++) {
            uint64_t id = base + i;
            di_status st = items[i].status;
            cr_assert(st == DI_OK || st == DI_ENOENT, "cycle %d key %llu: %s", cycle,
                      (unsigned long long)id, items[i].error.msg);
            if (r->state[id] == ACKED)
                cr_assert_eq(st, DI_OK, "cycle %d: acknowledged key %llu lost: %s", cycle,
                             (unsigned long long)id, items[i].error.msg);
            if (st == DI_OK) {
                th_fill_object(want, BLOCK, KV_BLOCK_MAGIC, &r->g, &items[i].key, id);
                cr_assert_eq(memcmp(items[i].buf, want, BLOCK), 0,
                             "cycle %d: key %llu served with other bytes", cycle,
                             (unsigned long long)id);
                r->present_unacked += r->state[id] != ACKED;
            } else
                r->absent_unacked++;
        }
    }
    free(bufs);
    free(want);
}

Test(crash, acknowledged_blocks_survive_sigkill_at_random_moments, .timeout = 600)
{
    char dir[256];
    th_tmpdir(dir);
    run r = {.state = calloc(MAX_KEYS, 1)};
    kv_geometry_v41_flash(5, &r.g);
    th_store s;
    const char *args[] = {"--block-bytes", "4224", "--window-bytes", "8320", "--dram-bytes",
                          "16MiB", "--memtable-bytes", "4MiB", "--durability", "wal", NULL};
    th_store_start(&s, dir, args);
    for (int cycle = 0; cycle < CYCLES; cycle++) {
        kvc_client *c = th_client_deadline(&s, NULL, 2000);
        killer k = {.pid = s.pid,
                    .delay_ms = 10 + (unsigned)(di_philox_uniform(SEED, (uint64_t)cycle, 0) * 150)};
        pthread_t t;
        cr_assert_eq(pthread_create(&t, NULL, killer_main, &k), 0);
        write_until_killed(&r, c, &k);
        pthread_join(t, NULL);
        kvc_close(c);
        th_store_kill(&s); /* reaps the killed process */
        s.args[s.n_args - 1] = cycle % 2 ? "wal" : "fsync"; /* next cycle's durability */
        th_store_restart(&s);
        c = th_client_deadline(&s, NULL, 10000);
        verify_all(&r, c, cycle);
        kvc_close(c);
    }
    r.acked = 0;
    for (uint64_t i = 0; i < r.next; i++)
        r.acked += r.state[i] == ACKED;
    fprintf(stderr,
            "crash test: %d SIGKILL cycles, %llu blocks written, %llu acknowledged and all read "
            "back bit-exact; of %llu unacknowledged, %llu present and complete, %llu absent\n",
            CYCLES, (unsigned long long)r.next, (unsigned long long)r.acked,
            (unsigned long long)(r.next - r.acked), (unsigned long long)r.present_unacked,
            (unsigned long long)r.absent_unacked);
    cr_assert_gt(r.acked, (uint64_t)CYCLES * BATCH, "the writer made progress every cycle");
    th_store_stop(&s);
    free(r.state);
    th_rmtree(dir);
}
