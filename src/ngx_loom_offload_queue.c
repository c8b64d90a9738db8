
/*
 * Copyright (C) resty-loom authors
 *
 * The offload queue, one per runtime and worker: the bounded list of
 * tasks Lua submits (ngx_loom_offload_ffi_submit) and the runtime's own
 * threads take with host->wait(). A thread waits on a mutex and condition
 * variable, with a short adaptive spin first so that a busy runtime
 * thread picks the next task up without a futex wake-up. Sleeping threads
 * are woken once per event loop iteration (a posted event), not once per
 * task, and only as many as the backlog needs given how long tasks take:
 * a fast runtime's tasks are left to the threads already awake. Tasks
 * taken and not yet answered are "held", by address (task.c), so that
 * answer() can refuse a task the runtime does not hold. A call that timed
 * out (ngx_loom_offload_ffi_cancel) or whose request ended takes its task
 * off the queue if no thread took it yet.
 *
 * Layer 3 of the offload files (ngx_loom_offload.c lists them): called by
 * ngx_loom_offload.c and completion.c; calls task.c only, never up. It
 * reads ngx_loom_offload_module for its request context slot: data, not
 * a call.
 */


#include "ngx_loom_offload.h"
#include <sched.h>


#define LOOM_MIN_INLINE_RSP          256

/*
 * roughly what waking a sleeping runtime thread costs (a futex call on
 * each side, often a wake-up on the other CPU): tasks the awake threads
 * will take within this time are left to them, and a thread busy for
 * longer than this gets help
 */
#define LOOM_WAKE_NS                 50000

/* how soon tasks left to busy threads are looked at again (ms) */
#define LOOM_WAKE_CHECK_MS           1

/*
 * a spin that found a task only after this long cost its CPU more than the
 * wake-up it saved (a futex call on each side): it counts as a miss, and
 * the spin window halves. Under concurrent load tasks come every few tens
 * of microseconds, and a spinner that caught each of them late kept the
 * full window and a CPU the event loops needed
 */
#define LOOM_SPIN_PAYS_NS            10000

/*
 * a call submitted by the same request as the previous call on the same
 * runtime, this soon after the event loop resolved that one, is one of a
 * sequence (a loop of calls in one request): the event loop has nothing
 * else to do but wait for it
 */
#define LOOM_SEQ_NS                  3000


/* a spinner that saw a task tries the mutex this many times, then blocks */
#define LOOM_LOCK_SPINS              512


static void ngx_loom_offload_back(loom_offload_queue_t *q, uint64_t now);
static ngx_uint_t ngx_loom_offload_wakes(loom_offload_queue_t *q,
    uint64_t now);
static ngx_uint_t ngx_loom_offload_may_poll(loom_offload_queue_t *q,
    uint64_t pick_ns, uint64_t budget);

/* FFI entry points */
int ngx_loom_offload_ffi_submit(ngx_http_request_t *r,
    loom_offload_queue_t *q, const u_char *name, size_t name_len,
    const u_char *data, size_t len, loom_offload_task_t **out, void **sem);
int ngx_loom_offload_ffi_cancel(loom_offload_task_t *t);


/*
 * the queue a runtime thread took its last task from, and when: the
 * thread is "busy" until it calls wait() again (how long that takes is
 * the queue's service time, which decides whether a new task is left to
 * it or a sleeping thread is woken)
 */
__thread loom_offload_queue_t  *ngx_loom_offload_tls_q;
static __thread uint64_t        ngx_loom_offload_tls_ns;


/*
 * The request is data, or with a name (rt:call(name, data)) the name, a
 * NUL byte and data: built here, so that the data is copied once
 */
