
/*
 * Copyright (C) resty-loom authors
 *
 * Who holds an offload task, and when it is freed. A task has up to two
 * owners: Lua (until the call returns, times out, or its request goes
 * away) and the runtime (from submission until the answer reaches the
 * main thread). It is freed when neither holds it, at the end of the
 * event loop iteration, so late answers are dropped, never delivered to
 * another call. A task Lua gave up on that a runtime thread still holds
 * is reclaimed (no longer counted as running) after the queue's reclaim
 * time, and the heap a burst of tasks left behind is given back. The held
 * set, the tasks runtime threads have taken and not answered, is here.
 *
 * Layer 4 of the offload files (ngx_loom_offload.c lists them): called by
 * the files above; calls none of them. The worker's state every layer
 * reads, ngx_loom_offload_w, is defined here, at the bottom, not in
 * ngx_loom_offload.c, which the layers would otherwise refer up to.
 */


#include "ngx_loom_offload.h"
#include <malloc.h>


/*
 * after a burst of at least this many tasks alive at once, the worker
 * gives the freed heap back to the system LOOM_TRIM_DELAY ms after 7/8 of
 * them are gone (later, so that the requests that made the calls are
 * freed too): malloc keeps it otherwise, 50,000 calls in flight left
 * ~50 MB
 */
#define LOOM_TRIM_TASKS              4096
#define LOOM_TRIM_DELAY              1000

/*
 * tasks runtime threads hold (taken, not answered), by address: answer()
 * checks a task against them before it touches it, so that a second
 * answer, or an answer for something never taken, is refused and logged
 * instead of corrupting the worker. Striped to keep answers from
 * different threads apart
 */
#define LOOM_HELD_STRIPES            64


static void ngx_loom_offload_held_mutexes(void);

/* FFI entry points */
void ngx_loom_offload_ffi_release(loom_offload_task_t *t);


ngx_loom_offload_worker_t  ngx_loom_offload_w = {
    PTHREAD_MUTEX_INITIALIZER, NULL, -1,
    0, 0, 0, 0, NULL, { NULL, NULL }, NULL,
    { 0 }, 0, 0, { 0 }, NULL, NULL, NULL
};

static ngx_loom_offload_held_t  ngx_loom_offload_held[LOOM_HELD_STRIPES];
static pthread_once_t           ngx_loom_offload_held_once = PTHREAD_ONCE_INIT;


/* Lua is done with the task (it has read the result) */
void
ngx_loom_offload_ffi_release(loom_offload_task_t *t)
{
    if (t->in_request) {
        ngx_queue_remove(&t->rlink);
        t->in_request = 0;
    }

    t->lua = 0;

    /*
     * else resolved as "closed" while a runtime thread still holds it:
     * freed with its semaphore when the answer comes
     */
    if (!t->rt) {
        ngx_loom_offload_discard(t);

    } else {
        ngx_loom_offload_overdue(t);
    }
}


/*
 * Frees a task nobody holds any more at the end of this event loop
 * iteration, not now: a call returns to Lua from inside its semaphore's
 * event handler, which reads the semaphore again after the coroutine
 * yields, and lua-nginx-module frees a whole block of semaphores (4,095)
 * when its last one comes back. Returning the semaphore there crashed
 * workers with more than two blocks of calls in flight
 */
void
ngx_loom_offload_discard(loom_offload_task_t *t)
{
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;

    t->garbage = 1;
    t->next = w->garbage;
    w->garbage = t;

    if (!w->gc_event.posted) {
        ngx_post_event(&w->gc_event, &ngx_posted_events);
    }
}


void
ngx_loom_offload_gc_handler(ngx_event_t *ev)
{
    loom_offload_task_t        *t, *next;
    ngx_loom_offload_worker_t  *w;

    w = ev->data;

    t = w->garbage;
    w->garbage = NULL;

    while (t) {
        next = t->next;
        ngx_loom_offload_task_free(t);
        t = next;
    }
}


