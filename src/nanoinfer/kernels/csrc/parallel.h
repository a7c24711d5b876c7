/* The kernels' one work split: n tasks in contiguous ranges over a team of workers, the same ranges whichever
 * backend runs them (OpenMP when the compiler has it, else parallel.c's own pthread pool), so no bit can depend
 * on which. */
#ifndef NANOINFER_PARALLEL_H
#define NANOINFER_PARALLEL_H

/* Worker `worker` (0 <= worker < team) runs tasks [first, last). */
typedef void (*ni_range_fn)(void *ctx, long first, long last, int worker);

/* fn over tasks 0..n_tasks-1 split among min(threads, n_tasks) workers (at least 1): worker i of a team of t takes
 * n / t tasks, one more when i < n % t, in order, as OpenMP's schedule(static). Returns the team's size. Called
 * from inside a worker, the whole range runs on the caller, worker by worker. */
int ni_parallel_for(long n_tasks, int threads, ni_range_fn fn, void *ctx);

/* "openmp" or "pthreads": the backend this build runs ni_parallel_for on. */
const char *ni_threads_backend(void);

#endif
