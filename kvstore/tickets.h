/* tickets.h: one-time transfer tickets of the KV data path (docs/kvstore.md, "The data path").
 *
 * Every lease and allocation granted over the authenticated gRPC channel gets a ticket: 8 bytes
 * naming it and 8 random bytes from getrandom. A UCX request moves bytes only with a ticket
 * that is known, carries the right secret (compared in constant time), has not expired, has
 * not been used, and (for puts) comes with exactly the allocation's length; the bytes move only
 * between the slot the ticket names and the wire. So a client touches nothing but the objects
 * its own leases and allocations cover, while it holds them.
 *
 * States: ISSUED -> BUSY (begin) -> gone (get ended) or LANDED (put ended with its bytes in the
 * slot) -> gone (settled by Commit or Abort). A lease released while its get is in flight is
 * released when the get ends, so its slot cannot be reused under the transfer. Thread-safe: the
 * gRPC threads issue and settle, the UCX progress thread begins and ends. */
#ifndef DI_KVSTORE_TICKETS_H
#define DI_KVSTORE_TICKETS_H

#include <stdint.h>

#include "common/net/ucx_xport.h"
#include "common/util/status.h"

enum { KVT_GET = 0, KVT_PUT = 1 };

typedef struct kvt_table kvt_table;

/* DI_OK, DI_ENOMEM. */
di_status kvt_create(kvt_table **out, di_error *err);
kvt_table *kvt_free(kvt_table *t);

/* Issues the ticket of lease or allocation `id` over [offset, offset + bytes) of the arena,
 * valid until expires_ns (di_mono_ns clock). release: a get that ends should release the lease
 * (the client does not call Release). DI_OK, DI_ENOMEM, DI_EIO (no randomness). */
di_status kvt_issue(kvt_table *t, int kind, uint64_t id, uint64_t offset, uint64_t bytes,
                    uint64_t expires_ns, int release, ucxt_ticket *out, di_error *err);

/* Starts a transfer. For a put, len must be the allocation's bytes. On DI_OK: *offset, *bytes
 * and *id of the grant; the entry is BUSY. Refusals: DI_EAUTH (unknown, forged, of the other
 * kind, or already used), DI_ETIMEDOUT (expired), DI_EINVAL (length). */
di_status kvt_begin(kvt_table *t, int kind, const ucxt_ticket *tk, uint64_t len, uint64_t now_ns,
                    uint64_t *offset, uint64_t *bytes, uint64_t *id);
/* Ends a transfer begun with kvt_begin. A get is removed; returns 1 when its lease must now be
 * released (asked for at issue, or Release came while it ran). A put is LANDED on DI_OK,
 * removed otherwise; returns 0. */
int kvt_end(kvt_table *t, int kind, uint64_t id, di_status st);

/* Commit or Abort of allocation id: DI_OK (its bytes landed; removed), DI_EBUSY (its bytes are
 * arriving: nothing changes), DI_ESTATE (no bytes came through a ticket;
 * removed). */
di_status kvt_settle_put(kvt_table *t, uint64_t id);
/* Release of lease id: 1 when the lease may be released now (entry removed or absent), 0 when
 * a get is in flight (its end releases it). */
int kvt_release_get(kvt_table *t, uint64_t id);

/* Entries held (tests). */
uint64_t kvt_count(kvt_table *t);

#endif
