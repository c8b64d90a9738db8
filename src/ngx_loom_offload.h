
/*
 * Copyright (C) resty-loom authors
 *
 * What the offload files share: the task, queue and per-worker layouts
 * and the functions one file calls in another, grouped by file from the
 * top layer down. A file may call only the groups below its own
 * (ngx_loom_offload.c lists the layers). Private to src/: runtimes see
 * only include/loom_offload.h.
 */


#ifndef _NGX_LOOM_OFFLOAD_H_INCLUDED_
#define _NGX_LOOM_OFFLOAD_H_INCLUDED_


#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "ngx_loom.h"
#include <ngx_event.h>
#include <ngx_http.h>
#include <pthread.h>
#include <loom_offload.h>


/* a runtime's state (ngx_loom_offload_ffi_state) */
#define LOOM_OFFLOAD_STARTING        0
#define LOOM_OFFLOAD_READY           1
#define LOOM_OFFLOAD_FAILED          2
#define LOOM_OFFLOAD_CLOSING         3

/* where a task is, guarded by the queue mutex */
#define LOOM_WHERE_NONE              0
#define LOOM_WHERE_PENDING           1
#define LOOM_WHERE_TAKEN             2

/* results seen by Lua (ngx_loom_offload_ffi_result) */
#define LOOM_RESULT_OK               0
#define LOOM_RESULT_ERROR            1
#define LOOM_RESULT_CLOSED           2
#define LOOM_RESULT_NOMEM            3

/* latency histogram: 8 sub-buckets per power of two, in microseconds */
#define LOOM_HIST_SUB_BITS           3
#define LOOM_HIST_SUB                (1 << LOOM_HIST_SUB_BITS)
#define LOOM_HIST_BUCKETS            (LOOM_HIST_SUB * 40)

#define LOOM_ERR_LEN                 512

/*
 * in a sequence, when the runtime thread must be woken, the event loop
 * polls for up to this many times poll_us: one cross-CPU wake-up (the
 * runtime thread's) instead of two (the thread's, then the loop's own
 * through the eventfd), each 10-30 us on a virtual machine
 */
#define LOOM_WAKE_POLL               4


typedef int (*ngx_loom_sema_new_pt)(void **psem, int n, char **errmsg);
typedef int (*ngx_loom_sema_post_pt)(void *sem, int n);
typedef void (*ngx_loom_sema_gc_pt)(void *sem);


typedef struct {
    ngx_queue_t                  tasks;
} ngx_loom_offload_rctx_t;


struct loom_offload_task_s {
    ngx_queue_t                  pending;      /* queue mutex */
    loom_offload_task_t         *next;         /* completion / garbage */
    loom_offload_task_t         *held_next;    /* its held stripe's lock */
    ngx_queue_t                  overdue;      /* main thread */
    ngx_msec_t                   overdue_at;   /* main thread */
    ngx_queue_t                  live;         /* main thread */
    ngx_queue_t                  rlink;        /* main thread */
    loom_offload_queue_t        *queue;
    void                        *sem;
    uint64_t                     start_ns;

    /* written by the taking thread under the queue mutex */
    uint64_t                     take_ns;

    /* written by the answering thread before it publishes the task */
    u_char                      *rsp;
    size_t                       rsp_len;
    uint64_t                     answer_ns;
    int                          status;
    int                          rsp_heap;

    int                          cancelled;    /* atomic */
    int                          fast;         /* atomic, LOOM_FAST_* */
    int                          where;        /* queue mutex */
    int                          result;       /* main thread */

    /* main thread only */
    unsigned                     lua:1;
    unsigned                     rt:1;
    unsigned                     resolved:1;
    unsigned                     in_request:1;
    unsigned                     control:1;
    unsigned                     garbage:1;
    unsigned                     kick:1;       /* needs a sleeper woken */
    unsigned                     woke:1;       /* woke a sleeper at once */
    unsigned                     poll:1;       /* the loop may poll */
    unsigned                     wake_poll:1;  /* ... through a wake-up */
    unsigned                     in_overdue:1;
    unsigned                     reclaimed:1;  /* held stripe's lock */

