/* bench_load: what the weights fingerprint adds to a checkpoint load, next to a plain read of
 * the same bytes measured in the same run (page cache warm: every figure is a pass over bytes
 * already in memory, the case where hashing shows most).
 *
 *   bench_load [--dir CKPT] [--config NAME] [--big-mib N] [--threads N]
 *
 * Without --dir it writes a random-weight checkpoint of --config (default demo) to a temporary
 * directory. Then, for the checkpoint:
 *   read         one read() pass over every covered file (1 thread): the reference
 *   load         model_weights_load trusting the manifest (no hashing), every page touched
 *   load+verify  the default load: every shard hashed and checked against the manifest
 * and for one synthetic shard of --big-mib MiB (default 1024; 0 skips): a plain read and the
 * fingerprint alone, with 1 and with --threads threads.
 */
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/model/mkmodel.h"
#include "common/model/shard_sums.h"
#include "common/model/weights.h"
#include "common/util/clock.h"

static double now_s(void)
{
    return (double)di_mono_ns() / 1e9;
}

/* CPU seconds of the process (every thread): on a shared machine the wall clock measures the
 * neighbours too, this does not. */
static double cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static double g_cpu; /* CPU seconds of the best run of the last best_of */

/* One read() pass over dir/name; returns bytes. */
static uint64_t read_file(const char *dir, const char *name, uint8_t *buf, size_t cap)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    int fd = open(p, O_RDONLY);
    if (fd < 0) {
        perror(p);
        exit(1);
    }
    uint64_t total = 0;
    ssize_t n;
    while ((n = read(fd, buf, cap)) > 0)
        total += (uint64_t)n;
    close(fd);
    return total;
}

static double read_all(const char *dir, const st_index *idx, uint64_t *bytes)
{
    size_t cap = 8u << 20;
    uint8_t *buf = malloc(cap);
    double t0 = now_s();
    *bytes = 0;
    for (uint32_t i = 0; i < idx->n_shards; i++)
        *bytes += read_file(dir, idx->shards[i], buf, cap);
    double t = now_s() - t0;
    free(buf);
    return t;
}

static double load_once(const char *dir, uint32_t flags, uint32_t threads, uint64_t *id)
{
    model_load_options o = {.flags = flags, .hash_threads = threads};
    model_weights *w;
    di_error e;
    double t0 = now_s();
    if (model_weights_load(dir, &o, &w, &e) != DI_OK) {
        fprintf(stderr, "bench_load: %s\n", e.msg);
        exit(1);
    }
    double t = now_s() - t0;
    *id = w->config.model_id;
    model_weights_free(w);
    return t;
}

static double best_of(int n, double (*fn)(void *), void *ud)
{
    double best = 1e30;
    for (int i = 0; i < n; i++) {
        double c0 = cpu_s();
        double t = fn(ud);
        double c = cpu_s() - c0;
        if (t < best) {
            best = t;
            g_cpu = c;
        }
    }
    return best;
}

typedef struct run_ctx {
    const char *dir;
    const st_index *idx;
    uint32_t flags, threads;
    uint64_t bytes, id;
} run_ctx;

static double run_read(void *ud)
{
    run_ctx *c = ud;
    return read_all(c->dir, c->idx, &c->bytes);
}

static double run_load(void *ud)
{
    run_ctx *c = ud;
    return load_once(c->dir, c->flags, c->threads, &c->id);
}

static double run_sums(void *ud)
{
    run_ctx *c = ud;
    shard_sums_result r;
    di_error e;
    double t0 = now_s();
    if (shard_sums_fingerprint(c->dir, c->idx, c->threads, false, &r, &e) != DI_OK) {
        fprintf(stderr, "bench_load: %s\n", e.msg);
        exit(1);
    }
    return now_s() - t0;
}

static void line(const char *what, double s, uint64_t bytes, double ref_s)
{
    printf("  %-34s %8.3f s  %7.2f GB/s  %5.2fx the plain read   CPU %7.3f s (%5.2f s/GB)\n",
           what, s, bytes / s / 1e9, s / ref_s, g_cpu, g_cpu / (bytes / 1e9));
}

