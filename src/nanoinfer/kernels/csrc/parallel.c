/* ni_parallel_for on OpenMP or, without it (Apple's clang), on a pthread pool of our own.
 *
 * Both backends run the same virtual workers over the same ranges (parallel.h); a backend only chooses which OS
 * thread runs each. The pool: threads are made on first need and kept; a call wakes them, runs worker 0 on the
 * caller and waits until every thread has answered. One call at a time owns the pool; a call that finds it busy
 * (another Python thread's kernel) runs on threads of its own, made and joined for it.
 */
#include "parallel.h"

#ifdef _OPENMP
#include <omp.h>
#else
#include <pthread.h>
#include <stdlib.h>
#endif

typedef struct {
    ni_range_fn fn;
    void *ctx;
    long n;
    int team;
} job;

static void run_worker(const job *j, int worker) {
    const long base = j->n / j->team, extra = j->n % j->team;
    const long first = base * worker + (worker < extra ? worker : extra);
    j->fn(j->ctx, first, first + base + (worker < extra), worker);
}

static _Thread_local int inside;   /* this thread is running a worker: a nested call runs inline */

static void run_inline(const job *j) {
    for (int worker = 0; worker < j->team; worker++) run_worker(j, worker);
}

#ifdef _OPENMP
const char *ni_threads_backend(void) { return "openmp"; }

static void run_team(const job *j) {
#pragma omp parallel num_threads(j->team)
    {
        inside = 1;
        /* OpenMP may give fewer threads than asked: each runs every got-th worker, the ranges unchanged */
        for (int worker = omp_get_thread_num(); worker < j->team; worker += omp_get_num_threads()) run_worker(j, worker);
        inside = 0;
    }
}
#else
const char *ni_threads_backend(void) { return "pthreads"; }

static struct {
    pthread_mutex_t owner;   /* held by the call using the pool */
    pthread_mutex_t lock;    /* guards what follows */
    pthread_cond_t start, done;
    int threads, pending;    /* threads made; threads yet to answer this call */
    unsigned long generation;
    job current;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

typedef struct {
    int worker;
    unsigned long seen;   /* the generation when it was made: it runs the calls after it */
} pool_start;

/* Pool thread `worker` (1, 2, ...): runs its range of each call while it is in the team. */
static void *pool_thread(void *arg) {
    const int worker = ((pool_start *)arg)->worker;
    unsigned long seen = ((pool_start *)arg)->seen;
    free(arg);
    inside = 1;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.start, &pool.lock);
        seen = pool.generation;
        const job j = pool.current;
        pthread_mutex_unlock(&pool.lock);
        if (worker < j.team) run_worker(&j, worker);
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: it starts with an empty pool. */
static void forget_pool(void) {
    pthread_mutex_init(&pool.owner, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.start, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.threads = pool.pending = 0;
}

static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;
static void install_fork_handler(void) { pthread_atfork(NULL, NULL, forget_pool); }

/* The pool grown to `team` - 1 threads; 0 when a thread could not be made. */
static int grow_pool(int team) {
    pthread_once(&fork_handler, install_fork_handler);
    while (pool.threads < team - 1) {
        pthread_t t;
        pool_start *start = malloc(sizeof(pool_start));
        if (!start) return 0;
        *start = (pool_start){pool.threads + 1, pool.generation};
        if (pthread_create(&t, NULL, pool_thread, start) != 0) {
            free(start);
            return 0;
        }
        pthread_detach(t);
        pthread_mutex_lock(&pool.lock);
        pool.threads++;
        pthread_mutex_unlock(&pool.lock);
    }
    return 1;
}

typedef struct {
    const job *j;
    int worker;
} own_thread;

static void *run_own_thread(void *arg) {
    const own_thread *o = arg;
    inside = 1;
    run_worker(o->j, o->worker);
    return NULL;
}

/* The team on threads made for this call (the pool is busy); a worker whose thread cannot be made runs here. */
static void run_own_threads(const job *j) {
    pthread_t *t = malloc(sizeof(pthread_t) * (size_t)j->team);
    own_thread *o = malloc(sizeof(own_thread) * (size_t)j->team);
    char *made = calloc((size_t)j->team, 1);
    inside = 1;
    for (int w = 1; w < j->team; w++) {
        if (t && o && made) {
            o[w] = (own_thread){j, w};
            made[w] = pthread_create(&t[w], NULL, run_own_thread, &o[w]) == 0;
        }
        if (!made || !made[w]) run_worker(j, w);
    }
    run_worker(j, 0);
    for (int w = 1; w < j->team; w++)
        if (made && made[w]) pthread_join(t[w], NULL);
    inside = 0;
    free(t), free(o), free(made);
}

static void run_team(const job *j) {
    if (pthread_mutex_trylock(&pool.owner) != 0) {
        run_own_threads(j);
        return;
    }
    if (!grow_pool(j->team)) {
        pthread_mutex_unlock(&pool.owner);
        run_own_threads(j);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    pool.current = *j;
    pool.pending = pool.threads;
    pool.generation++;
    pthread_cond_broadcast(&pool.start);
    pthread_mutex_unlock(&pool.lock);
    inside = 1;
    run_worker(j, 0);
    inside = 0;
    pthread_mutex_lock(&pool.lock);
    while (pool.pending) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.owner);
}
#endif

int ni_parallel_for(long n_tasks, int threads, ni_range_fn fn, void *ctx) {
    const long most = n_tasks < 1 ? 1 : n_tasks;
    const job j = {fn, ctx, n_tasks < 0 ? 0 : n_tasks, threads < 1 ? 1 : threads < most ? threads : (int)most};
    if (j.team == 1 || inside)
        run_inline(&j);
    else
        run_team(&j);
    return j.team;
}