void
ngx_loom_offload_task_free(loom_offload_task_t *t)
{
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;

    ngx_queue_remove(&t->live);

    if (t->in_overdue) {
        ngx_queue_remove(&t->overdue);
    }

    if (t->in_request) {
        ngx_queue_remove(&t->rlink);
    }

    if (t->sem) {
        ngx_loom_offload_w.sema_gc(t->sem);
    }

    if (t->rsp_heap) {
        free(t->rsp);
    }

    free(t);

    w->tasks--;

    if (w->tasks_peak >= LOOM_TRIM_TASKS && w->tasks <= w->tasks_peak / 8
        && !w->trim_ev.timer_set && !w->exiting)
    {
        ngx_add_timer(&w->trim_ev, LOOM_TRIM_DELAY);
    }
}


void
ngx_loom_offload_trim_handler(ngx_event_t *ev)
{
    ngx_loom_offload_worker_t  *w;

    w = ev->data;

    (void) malloc_trim(0);
    w->tasks_peak = w->tasks;
}


/*
 * Lua gave up on a task a runtime thread holds: unless answered within
 * the queue's reclaim time, it is reclaimed (no longer "running", logged)
 */
void
ngx_loom_offload_overdue(loom_offload_task_t *t)
{
    loom_offload_queue_t  *q;

    q = t->queue;

    if (t->in_overdue || q->reclaim == 0) {
        return;
    }

    t->in_overdue = 1;
    t->overdue_at = ngx_current_msec + q->reclaim;

    /* one reclaim time per queue: the list stays in deadline order */
    ngx_queue_insert_tail(&q->overdue, &t->overdue);

    if (!q->reclaim_ev.timer_set) {
        ngx_add_timer(&q->reclaim_ev, q->reclaim);
    }
}


void
ngx_loom_offload_reclaim_handler(ngx_event_t *ev)
{
    ngx_queue_t               *x;
    loom_offload_task_t       *t;
    loom_offload_queue_t      *q;
    ngx_loom_offload_held_t   *h;

    q = ev->data;

    while (!ngx_queue_empty(&q->overdue)) {
        x = ngx_queue_head(&q->overdue);
        t = ngx_queue_data(x, loom_offload_task_t, overdue);

        if ((ngx_msec_int_t) (t->overdue_at - ngx_current_msec) > 0) {
            ngx_add_timer(ev, t->overdue_at - ngx_current_msec);
            return;
        }

        ngx_queue_remove(x);
        t->in_overdue = 0;

        h = ngx_loom_offload_held_stripe(t);

        pthread_mutex_lock(&h->mtx);

        /* not held any more: answered, on its way to the event loop */
        if (ngx_loom_offload_held_find(h, t) != NULL) {
            t->reclaimed = 1;
        }

        pthread_mutex_unlock(&h->mtx);

        if (t->reclaimed) {
            q->reclaimed++;
            q->reclaimed_held++;

            ngx_log_error(NGX_LOG_ERR, ev->log, 0,
                          "[loom.offload] %s: a task was not answered "
                          "within %M ms after its call gave up: no longer "
                          "counted as running (a runtime thread is stuck, "
                          "or the runtime lost the task)",
                          q->path, q->reclaim);
        }
    }
}


/* once per process: a worker whose set-up failed tries again */
void
ngx_loom_offload_held_init(void)
{
    (void) pthread_once(&ngx_loom_offload_held_once,
                        ngx_loom_offload_held_mutexes);
}


static void
ngx_loom_offload_held_mutexes(void)
{
    ngx_uint_t  i;

    for (i = 0; i < LOOM_HELD_STRIPES; i++) {
        (void) pthread_mutex_init(&ngx_loom_offload_held[i].mtx, NULL);
    }
}


ngx_loom_offload_held_t *
ngx_loom_offload_held_stripe(loom_offload_task_t *t)
{
    uintptr_t  a;

    a = (uintptr_t) t;

    return &ngx_loom_offload_held[(a >> 6 ^ a >> 12) % LOOM_HELD_STRIPES];
}


/* the link pointing at t in its stripe, or NULL; under the stripe lock */
loom_offload_task_t **
ngx_loom_offload_held_find(ngx_loom_offload_held_t *h,
    loom_offload_task_t *t)
{
    loom_offload_task_t  **pt;

    for (pt = &h->tasks; *pt; pt = &(*pt)->held_next) {
        if (*pt == t) {
            return pt;
        }
    }

    return NULL;
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