int
ngx_loom_offload_ffi_submit(ngx_http_request_t *r, loom_offload_queue_t *q,
    const u_char *name, size_t name_len, const u_char *data, size_t len,
    loom_offload_task_t **out, void **sem)
{
    char                       *errmsg;
    size_t                      cap, head;
    u_char                     *p;
    uint64_t                    now;
    ngx_uint_t                  seq, wake;
    ngx_http_cleanup_t         *cln;
    loom_offload_task_t        *t;
    ngx_loom_offload_rctx_t    *rctx;
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;

    if (ngx_loom_load(&q->closed)) {
        return LOOM_FFI_DECLINED;
    }

    if (ngx_loom_load(&q->npending) >= q->bound) {
        q->rejected++;
        return LOOM_FFI_BUSY;
    }

    rctx = ngx_http_get_module_ctx(r->main, ngx_loom_offload_module);

    if (rctx == NULL) {
        rctx = ngx_palloc(r->main->pool, sizeof(ngx_loom_offload_rctx_t));
        if (rctx == NULL) {
            return LOOM_FFI_ERROR;
        }

        cln = ngx_http_cleanup_add(r->main, 0);
        if (cln == NULL) {
            return LOOM_FFI_ERROR;
        }

        ngx_queue_init(&rctx->tasks);

        cln->handler = ngx_loom_offload_request_cleanup;
        cln->data = rctx;

        ngx_http_set_ctx(r->main, rctx, ngx_loom_offload_module);
    }

    head = name ? name_len + 1 : 0;
    cap = head + len + 1;

    if (cap < LOOM_MIN_INLINE_RSP) {
        cap = LOOM_MIN_INLINE_RSP;
    }

    t = malloc(offsetof(loom_offload_task_t, data) + cap);
    if (t == NULL) {
        return LOOM_FFI_ERROR;
    }

    ngx_memzero(t, offsetof(loom_offload_task_t, data));

    if (w->sema_new(&t->sem, 0, &errmsg) != NGX_OK) {
        free(t);
        return LOOM_FFI_ERROR;
    }

    p = t->data;

    if (name) {
        p = ngx_cpymem(p, name, name_len);
        *p++ = '\0';
    }

    if (len) {
        p = ngx_cpymem(p, data, len);
    }

    *p = '\0';
    now = ngx_loom_offload_now_ns();
    wake = 0;

    t->req_len = head + len;
    t->cap = cap;
    t->queue = q;
    t->start_ns = now;
    t->lua = 1;
    t->rt = 1;
    t->in_request = 1;
    t->where = LOOM_WHERE_PENDING;

    ngx_queue_insert_tail(&rctx->tasks, &t->rlink);
    ngx_queue_insert_tail(&q->live, &t->live);

    w->tasks++;

    if (w->tasks > w->tasks_peak) {
        w->tasks_peak = w->tasks;
    }

    pthread_mutex_lock(&q->mtx);

    ngx_queue_insert_tail(&q->pending, &t->pending);
    ngx_loom_store(&q->npending, q->npending + 1);

    /*
     * a spinning thread will see the task, and so will threads already
     * signalled. For tasks nobody is coming for, sleepers are woken once
     * per event loop iteration (a posted event), not once per task: the
     * calls a batch of events makes cost one wake-up, and the mutex is
     * not fought over while they are queued
     */
    if (q->sleepers > q->waking
        && q->npending > q->spinners + q->waking)
    {
        seq = now - q->resolved_ns < LOOM_SEQ_NS
              && q->seq_conn == r->main->connection->number
              && q->seq_req == r->main->connection->requests;

        if (ngx_loom_offload_may_poll(q, q->wake_ns,
                                      seq ? LOOM_WAKE_POLL * q->poll_ns
                                          : q->poll_ns))
        {
            /*
             * an idle runtime, fast lately: the event loop is about to
             * poll for the answer, so the thread is needed now
             */
            q->waking++;
            wake = 1;
            t->woke = 1;
            t->poll = 1;
            t->wake_poll = seq;

        } else {
            t->kick = 1;
        }

    } else {
        /* decided here: a spinning thread may take the task at once */
        t->poll = ngx_loom_offload_may_poll(q, q->pick_ns, q->poll_ns);
    }

    pthread_mutex_unlock(&q->mtx);

    if (wake) {
        /*
         * after the unlock: signalled under the mutex, the woken thread
         * blocked at once on the mutex still held here, and the unlock
         * then cost a second futex wake-up. The task is queued under the
         * mutex, so a thread that leaves its wait for any other reason
         * in between sees it: no wake-up is lost
         */
        pthread_cond_signal(&q->cond);
    }

    q->seq_conn = r->main->connection->number;
    q->seq_req = r->main->connection->requests;

    if (t->kick && !q->kick_ev.posted) {
        ngx_post_event(&q->kick_ev, &ngx_posted_events);
    }

    q->submitted++;

    if (q->npending > q->peak_queued) {
        q->peak_queued = q->npending;
    }

    *out = t;
    *sem = t->sem;

    return LOOM_FFI_OK;
}


