
/*
 * Copyright (C) resty-loom authors
 *
 * resty.loom.offload, the nginx side: per-worker bounded task queues that
 * offload runtimes (include/loom_offload.h) take tasks from on their own
 * threads, and a completion channel back to the event loop. Lua submits
 * a task and waits on a semaphore made with lua-nginx-module's public FFI
 * functions (ngx_http_lua_ffi_sema_*, resolved with dlsym); a runtime
 * thread takes it, runs it and answers from any thread.
 *
 * This file is the top layer, the module's face: the module, the FFI
 * entry points that load, query and close a runtime, and the host table
 * runtimes call. Each runtime is dlopen()ed and initialised on a start-up
 * thread with all signals blocked (never on the event loop), closed on
 * request or when its grace period after a graceful shutdown began is
 * over (waiting calls then get "closed"), and shut down at worker exit on
 * helper threads with a bounded wait.
 *
 * The offload files are layers sharing ngx_loom_offload.h. A file calls
 * only files below it, never one above, and no file gives a lower one a
 * function to call back: an event's handler lives in the file that arms
 * the event. Lua calls each file's FFI entry points directly:
 *
 *   1 ngx_loom_offload.c             this file
 *   2 ngx_loom_offload_completion.c  host->answer() to the event loop and
 *                                    how calls end: the completion list,
 *                                    the eventfd, polling, results; a
 *                                    runtime started, closed, exiting
 *   3 ngx_loom_offload_queue.c       the task queue: submit, cancel,
 *                                    host->wait(), waking runtime threads
 *   4 ngx_loom_offload_task.c        who holds a task, when it is freed;
 *                                    the worker's state
 *   5 ngx_loom_offload_stats.c       the latency histogram, rt:stats()
 *   - ngx_loom_offload_sigchld.c     nginx's SIGCHLD handler kept off the
 *                                    children of runtime threads: a leaf
 *                                    only this file calls
 */


#include "ngx_loom_offload.h"
#include <dlfcn.h>
#include <signal.h>


static void ngx_loom_offload_exit_process(ngx_cycle_t *cycle);
static ngx_int_t ngx_loom_offload_worker_init(u_char *err, size_t *errlen);
static void *ngx_loom_offload_start_thread(void *data);
static void *ngx_loom_offload_shutdown_thread(void *data);
static int ngx_loom_offload_spawn(void *(*fn)(void *), void *data);

/* host->log(); the rest of the host table: queue.c, completion.c */
static void ngx_loom_offload_log(loom_offload_queue_t *q, int level,
    const char *msg, size_t len);

/* FFI entry points */
int ngx_loom_offload_ffi_load(const char *path, const char *config,
    size_t config_len, int threads, int bound, int grace_ms, int spin_us,
    int poll_us, int reclaim_ms, int global, loom_offload_queue_t **out,
    u_char *err, size_t *errlen);
int ngx_loom_offload_ffi_state(loom_offload_queue_t *q, char **err);
int ngx_loom_offload_ffi_close(loom_offload_queue_t *q);


static ngx_http_module_t  ngx_loom_offload_module_ctx = {
    NULL,                              /* preconfiguration */
    NULL,                              /* postconfiguration */
    NULL,                              /* create main configuration */
    NULL,                              /* init main configuration */
    NULL,                              /* create server configuration */
    NULL,                              /* merge server configuration */
    NULL,                              /* create location configuration */
    NULL                               /* merge location configuration */
};


ngx_module_t  ngx_loom_offload_module = {
    NGX_MODULE_V1,
    &ngx_loom_offload_module_ctx,      /* module context */
    NULL,                              /* module directives */
    NGX_HTTP_MODULE,                   /* module type */
    NULL,                              /* init master */
    NULL,                              /* init module */
    NULL,                              /* init process */
    NULL,                              /* init thread */
    NULL,                              /* exit thread */
    ngx_loom_offload_exit_process,     /* exit process */
    NULL,                              /* exit master */
    NGX_MODULE_V1_PADDING
};


