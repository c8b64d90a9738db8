
/*
 * Copyright (C) resty-loom authors
 *
 * Offload completion: how an answer gets from a runtime thread back into
 * the event loop. host->answer() copies the response into the task and
 * pushes the task on the worker's lock-free completion list, writing the
 * worker's eventfd only when that list was empty. The eventfd sits in the
 * nginx event loop on a connection of its own; its read handler drains
 * the list and posts the calls' semaphores on the main thread. A call
 * that expects a fast answer may instead poll for it right after
 * submission (ngx_loom_offload_ffi_poll), and the answer is then handed
 * over without the eventfd. The connection is marked idle, so that nginx
 * tells us when a graceful shutdown begins (ngx_loom_offload_exiting).
 * A runtime's start-up result comes the same way, so starting, exiting
 * and closing a runtime (ngx_loom_offload_close: pending and waiting
 * calls get "closed") are here too.
 *
 * Layer 2 of the offload files (ngx_loom_offload.c lists them): called by
 * ngx_loom_offload.c; calls queue.c, task.c and stats.c, never up.
 */


#include "ngx_loom_offload.h"
#include <sys/eventfd.h>
#include <sched.h>


/* the event loop polling for an answer (ngx_loom_offload_ffi_poll) */
#define LOOM_FAST_NONE               0
#define LOOM_FAST_POLLING            1
#define LOOM_FAST_ANSWERED           2

/* answer status used internally when the response copy failed */
#define LOOM_STATUS_NOMEM            (-1)

/* at most this many calls skip the poll after polls that missed */
#define LOOM_POLL_BACKOFF_MAX        256


static void ngx_loom_offload_read_handler(ngx_event_t *rev);
static void ngx_loom_offload_done(loom_offload_task_t *t);
static void ngx_loom_offload_started(loom_offload_queue_t *q);
static void ngx_loom_offload_exiting(ngx_uint_t now);
static void ngx_loom_offload_avg(uint64_t *avg, int64_t sample,
    uint64_t cap);

/* FFI entry points */
int ngx_loom_offload_ffi_poll(loom_offload_task_t *t);
int ngx_loom_offload_ffi_result(loom_offload_task_t *t, u_char **data,
    size_t *len);


