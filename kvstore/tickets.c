#include "kvstore/tickets.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "common/util/clock.h"

#define BUCKETS 4096u

enum { ISSUED, BUSY, LANDED };

typedef struct entry {
    struct entry *next;
    uint64_t name;        /* kind << 63 | id */
    uint8_t secret[8];
    uint64_t offset, bytes;
    uint64_t expires_ns;
    int state;
    int release;          /* get: release the lease when it ends */
} entry;

struct kvt_table {
    pthread_mutex_t mu;
    entry *b[BUCKETS];
    uint64_t count;
    uint64_t issued;      /* since the last sweep */
};

static uint64_t name_of(int kind, uint64_t id)
{
    return (uint64_t)(kind == KVT_PUT) << 63 | (id & ~(1ull << 63));
}

static uint32_t bucket(uint64_t name)
{
    name ^= name >> 33;
    name *= 0xff51afd7ed558ccdull;
    name ^= name >> 33;
    return (uint32_t)(name % BUCKETS);
}

di_status kvt_create(kvt_table **out, di_error *err)
{
    kvt_table *t = calloc(1, sizeof(*t));
    if (!t)
        return di_fail(err, DI_ENOMEM, "cannot allocate the ticket table");
    pthread_mutex_init(&t->mu, NULL);
    *out = t;
    return DI_OK;
}

kvt_table *kvt_free(kvt_table *t)
{
    if (!t)
        return NULL;
    for (uint32_t i = 0; i < BUCKETS; i++)
        for (entry *e = t->b[i], *n; e; e = n) {
            n = e->next;
            free(e);
        }
    pthread_mutex_destroy(&t->mu);
    free(t);
    return NULL;
}

/* The link that points at the entry of name (or at the NULL ending its chain). */
static entry **find(kvt_table *t, uint64_t name)
{
    entry **p = &t->b[bucket(name)];
    while (*p && (*p)->name != name)
        p = &(*p)->next;
    return p;
}

static void unlink_at(kvt_table *t, entry **p)
{
    entry *e = *p;
    *p = e->next;
    free(e);
    t->count--;
}

/* Drops expired entries nobody is using: ISSUED ones (a LANDED put whose allocation expired is
 * refused by the store at commit anyway). */
static void sweep(kvt_table *t, uint64_t now)
{
    for (uint32_t i = 0; i < BUCKETS; i++)
        for (entry **p = &t->b[i]; *p;)
            if ((*p)->state != BUSY && (*p)->expires_ns < now)
                unlink_at(t, p);
            else
                p = &(*p)->next;
}

di_status kvt_issue(kvt_table *t, int kind, uint64_t id, uint64_t offset, uint64_t bytes,
                    uint64_t expires_ns, int release, ucxt_ticket *out, di_error *err)
{
    entry *e = calloc(1, sizeof(*e));
    if (!e)
        return di_fail(err, DI_ENOMEM, "cannot allocate a transfer ticket");
    if (getrandom(e->secret, sizeof(e->secret), 0) != (ssize_t)sizeof(e->secret)) {
        free(e);
        return di_fail(err, DI_EIO, "no randomness for a transfer ticket");
    }
    e->name = name_of(kind, id);
    e->offset = offset;
    e->bytes = bytes;
    e->expires_ns = expires_ns;
    e->release = release;
    memcpy(out->b, &e->name, 8);
    memcpy(out->b + 8, e->secret, 8);
    pthread_mutex_lock(&t->mu);
    entry **p = find(t, e->name);
    if (*p) /* an id is never reused; a stale entry of it goes */
        unlink_at(t, p);
    e->next = t->b[bucket(e->name)];
    t->b[bucket(e->name)] = e;
    t->count++;
    if (++t->issued >= 4 * BUCKETS) {
        sweep(t, di_mono_ns());
        t->issued = 0;
    }
    pthread_mutex_unlock(&t->mu);
    return DI_OK;
}

static int same_secret(const uint8_t *a, const uint8_t *b)
{
    uint8_t d = 0;
    for (int i = 0; i < 8; i++)
        d |= (uint8_t)(a[i] ^ b[i]);
    return d == 0;
}

di_status kvt_begin(kvt_table *t, int kind, const ucxt_ticket *tk, uint64_t len, uint64_t now_ns,
                    uint64_t *offset, uint64_t *bytes, uint64_t *id)
{
    uint64_t name;
    memcpy(&name, tk->b, 8);
    if ((name >> 63) != (uint64_t)(kind == KVT_PUT))
        return DI_EAUTH;
    di_status st = DI_OK;
    pthread_mutex_lock(&t->mu);
    entry **p = find(t, name);
    entry *e = *p;
    if (!e || !same_secret(e->secret, tk->b + 8) || e->state != ISSUED)
        st = DI_EAUTH;
    else if (e->expires_ns <= now_ns) {
        st = DI_ETIMEDOUT;
        unlink_at(t, p);
    } else if (kind == KVT_PUT && len != e->bytes)
        st = DI_EINVAL;
    else {
        e->state = BUSY;
        *offset = e->offset;
        *bytes = e->bytes;
        *id = name & ~(1ull << 63);
    }
    pthread_mutex_unlock(&t->mu);
    return st;
}

int kvt_end(kvt_table *t, int kind, uint64_t id, di_status st)
{
    int release = 0;
    pthread_mutex_lock(&t->mu);
    entry **p = find(t, name_of(kind, id));
    if (*p && (*p)->state == BUSY) {
        if (kind == KVT_GET) {
            release = (*p)->release;
            unlink_at(t, p);
        } else if (st == DI_OK)
            (*p)->state = LANDED;
        else
            unlink_at(t, p);
    }
    pthread_mutex_unlock(&t->mu);
    return release;
}

di_status kvt_settle_put(kvt_table *t, uint64_t id)
{
    di_status st = DI_ESTATE;
    pthread_mutex_lock(&t->mu);
    entry **p = find(t, name_of(KVT_PUT, id));
    if (*p && (*p)->state == BUSY)
        st = DI_EBUSY;
    else if (*p) {
        st = (*p)->state == LANDED ? DI_OK : DI_ESTATE;
        unlink_at(t, p);
    }
    pthread_mutex_unlock(&t->mu);
    return st;
}

int kvt_release_get(kvt_table *t, uint64_t id)
{
    int now = 1;
    pthread_mutex_lock(&t->mu);
    entry **p = find(t, name_of(KVT_GET, id));
    if (*p && (*p)->state == BUSY) {
        (*p)->release = 1;
        now = 0;
    } else if (*p)
        unlink_at(t, p);
    pthread_mutex_unlock(&t->mu);
    return now;
}

uint64_t kvt_count(kvt_table *t)
{
    pthread_mutex_lock(&t->mu);
    uint64_t n = t->count;
    pthread_mutex_unlock(&t->mu);
    return n;
}