static const loom_offload_host_t  ngx_loom_offload_host = {
    LOOM_OFFLOAD_ABI_VERSION,
    sizeof(loom_offload_host_t),
    ngx_loom_offload_wait,
    ngx_loom_offload_request,
    ngx_loom_offload_cancelled,
    ngx_loom_offload_answer,
    ngx_loom_offload_log
};


static pthread_mutex_t  ngx_loom_offload_exit_mtx = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t   ngx_loom_offload_exit_cond = PTHREAD_COND_INITIALIZER;


static void
ngx_loom_offload_log(loom_offload_queue_t *q, int level, const char *msg,
    size_t len)
{
    if (level < NGX_LOG_EMERG) {
        level = NGX_LOG_ERR;

    } else if (level > NGX_LOG_DEBUG) {
        level = NGX_LOG_DEBUG;
    }

    if (msg == NULL) {
        len = 0;
    }

    ngx_log_error((ngx_uint_t) level, ngx_cycle->log, 0,
                  "[loom.offload] %s: %*s", q->path, len, msg);
}


static ngx_int_t
ngx_loom_offload_worker_init(u_char *err, size_t *errlen)
{
    Dl_info                     info;
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;

    if (w->inited) {
        return NGX_OK;
    }

    ngx_loom_offload_held_init();

    w->sema_new = (ngx_loom_sema_new_pt)
                  dlsym(RTLD_DEFAULT, "ngx_http_lua_ffi_sema_new");
    w->sema_post = (ngx_loom_sema_post_pt)
                   dlsym(RTLD_DEFAULT, "ngx_http_lua_ffi_sema_post");
    w->sema_gc = (ngx_loom_sema_gc_pt)
                 dlsym(RTLD_DEFAULT, "ngx_http_lua_ffi_sema_gc");

    if (w->sema_new == NULL || w->sema_post == NULL || w->sema_gc == NULL) {
        *errlen = ngx_snprintf(err, *errlen,
                               "ngx_http_lua_ffi_sema_* not found")
                  - err;
        return NGX_ERROR;
    }

    /*
     * nginx dlclose()s its modules at worker exit, while an abandoned
     * runtime thread may still call into this one: keep it mapped
     */
    if (dladdr((void *) &ngx_loom_offload_module, &info) != 0
        && info.dli_fname != NULL)
    {
        (void) dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
    }

    if (ngx_loom_offload_channel_open(err, errlen) != NGX_OK) {
        return NGX_ERROR;
    }

    ngx_queue_init(&w->queues);

    w->gc_event.handler = ngx_loom_offload_gc_handler;
    w->gc_event.log = ngx_cycle->log;
    w->gc_event.data = w;

    w->trim_ev.handler = ngx_loom_offload_trim_handler;
    w->trim_ev.log = ngx_cycle->log;
    w->trim_ev.data = w;
    w->trim_ev.cancelable = 1;

    w->exiting = ngx_exiting;
    w->inited = 1;

    ngx_loom_offload_sigchld_wrap();

    return NGX_OK;
}


/* {{{ start-up and shutdown */

static int
ngx_loom_offload_spawn(void *(*fn)(void *), void *data)
{
    int             rc;
    sigset_t        set, old;
    pthread_t       tid;
    pthread_attr_t  attr;

    if (pthread_attr_init(&attr) != 0) {
        return -1;
    }

    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);

    /* the thread, and every thread it starts, leaves signals to nginx */
    sigfillset(&set);
    pthread_sigmask(SIG_SETMASK, &set, &old);

    rc = pthread_create(&tid, &attr, fn, data);

    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);

    return rc == 0 ? 0 : -1;
}