/*
 * Under the queue mutex, right after a task was queued: the runtime is
 * idle but for it, and a thread is expected to pick it up (pick_ns: one
 * awake, or one woken) and answer within poll_us, going by recent tasks
 */
static ngx_uint_t
ngx_loom_offload_may_poll(loom_offload_queue_t *q, uint64_t pick_ns,
    uint64_t budget)
{
    if (q->poll_ns == 0
        || q->ewma_ns + pick_ns >= budget
        || q->state != LOOM_OFFLOAD_READY
        || q->npending != 1
        || q->taken != q->answered)
    {
        return 0;
    }

    if (q->poll_skip) {
        q->poll_skip--;
        return 0;
    }

    return 1;
}


int
ngx_loom_offload_wait(loom_offload_queue_t *q, int timeout_ms,
    loom_offload_task_t **task)
{
    int                       rc, slept;
    uint64_t                  deadline, now, spin;
    ngx_uint_t                n;
    ngx_queue_t              *x;
    struct timespec           ts;
    loom_offload_task_t      *t;
    loom_offload_queue_t     *prev;
    ngx_loom_offload_held_t  *h;

    *task = NULL;
    slept = 0;

    prev = ngx_loom_offload_tls_q;
    now = 0;

    if (prev) {
        /* back from the task taken last: this thread is not busy now */
        ngx_loom_offload_tls_q = NULL;
        now = ngx_loom_offload_now_ns();

        if (prev != q) {
            pthread_mutex_lock(&prev->mtx);
            ngx_loom_offload_back(prev, now);
            pthread_mutex_unlock(&prev->mtx);
        }
    }

    pthread_mutex_lock(&q->mtx);

    if (prev == q) {
        ngx_loom_offload_back(q, now);
    }

    spin = q->spin_cur_ns;

    if (ngx_queue_empty(&q->pending) && !q->closed && spin
        && q->spinners == 0 && timeout_ms != 0)
    {
        /*
         * spin a little before sleeping: a thread that has just answered
         * usually gets the next task within microseconds under load, and
         * taking it without a futex wake-up saves a cross-CPU round trip;
         * one spinner per queue is enough, the others sleep. The spin
         * halves after each miss (or a task found late, see
         * LOOM_SPIN_PAYS_NS) and is restored when tasks come within the
         * spin window again, so an idle runtime soon stops spinning.
         */

        q->spinners++;
        pthread_mutex_unlock(&q->mtx);

        deadline = ngx_loom_offload_now_ns() + spin;
        ngx_loom_store(&q->spin_cpu, sched_getcpu());

        for (n = 1; ngx_loom_load(&q->npending) == 0
                    && !ngx_loom_load(&q->closed); n++)
        {
            ngx_loom_cpu_relax();

            if ((n & 63) == 0) {
                if (ngx_loom_offload_now_ns() >= deadline) {
                    break;
                }

                /* where the spinner runs, for the event loop's poll */
                ngx_loom_store(&q->spin_cpu, sched_getcpu());

                /* let whatever else wants this CPU run (nginx, say) */
                sched_yield();
            }
        }

        /* how long the spin lasted: deadline is its start plus spin */
        now = ngx_loom_offload_now_ns();

        /*
         * the submitter that queued the task may still hold the mutex
         * for a few instructions: blocking on it now would cost its
         * unlock a futex wake-up, on the event loop's CPU time
         */
        for (n = 0; pthread_mutex_trylock(&q->mtx) != 0; n++) {
            if (n == LOOM_LOCK_SPINS) {
                pthread_mutex_lock(&q->mtx);
                break;
            }

            ngx_loom_cpu_relax();
        }

        q->spinners--;

        if (!ngx_queue_empty(&q->pending)
            && now + spin - deadline <= LOOM_SPIN_PAYS_NS)
        {
            q->spin_cur_ns = q->spin_ns;

        } else {
            q->spin_cur_ns /= 2;

            if (q->spin_cur_ns < 1000) {
                q->spin_cur_ns = 0;
            }
        }
    }

    deadline = 0;
    now = 0;

    if (timeout_ms > 0) {
        now = ngx_loom_offload_now_ns();
        deadline = now + (uint64_t) timeout_ms * 1000000;
        ts.tv_sec = deadline / 1000000000;
        ts.tv_nsec = deadline % 1000000000;
    }

    while (ngx_queue_empty(&q->pending)) {

        if (q->closed) {
            pthread_mutex_unlock(&q->mtx);
            return LOOM_OFFLOAD_CLOSED;
        }

        if (timeout_ms == 0) {
            pthread_mutex_unlock(&q->mtx);
            return LOOM_OFFLOAD_TIMEDOUT;
        }

        if (q->spin_ns && now == 0) {
            now = ngx_loom_offload_now_ns();
        }

        slept = 1;
        q->sleepers++;

        if (timeout_ms < 0) {
            rc = pthread_cond_wait(&q->cond, &q->mtx);

        } else {
            rc = pthread_cond_timedwait(&q->cond, &q->mtx, &ts);
        }

        q->sleepers--;

        if (q->waking) {
            q->waking--;
        }

        if (rc == ETIMEDOUT && ngx_queue_empty(&q->pending)) {
            rc = q->closed ? LOOM_OFFLOAD_CLOSED : LOOM_OFFLOAD_TIMEDOUT;
            pthread_mutex_unlock(&q->mtx);
            return rc;
        }
    }

    if (slept && q->spin_ns && q->spin_cur_ns < q->spin_ns
        && ngx_loom_offload_now_ns() - now < q->spin_ns)
    {
        /* the task came within the spin window: spinning pays again */
        q->spin_cur_ns = q->spin_ns;
    }

    x = ngx_queue_head(&q->pending);
    ngx_queue_remove(x);

    t = ngx_queue_data(x, loom_offload_task_t, pending);
    t->where = LOOM_WHERE_TAKEN;

    h = ngx_loom_offload_held_stripe(t);
    pthread_mutex_lock(&h->mtx);
    t->held_next = h->tasks;
    h->tasks = t;
    pthread_mutex_unlock(&h->mtx);

    ngx_loom_store(&q->npending, q->npending - 1);
    ngx_loom_store(&q->taken, q->taken + 1);

    now = ngx_loom_offload_now_ns();

    t->take_ns = now;
    q->busy++;
    q->progress_ns = now;

    pthread_mutex_unlock(&q->mtx);

    ngx_loom_offload_tls_q = q;
    ngx_loom_offload_tls_ns = now;

    *task = t;

    return LOOM_OFFLOAD_TASK;
}