    size_t                       req_len;
    size_t                       cap;
    u_char                       data[1];
};


struct loom_offload_queue_s {
    pthread_mutex_t              mtx;
    pthread_cond_t               cond;
    ngx_queue_t                  pending;
    ngx_uint_t                   npending;     /* atomic reads */
    ngx_uint_t                   taken;        /* atomic reads */
    ngx_uint_t                   spinners;
    ngx_uint_t                   sleepers;
    ngx_uint_t                   waking;       /* signalled, not yet up */
    ngx_uint_t                   busy;         /* took a task, not back */
    uint64_t                     svc_ns;       /* take -> back, average */
    uint64_t                     progress_ns;  /* last take or return */
    ngx_uint_t                   closed;       /* atomic reads */
    ngx_uint_t                   bound;
    uint64_t                     spin_ns;
    uint64_t                     spin_cur_ns;  /* adaptive, under mtx */
    int                          spin_cpu;     /* atomic, see ffi_poll */

    /* main thread */
    uint64_t                     poll_ns;
    uint64_t                     ewma_ns;      /* take -> answer */
    uint64_t                     pick_ns;      /* submit -> take, awake */
    uint64_t                     wake_ns;      /* submit -> take, woken */
    uint64_t                     resolved_ns;  /* the last call resolved */
    ngx_atomic_uint_t            seq_conn;     /* its request: connection */
    ngx_uint_t                   seq_req;      /* and request number */
    ngx_uint_t                   poll_skip;    /* calls not to poll for */
    ngx_uint_t                   poll_backoff;
    uint64_t                     polled;
    uint64_t                     polled_hits;
    uint64_t                     peak_queued;
    ngx_queue_t                  link;
    ngx_queue_t                  live;
    int                          state;
    int                          started;      /* init() returned 0 */
    char                        *path;
    char                        *config;
    size_t                       config_len;
    unsigned                     threads;
    ngx_msec_t                   grace;
    ngx_msec_t                   reclaim;
    ngx_queue_t                  overdue;      /* given up, still held */
    ngx_event_t                  reclaim_ev;
    int                          global;
    ngx_event_t                  grace_ev;
    ngx_event_t                  kick_ev;      /* posted: wake sleepers */
    ngx_event_t                  wake_ev;      /* timer: the same, later */

    /* written by the start-up thread before it publishes "control" */
    void                        *dl;
    void                        *instance;
    loom_offload_shutdown_pt     shutdown;
    int                          start_rc;
    char                         err[LOOM_ERR_LEN];

    /* shutdown helper; guarded by ngx_loom_offload_exit_mtx */
    int                          shut_done;

    /* statistics, main thread */
    uint64_t                     submitted;
    uint64_t                     answered;
    uint64_t                     completed;
    uint64_t                     errors;
    uint64_t                     timeouts;
    uint64_t                     rejected;
    uint64_t                     closed_calls;
    uint64_t                     aborted;
    uint64_t                     late;
    uint64_t                     reclaimed;
    uint64_t                     reclaimed_held;
    uint64_t                     misused;
    uint64_t                     lat_n;
    uint64_t                     lat_sum;
    uint64_t                     lat_max;
    uint64_t                     hist[LOOM_HIST_BUCKETS];

    /* submission to a thread taking the task, microseconds */
    uint64_t                     wait_sum;
    uint64_t                     wait_hist[LOOM_HIST_BUCKETS];

    loom_offload_task_t          control;
};


typedef struct {
    pthread_mutex_t              lock;         /* fd against exit */
    loom_offload_task_t         *done;         /* atomic, newest first */
    int                          fd;

    /* main thread */
    ngx_uint_t                   inited;
    ngx_uint_t                   exiting;
    ngx_uint_t                   edge;         /* edge-triggered eventfd */
    ngx_uint_t                   wakeups;
    ngx_connection_t            *conn;
    ngx_queue_t                  queues;
    loom_offload_task_t         *garbage;
    ngx_event_t                  gc_event;
    ngx_uint_t                   tasks;        /* alive */
    ngx_uint_t                   tasks_peak;   /* since the last trim */
    ngx_event_t                  trim_ev;
    ngx_loom_sema_new_pt         sema_new;
    ngx_loom_sema_post_pt        sema_post;
    ngx_loom_sema_gc_pt          sema_gc;
} ngx_loom_offload_worker_t;