static void *
ngx_loom_offload_start_thread(void *data)
{
    loom_offload_queue_t  *q = data;

    int                   rc;
    char                 *e;
    loom_offload_init_t   ii;
    loom_offload_init_pt  init;

    rc = -1;

    q->dl = dlopen(q->path, RTLD_NOW | (q->global ? RTLD_GLOBAL : 0));

    if (q->dl == NULL) {
        e = dlerror();
        snprintf(q->err, LOOM_ERR_LEN, "%s", e ? e : "dlopen() failed");
        goto done;
    }

    init = (loom_offload_init_pt) dlsym(q->dl, "loom_offload_init");
    q->shutdown = (loom_offload_shutdown_pt)
                  dlsym(q->dl, "loom_offload_shutdown");

    if (init == NULL || q->shutdown == NULL) {
        snprintf(q->err, LOOM_ERR_LEN, "%s does not export "
                 "loom_offload_init and loom_offload_shutdown", q->path);
        goto done;
    }

    memset(&ii, 0, sizeof(loom_offload_init_t));

    ii.abi_version = LOOM_OFFLOAD_ABI_VERSION;
    ii.size = sizeof(loom_offload_init_t);
    ii.host = &ngx_loom_offload_host;
    ii.queue = q;
    ii.config = q->config;
    ii.config_len = q->config_len;
    ii.threads = q->threads;
    ii.worker = (ngx_process == NGX_PROCESS_WORKER) ? (int) ngx_worker : -1;
    ii.instance = NULL;
    ii.err = q->err;
    ii.err_size = LOOM_ERR_LEN;

    q->err[0] = '\0';

    rc = init(&ii);

    if (rc != 0) {
        q->err[LOOM_ERR_LEN - 1] = '\0';

        if (q->err[0] == '\0') {
            snprintf(q->err, LOOM_ERR_LEN,
                     "loom_offload_init() returned %d", rc);
        }

    } else {
        q->instance = ii.instance;
    }

done:

    q->start_rc = rc;
    ngx_loom_offload_publish(&q->control);

    return NULL;
}


static void *
ngx_loom_offload_shutdown_thread(void *data)
{
    loom_offload_queue_t  *q = data;

    q->shutdown(q->instance);

    pthread_mutex_lock(&ngx_loom_offload_exit_mtx);
    q->shut_done = 1;
    pthread_cond_broadcast(&ngx_loom_offload_exit_cond);
    pthread_mutex_unlock(&ngx_loom_offload_exit_mtx);

    return NULL;
}