/* a runtime thread came back from a task (under the queue mutex) */
static void
ngx_loom_offload_back(loom_offload_queue_t *q, uint64_t now)
{
    uint64_t  d;

    if (q->busy) {
        q->busy--;
    }

    d = now > ngx_loom_offload_tls_ns ? now - ngx_loom_offload_tls_ns : 0;

    q->svc_ns = q->svc_ns - q->svc_ns / 8 + d / 8;
    q->progress_ns = now;
}


/*
 * How many sleeping threads to wake for the tasks queued (under the
 * queue mutex). Waking costs a futex call on each side and often a
 * wake-up on the other CPU, so tasks the awake threads will soon be back
 * for (a fast runtime, a short backlog) are left to them: enough threads
 * are woken to take the queue within about one wake-up's time, judged by
 * the average service time. A thread busy for longer than that (a slow
 * or stuck task) gets help.
 */
static ngx_uint_t
ngx_loom_offload_wakes(loom_offload_queue_t *q, uint64_t now)
{
    ngx_uint_t  n, gap, idle, awake, want;

    if (q->closed
        || q->sleepers <= q->waking
        || q->npending <= q->spinners + q->waking)
    {
        return 0;
    }

    gap = q->npending - q->spinners - q->waking;
    idle = q->sleepers - q->waking;
    awake = q->busy + q->spinners + q->waking;

    want = (ngx_uint_t) ((q->svc_ns * q->npending) / LOOM_WAKE_NS) + 1;

    n = want > awake ? want - awake : 0;

    if (n == 0 && q->busy
        && now > q->progress_ns && now - q->progress_ns > LOOM_WAKE_NS)
    {
        n = 1;
    }

    n = ngx_min(n, gap);

    return ngx_min(n, idle);
}


/*
 * Wakes sleeping threads for queued tasks (a posted event at the end of
 * the event loop iteration that queued them, and a timer while tasks are
 * left to busy threads, in case those are not back as soon as expected)
 */
