/* sampler_backend.h: sampling rows whose logits stay in a backend's memory, through the
 * backend's optional `sample` entry (kernels.h, kern_sample), with the results sampler_sample
 * gives for the same logits (the CUDA backend's kernel reproduces the host sampler bit for
 * bit; tests/gpu/check_sample.c holds it to that).
 */
#ifndef DI_SAMPLING_SAMPLER_BACKEND_H
#define DI_SAMPLING_SAMPLER_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "common/sampling/sampler.h"
#include "kernels/kernels.h"

/* The kernel's row for a sampler row drawing case 0 (a fresh sample): the parameters checked
 * (sampling_params_validate), the temperature resolved, the row's seed and stream. When the
 * row blocks tokens (grammar mask, blacklist, a banned EOS) allowed[(n_vocab + 31) / 32] gets
 * the bitmap of the tokens left and out->allowed points to it; else out->allowed is NULL.
 * DI_EINVAL with the reason. */
di_status sampler_kern_row(const sampler_row *row, uint32_t *allowed, kern_sample_row *out,
                           di_error *err);

/* n rows sampled by be->ops.sample from logits [n, stride] f32 in the backend's memory (row
 * i's logits pointer is ignored; n_vocab must be the same for every row), with case 0 draws:
 * results[i] is what sampler_sample would give for that row, its err included. A row the
 * kernel refuses (a NaN or +inf logit, every token blocked) is copied to the host and run
 * through sampler_sample for its message (ws, of at least n_vocab tokens, serves that).
 * Returns DI_OK (*n_failed, optional, counts failed rows); DI_EUNSUPPORTED when the backend
 * has no sample entry; DI_EINVAL for bad arguments or parameters (nothing sampled); DI_ENOMEM;
 * the backend's failure. */
di_status sampler_sample_backend(const kern_backend *be, const float *logits, size_t stride,
                                 const sampler_row *rows, size_t n, sampler_workspace *ws,
                                 sampler_result *results, size_t *n_failed, di_error *err);

/* The launch half of sampler_sample_backend, for a caller that reads the outcomes later (one
 * step ahead): the rows checked and handed to the backend's entry with out_dev (backend
 * memory [n]); returns without waiting for the draw. ws_capacity: the vocabulary a host
 * workspace would need (rows' n_vocab at most). DI_OK (n = 0 too); DI_EUNSUPPORTED; DI_EINVAL
 * (arguments, a row's parameters); DI_ENOMEM; the backend's failure. */
di_status sampler_launch_backend(const kern_backend *be, const float *logits, size_t stride,
                                 const sampler_row *rows, size_t n, uint32_t ws_capacity,
                                 kern_sample_out *out_dev, di_error *err);

/* One outcome of sampler_launch_backend, read back to the host, as sampler_sample's result.
 * A refused row gets DI_ERANGE with the kernel's reason (the logits are gone by then, so the
 * message does not name the token as sampler_sample's does). */
void sampler_backend_result(const kern_sample_out *o, sampler_result *r);

/* The `sample` entry (kern_sample) computed on host memory by this sampler: for each row,
 * sampler_process on a row with the kernel row's parameters and its bitmap as the grammar
 * mask, then the draw with sampler_uniform(seed, stream). ctx is a sampler workspace of at
 * least n_vocab tokens. A host backend whose `alloc` is host memory may install it (the
 * executor's tests do); it is also the entry's reference in words of the public sampler.
 * DI_OK; DI_EINVAL for bad arguments (a row's parameters included). */
di_status sampler_host_sample(void *ctx, const kern_sample *p);

#endif