static void
ngx_loom_offload_exit_process(ngx_cycle_t *cycle)
{
    uint64_t                    now, deadline, max;
    ngx_uint_t                  waiting;
    ngx_queue_t                *x, *y;
    struct timespec             ts;
    loom_offload_task_t        *t;
    loom_offload_queue_t       *q;
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;

    if (!w->inited) {
        return;
    }

    max = 0;

    for (x = ngx_queue_head(&w->queues);
         x != ngx_queue_sentinel(&w->queues);
         x = ngx_queue_next(x))
    {
        q = ngx_queue_data(x, loom_offload_queue_t, link);

        ngx_loom_offload_close(q);

        if (!q->started) {
            if (q->state == LOOM_OFFLOAD_STARTING
                || q->state == LOOM_OFFLOAD_CLOSING)
            {
                ngx_log_error(NGX_LOG_NOTICE, cycle->log, 0,
                              "[loom.offload] %s: still starting at exit, "
                              "abandoned", q->path);
            }

            q->shut_done = 1;
            continue;
        }

        if (ngx_loom_offload_spawn(ngx_loom_offload_shutdown_thread, q)
            != 0)
        {
            ngx_log_error(NGX_LOG_ALERT, cycle->log, ngx_errno,
                          "[loom.offload] %s: cannot start the shutdown "
                          "thread", q->path);
            q->shut_done = 1;
            continue;
        }

        if (q->grace > max) {
            max = q->grace;
        }
    }

    /* wait for the runtimes, at most the longest grace period */

    deadline = ngx_loom_offload_now_ns() + max * 1000000;
    ts.tv_sec = deadline / 1000000000;
    ts.tv_nsec = deadline % 1000000000;

    pthread_mutex_lock(&ngx_loom_offload_exit_mtx);

    for ( ;; ) {
        waiting = 0;

        for (x = ngx_queue_head(&w->queues);
             x != ngx_queue_sentinel(&w->queues);
             x = ngx_queue_next(x))
        {
            q = ngx_queue_data(x, loom_offload_queue_t, link);
            waiting += !q->shut_done;
        }

        now = ngx_loom_offload_now_ns();

        if (waiting == 0 || now >= deadline) {
            break;
        }

        (void) pthread_cond_timedwait(&ngx_loom_offload_exit_cond,
                                      &ngx_loom_offload_exit_mtx, &ts);
    }

    for (x = ngx_queue_head(&w->queues);
         x != ngx_queue_sentinel(&w->queues);
         x = ngx_queue_next(x))
    {
        q = ngx_queue_data(x, loom_offload_queue_t, link);

        if (!q->shut_done) {
            ngx_log_error(NGX_LOG_WARN, cycle->log, 0,
                          "[loom.offload] %s: runtime did not shut down "
                          "within %M ms, abandoned", q->path, q->grace);
        }
    }

    pthread_mutex_unlock(&ngx_loom_offload_exit_mtx);

    /*
     * lua-nginx-module frees its semaphore blocks after this and expects
     * every semaphore back: return those of tasks still alive (answers
     * that never came, requests nginx did not finalize)
     */

    for (x = ngx_queue_head(&w->queues);
         x != ngx_queue_sentinel(&w->queues);
         x = ngx_queue_next(x))
    {
        q = ngx_queue_data(x, loom_offload_queue_t, link);

        for (y = ngx_queue_head(&q->live);
             y != ngx_queue_sentinel(&q->live);
             y = ngx_queue_next(y))
        {
            t = ngx_queue_data(y, loom_offload_task_t, live);

            if (t->sem) {
                w->sema_gc(t->sem);
                t->sem = NULL;
            }
        }
    }

    /* late answers are dropped from now on; the memory goes with exit() */

    ngx_loom_offload_channel_close();
}

/* }}} */


/* {{{ FFI entry points */