void
ngx_loom_offload_kick_handler(ngx_event_t *ev)
{
    uint64_t               now;
    ngx_uint_t             n, left;
    loom_offload_queue_t  *q;

    q = ev->data;
    now = ngx_loom_offload_now_ns();

    pthread_mutex_lock(&q->mtx);

    n = ngx_loom_offload_wakes(q, now);
    q->waking += n;

    left = !q->closed
           && q->sleepers > q->waking
           && q->npending > q->spinners + q->waking;

    pthread_mutex_unlock(&q->mtx);

    /* after the unlock, as in ngx_loom_offload_ffi_submit */
    while (n--) {
        pthread_cond_signal(&q->cond);
    }

    if (left && !q->wake_ev.timer_set) {
        ngx_add_timer(&q->wake_ev, LOOM_WAKE_CHECK_MS);
    }
}


/*
 * The wait timed out. Returns 1 when the result arrived anyway (in the
 * same event loop iteration): the caller then reads it as usual.
 * Otherwise marks the task cancelled and lets go of it; returns 0.
 */
int
ngx_loom_offload_ffi_cancel(loom_offload_task_t *t)
{
    if (t->resolved) {
        return 1;
    }

    t->queue->timeouts++;

    ngx_loom_store(&t->cancelled, 1);

    if (t->in_request) {
        ngx_queue_remove(&t->rlink);
        t->in_request = 0;
    }

    t->lua = 0;

    ngx_loom_offload_unpend(t);

    if (!t->rt) {
        ngx_loom_offload_discard(t);

    } else {
        ngx_loom_offload_overdue(t);
    }

    return 0;
}


void
ngx_loom_offload_request_cleanup(void *data)
{
    ngx_loom_offload_rctx_t  *rctx = data;

    ngx_queue_t          *x;
    loom_offload_task_t  *t;

    while (!ngx_queue_empty(&rctx->tasks)) {
        x = ngx_queue_head(&rctx->tasks);
        ngx_queue_remove(x);

        t = ngx_queue_data(x, loom_offload_task_t, rlink);
        t->in_request = 0;
        t->lua = 0;

        if (!t->resolved) {
            t->queue->aborted++;
        }

        ngx_loom_store(&t->cancelled, 1);
        ngx_loom_offload_unpend(t);

        if (!t->rt) {
            /*
             * the coroutine may still sit in the semaphore's wait queue
             * until lua-nginx-module's own cleanup runs
             */
            ngx_loom_offload_discard(t);

        } else {
            ngx_loom_offload_overdue(t);
        }
    }
}


/* takes a task off its queue if no runtime thread has taken it yet */
void
ngx_loom_offload_unpend(loom_offload_task_t *t)
{
    loom_offload_queue_t  *q;

    q = t->queue;

    if (!t->rt) {
        return;
    }

    pthread_mutex_lock(&q->mtx);

    if (t->where == LOOM_WHERE_PENDING) {
        ngx_queue_remove(&t->pending);
        t->where = LOOM_WHERE_NONE;
        ngx_loom_store(&q->npending, q->npending - 1);
        t->rt = 0;
    }

    pthread_mutex_unlock(&q->mtx);
}


/*
 * Closes the queue itself: sleeping runtime threads wake to "closed", and
 * tasks no thread took yet are the runtime's no more. NGX_DECLINED when
 * it was closed already
 */
ngx_int_t
ngx_loom_offload_queue_close(loom_offload_queue_t *q)
{
    ngx_queue_t          *x;
    loom_offload_task_t  *t;

    if (q->wake_ev.timer_set) {
        ngx_del_timer(&q->wake_ev);
    }

    if (q->kick_ev.posted) {
        ngx_delete_posted_event(&q->kick_ev);
    }

    pthread_mutex_lock(&q->mtx);

    if (q->closed) {
        pthread_mutex_unlock(&q->mtx);
        return NGX_DECLINED;
    }

    ngx_loom_store(&q->closed, 1);

    while (!ngx_queue_empty(&q->pending)) {
        x = ngx_queue_head(&q->pending);
        ngx_queue_remove(x);
        t = ngx_queue_data(x, loom_offload_task_t, pending);
        t->where = LOOM_WHERE_NONE;
        t->rt = 0;
    }

    ngx_loom_store(&q->npending, 0);

    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->mtx);

    return NGX_OK;
}


const unsigned char *
ngx_loom_offload_request(loom_offload_task_t *t, size_t *len)
{
    if (len) {
        *len = t->req_len;
    }

    return t->data;
}


int
ngx_loom_offload_cancelled(loom_offload_task_t *t)
{
    return ngx_loom_load(&t->cancelled) != 0;
}


/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