typedef struct {
    pthread_mutex_t              mtx;
    loom_offload_task_t         *tasks;
} ngx_loom_offload_held_t;


#if (defined __x86_64__ || defined __i386__)
#define ngx_loom_cpu_relax()  __builtin_ia32_pause()
#elif (defined __aarch64__)
#define ngx_loom_cpu_relax()  __asm__ __volatile__ ("yield" ::: "memory")
#else
#define ngx_loom_cpu_relax()
#endif

#define ngx_loom_load(p)      __atomic_load_n(p, __ATOMIC_ACQUIRE)
#define ngx_loom_store(p, v)  __atomic_store_n(p, v, __ATOMIC_RELEASE)


static ngx_inline uint64_t
ngx_loom_offload_now_ns(void)
{
    struct timespec  ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);

    return (uint64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}


extern ngx_module_t  ngx_loom_offload_module;


/*
 * what the files share stays inside the module: the .so exports the
 * FFI entry points and ngx_loom_offload_module only, as when this was
 * one file, and calls between the files need no PLT
 */
#pragma GCC visibility push(hidden)

/* ngx_loom_offload_queue.c: the queue a runtime thread last took from */
extern __thread loom_offload_queue_t  *ngx_loom_offload_tls_q;

/* ngx_loom_offload_task.c: the worker's runtimes, tasks, channel */
extern ngx_loom_offload_worker_t  ngx_loom_offload_w;


/* ngx_loom_offload_completion.c */
int ngx_loom_offload_answer(loom_offload_task_t *t, int status,
    const void *data, size_t len);
void ngx_loom_offload_publish(loom_offload_task_t *t);
ngx_int_t ngx_loom_offload_channel_open(u_char *err, size_t *errlen);
void ngx_loom_offload_channel_close(void);
void ngx_loom_offload_resolve(loom_offload_task_t *t, int result);
void ngx_loom_offload_close(loom_offload_queue_t *q);
void ngx_loom_offload_grace_handler(ngx_event_t *ev);

/* ngx_loom_offload_queue.c */
int ngx_loom_offload_wait(loom_offload_queue_t *q, int timeout_ms,
    loom_offload_task_t **task);
const unsigned char *ngx_loom_offload_request(loom_offload_task_t *t,
    size_t *len);
int ngx_loom_offload_cancelled(loom_offload_task_t *t);
void ngx_loom_offload_kick_handler(ngx_event_t *ev);
void ngx_loom_offload_request_cleanup(void *data);
void ngx_loom_offload_unpend(loom_offload_task_t *t);
ngx_int_t ngx_loom_offload_queue_close(loom_offload_queue_t *q);

/* ngx_loom_offload_task.c */
void ngx_loom_offload_discard(loom_offload_task_t *t);
void ngx_loom_offload_overdue(loom_offload_task_t *t);
void ngx_loom_offload_gc_handler(ngx_event_t *ev);
void ngx_loom_offload_task_free(loom_offload_task_t *t);
void ngx_loom_offload_trim_handler(ngx_event_t *ev);
void ngx_loom_offload_reclaim_handler(ngx_event_t *ev);
void ngx_loom_offload_held_init(void);
ngx_loom_offload_held_t *ngx_loom_offload_held_stripe(
    loom_offload_task_t *t);
loom_offload_task_t **ngx_loom_offload_held_find(
    ngx_loom_offload_held_t *h, loom_offload_task_t *t);

/* ngx_loom_offload_stats.c */
void ngx_loom_offload_latency(loom_offload_queue_t *q, uint64_t us);
void ngx_loom_offload_queue_wait(loom_offload_queue_t *q, uint64_t us);

/* ngx_loom_offload_sigchld.c */
void ngx_loom_offload_sigchld_wrap(void);

#pragma GCC visibility pop


#endif /* _NGX_LOOM_OFFLOAD_H_INCLUDED_ */

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