static void bench_checkpoint(const char *dir, uint32_t threads)
{
    st_index *idx;
    di_error e;
    if (st_index_load(dir, &idx, &e) != DI_OK) {
        fprintf(stderr, "bench_load: %s\n", e.msg);
        exit(1);
    }
    run_ctx c = {.dir = dir, .idx = idx, .threads = threads};
    run_read(&c); /* warm the page cache */
    double read_s = best_of(3, run_read, &c);
    printf("checkpoint %s: %u shard(s), %.1f MB; best of 3, page cache warm, %u hash threads\n",
           dir, idx->n_shards, c.bytes / 1e6, threads);
    line("read (1 thread, the reference)", read_s, c.bytes, read_s);
    c.flags = MODEL_LOAD_TRUST_SUMS | MODEL_LOAD_PREFAULT;
    line("load, no hashing, pages touched", best_of(3, run_load, &c), c.bytes, read_s);
    c.flags = 0;
    line("load + verify (default)", best_of(3, run_load, &c), c.bytes, read_s);
    c.flags = MODEL_LOAD_PREFAULT;
    line("load + verify, pages touched", best_of(3, run_load, &c), c.bytes, read_s);
    printf("  model id %016" PRIx64 "\n", c.id);
    st_index_free(idx);
}

static void bench_big(const char *tmp, uint64_t mib, uint32_t threads)
{
    char dir[300], p[400];
    snprintf(dir, sizeof dir, "%s/big", tmp);
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(p, "w");
    fputs("{\"weight_map\": {\"x\": \"big.safetensors\"}}\n", f);
    fclose(f);
    snprintf(p, sizeof p, "%s/big.safetensors", dir);
    f = fopen(p, "wb");
    size_t cap = 1u << 20;
    uint64_t *buf = malloc(cap);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (uint64_t m = 0; m < mib; m++) {
        for (size_t i = 0; i < cap / 8; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            buf[i] = x;
        }
        fwrite(buf, 1, cap, f);
    }
    fclose(f);
    free(buf);
    st_index *idx;
    di_error e;
    if (st_index_load(dir, &idx, &e) != DI_OK) {
        fprintf(stderr, "bench_load: %s\n", e.msg);
        exit(1);
    }
    run_ctx c = {.dir = dir, .idx = idx, .threads = 1};
    run_read(&c);
    double read_s = best_of(3, run_read, &c);
    printf("one synthetic shard of %" PRIu64 " MiB; best of 3, page cache warm (SHA-256 via %s)\n",
           mib, di_sha256_is_openssl() ? "OpenSSL" : "the portable code");
    line("read (1 thread, the reference)", read_s, c.bytes, read_s);
    line("fingerprint, 1 thread", best_of(3, run_sums, &c), c.bytes, read_s);
    c.threads = threads;
    char what[64];
    snprintf(what, sizeof what, "fingerprint, %u threads", threads);
    line(what, best_of(3, run_sums, &c), c.bytes, read_s);
    st_index_free(idx);
    unlink(p);
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *config = "demo";
    uint64_t big = 1024;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    uint32_t threads = cpus > 0 ? (uint32_t)cpus : 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help")) {
            printf("usage: bench_load [--dir CKPT] [--config NAME] [--big-mib N] [--threads N]\n"
                   "Load time with and without the weights fingerprint, next to a plain read of "
                   "the same bytes.\n");
            return 0;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_load: %s needs a value (see --help)\n", argv[i]);
            return 2;
        }
        if (!strcmp(argv[i], "--dir"))
            dir = v;
        else if (!strcmp(argv[i], "--config"))
            config = v;
        else if (!strcmp(argv[i], "--big-mib"))
            big = strtoull(v, NULL, 10);
        else if (!strcmp(argv[i], "--threads"))
            threads = (uint32_t)strtoul(v, NULL, 10);
        else {
            fprintf(stderr, "bench_load: unknown option '%s' (see --help)\n", argv[i]);
            return 2;
        }
        i++;
    }
    if (threads == 0 || threads > 64 || big > (1u << 20)) {
        fprintf(stderr, "bench_load: --threads must be 1..64 and --big-mib at most 1048576\n");
        return 2;
    }
    char tmp[] = "/tmp/di_bench_load_XXXXXX";
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    char made[300];
    if (!dir) {
        snprintf(made, sizeof made, "%s/ckpt", tmp);
        model_config cfg;
        mkmodel_options o;
        mkmodel_options_default(&o);
        di_error e;
        if (model_config_resolve(config, &cfg, &e) != DI_OK ||
            mkmodel_write(&cfg, made, &o, NULL, &e) != DI_OK) {
            fprintf(stderr, "bench_load: %s\n", e.msg);
            return 1;
        }
        dir = made;
    }
    bench_checkpoint(dir, threads);
    if (big)
        bench_big(tmp, big, threads);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    return system(cmd) == 0 ? 0 : 1;
}