int
ngx_loom_offload_answer(loom_offload_task_t *t, int status,
    const void *data, size_t len)
{
    int                        rc;
    u_char                    *p;
    loom_offload_task_t      **pt;
    loom_offload_queue_t      *q;
    ngx_loom_offload_held_t   *h;

    h = ngx_loom_offload_held_stripe(t);

    pthread_mutex_lock(&h->mtx);

    pt = ngx_loom_offload_held_find(h, t);
    if (pt != NULL) {
        *pt = t->held_next;
    }

    pthread_mutex_unlock(&h->mtx);

    if (pt == NULL) {
        /*
         * not a task this thread's runtime holds: t may be freed, or
         * another call's by now, so it is not looked at. The queue this
         * thread took its last task from names the runtime, if any
         */
        q = ngx_loom_offload_tls_q;

        ngx_log_error(NGX_LOG_ERR, ngx_cycle->log, 0,
                      "[loom.offload] %s: answer() for a task the runtime "
                      "does not hold (answered twice, or never taken): "
                      "ignored", q ? q->path : "a runtime");

        if (q != NULL) {
            (void) __atomic_fetch_add(&q->misused, 1, __ATOMIC_RELAXED);
        }

        return -1;
    }

    q = t->queue;
    rc = 0;

    if (status != LOOM_OFFLOAD_OK) {
        status = LOOM_OFFLOAD_ERROR;
    }

    if (data == NULL && len) {
        ngx_log_error(NGX_LOG_ERR, ngx_cycle->log, 0,
                      "[loom.offload] %s: answer() with NULL data and "
                      "length %uz: the call fails", q->path, len);

        data = "invalid answer: NULL data with a length";
        len = sizeof("invalid answer: NULL data with a length") - 1;
        status = LOOM_OFFLOAD_ERROR;
        rc = -1;
        (void) __atomic_fetch_add(&q->misused, 1, __ATOMIC_RELAXED);
    }

    if (ngx_loom_load(&t->cancelled)) {
        /* nobody waits: do not copy */
        t->rsp = NULL;
        len = 0;

    } else if (len < t->cap) {
        /* the request bytes are not needed any more: reuse their room */
        if (len && data != t->data) {
            memmove(t->data, data, len);
        }

        t->rsp = t->data;

    } else {
        p = malloc(len);

        if (p == NULL) {
            status = LOOM_STATUS_NOMEM;
            len = 0;
            rc = -1;

        } else {
            memcpy(p, data, len);
            t->rsp_heap = 1;
        }

        t->rsp = p;
    }

    t->rsp_len = len;
    t->status = status;
    t->answer_ns = ngx_loom_offload_now_ns();

    if (ngx_loom_load(&t->fast) == LOOM_FAST_POLLING) {
        int  polling = LOOM_FAST_POLLING;

        /* the event loop is polling for this very answer: hand it over */
        if (__atomic_compare_exchange_n(&t->fast, &polling,
                                        LOOM_FAST_ANSWERED, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        {
            return rc;
        }
    }

    ngx_loom_offload_publish(t);

    return rc;
}


/* hands a finished task (or a start-up result) to the event loop */
void
ngx_loom_offload_publish(loom_offload_task_t *t)
{
    uint64_t                    one;
    loom_offload_task_t        *head;
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;

    /* a lock-free push; the event loop takes the whole list at once */

    head = __atomic_load_n(&w->done, __ATOMIC_RELAXED);

    do {
        t->next = head;
    } while (!__atomic_compare_exchange_n(&w->done, &head, t, 1,
                                          __ATOMIC_RELEASE,
                                          __ATOMIC_RELAXED));

    if (head != NULL) {
        /* not the first since the event loop took the list: signalled */
        return;
    }

    pthread_mutex_lock(&w->lock);

    if (w->fd != -1) {
        one = 1;

        /*
         * under the lock: exit_process closes fd under it too. An
         * eventfd write fails only when its counter would overflow,
         * which reads every 65536 wake-ups at most rule out
         */
        if (write(w->fd, &one, sizeof(uint64_t)) != sizeof(uint64_t)) {
            /* void */
        }
    }

    pthread_mutex_unlock(&w->lock);
}


/* the eventfd answers wake the event loop with */
ngx_int_t
ngx_loom_offload_channel_open(u_char *err, size_t *errlen)
{
    int                         fd;
    ngx_connection_t           *c;
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;

    fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd == -1) {
        *errlen = ngx_snprintf(err, *errlen, "eventfd() failed: %d",
                               ngx_errno)
                  - err;
        return NGX_ERROR;
    }

    c = ngx_get_connection(fd, ngx_cycle->log);
    if (c == NULL) {
        close(fd);
        *errlen = ngx_snprintf(err, *errlen, "no free connection") - err;
        return NGX_ERROR;
    }

    c->read->handler = ngx_loom_offload_read_handler;
    c->read->log = ngx_cycle->log;
    c->write->log = ngx_cycle->log;

    /* nginx calls the read handler with c->close set at graceful exit */
    c->idle = 1;

    /*
     * edge-triggered where the event method can (epoll): every write is a
     * new event, so the counter needs reading only now and then, as
     * nginx's own notification eventfd does
     */
    w->edge = (ngx_event_flags & NGX_USE_CLEAR_EVENT) ? 1 : 0;

    if (ngx_add_event(c->read, NGX_READ_EVENT,
                      w->edge ? NGX_CLEAR_EVENT : NGX_LEVEL_EVENT)
        != NGX_OK)
    {
        ngx_free_connection(c);
        close(fd);
        *errlen = ngx_snprintf(err, *errlen, "failed to add the eventfd")
                  - err;
        return NGX_ERROR;
    }

    w->conn = c;

    pthread_mutex_lock(&w->lock);
    w->fd = fd;
    pthread_mutex_unlock(&w->lock);

    return NGX_OK;
}


/* answers that come after this are dropped: nobody reads them any more */
void
ngx_loom_offload_channel_close(void)
{
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;

    pthread_mutex_lock(&w->lock);

    if (w->conn) {
        ngx_close_connection(w->conn);
        w->conn = NULL;
    }

    w->fd = -1;

    pthread_mutex_unlock(&w->lock);
}


static void
ngx_loom_offload_read_handler(ngx_event_t *rev)
{
    uint64_t                    v;
    ngx_connection_t           *c;
    loom_offload_task_t        *t, *next, *list;
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;
    c = rev->data;

    if (c->close) {
        /* graceful shutdown began, or the shutdown timer fired */
        c->close = 0;
        c->idle = 0;

        ngx_loom_offload_exiting(c->error);
        c->error = 0;
    }

    if ((!w->edge || (++w->wakeups & 0xffff) == 0)
        && read(w->fd, &v, sizeof(uint64_t)) == -1
        && ngx_errno != NGX_EAGAIN)
    {
        ngx_log_error(NGX_LOG_ALERT, rev->log, ngx_errno,
                      "[loom.offload] eventfd read() failed");
    }

    /* the next answer published after this writes the eventfd again */
    list = __atomic_exchange_n(&w->done, NULL, __ATOMIC_ACQUIRE);

    /* the list is newest first: reverse it */
    t = NULL;

    while (list) {
        next = list->next;
        list->next = t;
        t = list;
        list = next;
    }

    while (t) {
        next = t->next;

        if (t->control) {
            ngx_loom_offload_started(t->queue);

        } else {
            ngx_loom_offload_done(t);
        }

        t = next;
    }
}


/* an answer reached the main thread */
static void
ngx_loom_offload_done(loom_offload_task_t *t)
{
    loom_offload_queue_t  *q;

    q = t->queue;

    t->where = LOOM_WHERE_NONE;
    t->rt = 0;
    q->answered++;

    if (t->in_overdue) {
        ngx_queue_remove(&t->overdue);
        t->in_overdue = 0;
    }

    if (t->reclaimed) {
        q->reclaimed_held--;
    }

    /*
     * what the event loop would have had to poll for: how long a thread
     * took to pick the task up (one awake, or one woken) and how long it
     * took to answer. Samples are capped, so that one preempted thread
     * does not turn polling off for long
     */
    if (t->take_ns) {
        ngx_loom_offload_queue_wait(q, (t->take_ns - t->start_ns) / 1000);

        ngx_loom_offload_avg(&q->ewma_ns, t->answer_ns - t->take_ns,
                             2 * q->poll_ns);
        if (t->kick || t->woke) {
            ngx_loom_offload_avg(&q->wake_ns, t->take_ns - t->start_ns,
                                 2 * LOOM_WAKE_POLL * q->poll_ns);

        } else {
            ngx_loom_offload_avg(&q->pick_ns, t->take_ns - t->start_ns,
                                 2 * q->poll_ns);
        }
    }

    if (t->lua && !t->resolved) {

        if (t->status == LOOM_OFFLOAD_OK) {
            ngx_loom_offload_resolve(t, LOOM_RESULT_OK);

        } else if (t->status == LOOM_STATUS_NOMEM) {
            ngx_loom_offload_resolve(t, LOOM_RESULT_NOMEM);

        } else {
            ngx_loom_offload_resolve(t, LOOM_RESULT_ERROR);
        }

    } else {
        q->late++;
    }

    if (!t->lua) {
        ngx_loom_offload_task_free(t);
    }
}


static void
ngx_loom_offload_avg(uint64_t *avg, int64_t sample, uint64_t cap)
{
    uint64_t  v;

    v = sample > 0 ? (uint64_t) sample : 0;

    if (v > cap) {
        v = cap;
    }

    *avg = *avg - *avg / 8 + v / 8;
}


void
ngx_loom_offload_resolve(loom_offload_task_t *t, int result)
{
    uint64_t               us;
    loom_offload_queue_t  *q;

    q = t->queue;

    t->result = result;
    t->resolved = 1;

    switch (result) {

    case LOOM_RESULT_OK:
        q->completed++;
        break;

    case LOOM_RESULT_CLOSED:
        q->closed_calls++;
        break;

    default:
        q->errors++;
        break;
    }

    if (result != LOOM_RESULT_CLOSED) {
        q->resolved_ns = ngx_loom_offload_now_ns();
        us = (q->resolved_ns - t->start_ns) / 1000;
        ngx_loom_offload_latency(q, us);
    }

    if (t->sem) {
        (void) ngx_loom_offload_w.sema_post(t->sem, 1);
    }
}


/* the start-up result reached the main thread */
static void
ngx_loom_offload_started(loom_offload_queue_t *q)
{
    if (q->start_rc == 0) {
        q->started = 1;

        if (q->state == LOOM_OFFLOAD_STARTING) {
            q->state = LOOM_OFFLOAD_READY;
        }

        ngx_log_debug1(NGX_LOG_DEBUG_CORE, ngx_cycle->log, 0,
                       "[loom.offload] %s started", q->path);
        return;
    }

    ngx_log_error(NGX_LOG_ERR, ngx_cycle->log, 0,
                  "[loom.offload] failed to start %s: %s", q->path, q->err);

    ngx_loom_offload_close(q);
    q->state = LOOM_OFFLOAD_FAILED;
}


/* closes a queue: pending and waiting calls get "closed" */
void
ngx_loom_offload_close(loom_offload_queue_t *q)
{
    ngx_queue_t          *x, *next;
    loom_offload_task_t  *t;

    if (q->grace_ev.timer_set) {
        ngx_del_timer(&q->grace_ev);
    }

    if (q->reclaim_ev.timer_set) {
        ngx_del_timer(&q->reclaim_ev);
    }

    if (ngx_loom_offload_queue_close(q) != NGX_OK) {
        return;
    }

    if (q->state != LOOM_OFFLOAD_FAILED) {
        q->state = LOOM_OFFLOAD_CLOSING;
    }

    for (x = ngx_queue_head(&q->live);
         x != ngx_queue_sentinel(&q->live);
         x = next)
    {
        next = ngx_queue_next(x);
        t = ngx_queue_data(x, loom_offload_task_t, live);

        if (t->rt) {
            ngx_loom_store(&t->cancelled, 1);
        }

        if (t->lua && !t->resolved) {
            ngx_loom_offload_resolve(t, LOOM_RESULT_CLOSED);
        }

        if (!t->lua && !t->rt && !t->garbage) {
            ngx_loom_offload_task_free(t);
        }
    }
}


void
ngx_loom_offload_grace_handler(ngx_event_t *ev)
{
    loom_offload_queue_t  *q;

    q = ev->data;

    ngx_log_error(NGX_LOG_INFO, ev->log, 0,
                  "[loom.offload] %s: grace period over, closing", q->path);

    ngx_loom_offload_close(q);
}


static void
ngx_loom_offload_exiting(ngx_uint_t now)
{
    ngx_queue_t                *x;
    loom_offload_queue_t       *q;
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;
    w->exiting = 1;

    for (x = ngx_queue_head(&w->queues);
         x != ngx_queue_sentinel(&w->queues);
         x = ngx_queue_next(x))
    {
        q = ngx_queue_data(x, loom_offload_queue_t, link);

        if (q->closed) {
            continue;
        }

        if (now || q->grace == 0) {
            ngx_loom_offload_close(q);
            continue;
        }

        if (!q->grace_ev.timer_set) {
            ngx_add_timer(&q->grace_ev, q->grace);
        }
    }
}


/*
 * Right after a submission: when the runtime was idle and recent tasks
 * were picked up and answered within poll_us (decided at submission, see
 * ngx_loom_offload_may_poll), the event loop polls for the answer for up
 * to poll_us instead of going to sleep in epoll_wait() and being woken up
 * by the eventfd from another CPU (up to LOOM_WAKE_POLL times poll_us
 * for a call of a sequence that had to wake a runtime thread: one
 * wake-up instead of two). Returns 1 when the answer came (the
 * task is resolved; read it with ffi_result), else 0: wait on the
 * semaphore as usual.
 */
int
ngx_loom_offload_ffi_poll(loom_offload_task_t *t)
{
    int                    polling;
    void                  *sem;
    uint64_t               deadline;
    ngx_uint_t             n;
    loom_offload_queue_t  *q;

    q = t->queue;

    if (!t->poll) {
        return 0;
    }

    if (!t->woke && ngx_loom_load(&q->spin_cpu) == sched_getcpu()) {
        /*
         * the spinning runtime thread was last seen on this very CPU:
         * it can take the task only once the event loop gives the CPU
         * up, so polling would only delay the answer. Not a miss: the
         * back-off is for polls that hold a CPU the thread needs
         * elsewhere, and polls resume as soon as the thread runs on
         * the other CPU
         */
        return 0;
    }

    q->polled++;

    ngx_loom_store(&t->fast, LOOM_FAST_POLLING);

    deadline = ngx_loom_offload_now_ns()
               + (t->wake_poll ? LOOM_WAKE_POLL * q->poll_ns : q->poll_ns);

    for (n = 1; ngx_loom_load(&t->fast) == LOOM_FAST_POLLING; n++) {
        ngx_loom_cpu_relax();

        if ((n & 15) == 0 && ngx_loom_offload_now_ns() >= deadline) {
            polling = LOOM_FAST_POLLING;

            if (__atomic_compare_exchange_n(&t->fast, &polling,
                                            LOOM_FAST_NONE, 0,
                                            __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE))
            {
                /*
                 * too slow: the answer's times, when it comes, go into
                 * the averages that decide whether to poll next time.
                 * Polls that keep missing while answers that are not
                 * polled for come fast mean the poll itself holds the
                 * CPU the runtime thread needs (a loaded machine): back
                 * off, doubling the number of calls not polled for
                 */
                q->poll_backoff = q->poll_backoff
                                  ? ngx_min(2 * q->poll_backoff,
                                            LOOM_POLL_BACKOFF_MAX)
                                  : 1;
                q->poll_skip = q->poll_backoff;

                return 0;
            }

            break;
        }
    }

    /* answered in our hands: complete it here, nobody waits on sem */

    q->polled_hits++;
    q->poll_backoff = 0;

    sem = t->sem;
    t->sem = NULL;
    ngx_loom_offload_done(t);
    t->sem = sem;

    return 1;
}


int
ngx_loom_offload_ffi_result(loom_offload_task_t *t, u_char **data,
    size_t *len)
{
    *data = t->rsp;
    *len = t->rsp_len;

    if (t->result == LOOM_RESULT_CLOSED || t->result == LOOM_RESULT_NOMEM) {
        *data = NULL;
        *len = 0;
    }

    return t->result;
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