int
ngx_loom_offload_ffi_load(const char *path, const char *config,
    size_t config_len, int threads, int bound, int grace_ms, int spin_us,
    int poll_us, int reclaim_ms, int global, loom_offload_queue_t **out,
    u_char *err, size_t *errlen)
{
    size_t                      len;
    pthread_condattr_t          attr;
    pthread_mutexattr_t         mattr;
    loom_offload_queue_t       *q;
    ngx_loom_offload_worker_t  *w;

    w = &ngx_loom_offload_w;

    if (ngx_process != NGX_PROCESS_WORKER
        && ngx_process != NGX_PROCESS_SINGLE)
    {
        *errlen = ngx_snprintf(err, *errlen,
                               "runtimes run in worker processes only")
                  - err;
        return LOOM_FFI_BAD_CONTEXT;
    }

    if (ngx_loom_offload_worker_init(err, errlen) != NGX_OK) {
        return LOOM_FFI_ERROR;
    }

    q = ngx_calloc(sizeof(loom_offload_queue_t), ngx_cycle->log);
    if (q == NULL) {
        goto nomem;
    }

    len = ngx_strlen(path);

    q->path = malloc(len + 1);
    q->config = malloc(config_len + 1);

    if (q->path == NULL || q->config == NULL) {
        free(q->path);
        free(q->config);
        ngx_free(q);
        goto nomem;
    }

    ngx_memcpy(q->path, path, len + 1);
    ngx_memcpy(q->config, config, config_len);
    q->config[config_len] = '\0';
    q->config_len = config_len;

    /*
     * critical sections are a few dozen instructions: under contention
     * spin briefly (adaptive) rather than sleep in the kernel at once
     */
    if (pthread_mutexattr_init(&mattr) != 0) {
        goto failed;
    }

    (void) pthread_mutexattr_settype(&mattr, PTHREAD_MUTEX_ADAPTIVE_NP);

    if (pthread_mutex_init(&q->mtx, &mattr) != 0) {
        pthread_mutexattr_destroy(&mattr);
        goto failed;
    }

    pthread_mutexattr_destroy(&mattr);

    if (pthread_condattr_init(&attr) != 0) {
        goto failed;
    }

    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);

    if (pthread_cond_init(&q->cond, &attr) != 0) {
        pthread_condattr_destroy(&attr);
        goto failed;
    }

    pthread_condattr_destroy(&attr);

    ngx_queue_init(&q->pending);
    ngx_queue_init(&q->live);
    ngx_queue_init(&q->overdue);

    q->bound = bound > 0 ? (ngx_uint_t) bound : 1;
    q->threads = threads > 0 ? (unsigned) threads : 1;
    q->grace = grace_ms > 0 ? (ngx_msec_t) grace_ms : 0;
    q->reclaim = reclaim_ms > 0 ? (ngx_msec_t) reclaim_ms : 0;
    q->spin_ns = spin_us > 0 ? (uint64_t) spin_us * 1000 : 0;
    q->spin_cur_ns = q->spin_ns;
    q->spin_cpu = -1;
    q->poll_ns = poll_us > 0 ? (uint64_t) poll_us * 1000 : 0;
    q->global = global;
    q->state = LOOM_OFFLOAD_STARTING;

    q->control.control = 1;
    q->control.queue = q;

    q->grace_ev.handler = ngx_loom_offload_grace_handler;
    q->grace_ev.log = ngx_cycle->log;
    q->grace_ev.data = q;
    q->grace_ev.cancelable = 1;

    q->kick_ev.handler = ngx_loom_offload_kick_handler;
    q->kick_ev.log = ngx_cycle->log;
    q->kick_ev.data = q;

    q->wake_ev.handler = ngx_loom_offload_kick_handler;
    q->wake_ev.log = ngx_cycle->log;
    q->wake_ev.data = q;
    q->wake_ev.cancelable = 1;

    q->reclaim_ev.handler = ngx_loom_offload_reclaim_handler;
    q->reclaim_ev.log = ngx_cycle->log;
    q->reclaim_ev.data = q;
    q->reclaim_ev.cancelable = 1;

    if (ngx_loom_offload_spawn(ngx_loom_offload_start_thread, q) != 0) {
        *errlen = ngx_snprintf(err, *errlen,
                               "failed to start a thread: %d", ngx_errno)
                  - err;
        pthread_cond_destroy(&q->cond);
        pthread_mutex_destroy(&q->mtx);
        free(q->path);
        free(q->config);
        ngx_free(q);
        return LOOM_FFI_ERROR;
    }

    ngx_queue_insert_tail(&w->queues, &q->link);

    if (w->exiting) {
        if (q->grace) {
            ngx_add_timer(&q->grace_ev, q->grace);

        } else {
            ngx_loom_offload_close(q);
        }
    }

    *out = q;

    return LOOM_FFI_OK;

failed:

    free(q->path);
    free(q->config);
    ngx_free(q);

nomem:

    *errlen = ngx_snprintf(err, *errlen, "no memory") - err;

    return LOOM_FFI_ERROR;
}


int
ngx_loom_offload_ffi_state(loom_offload_queue_t *q, char **err)
{
    *err = q->err;

    return q->state;
}


int
ngx_loom_offload_ffi_close(loom_offload_queue_t *q)
{
    ngx_loom_offload_close(q);

    return LOOM_FFI_OK;
}

/* }}} */

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
