
/*
 * Copyright (C) resty-loom authors
 *
 * The event-loop watchdog (resty.loom.watchdog).
 *
 *   - Loop timing: init_process wraps the exported
 *     ngx_event_actions.process_events and adds NGX_POST_EVENTS, so the
 *     wrapper returns right after epoll_wait and every handler runs after
 *     it. The time from one return to the next entry is the busy part of
 *     an iteration; it goes into a histogram (two vDSO clock reads per
 *     iteration, no lock, no syscall).
 *   - A watchdog pthread per worker wakes when the iteration it saw last
 *     could have run half the threshold, then every few milliseconds
 *     while it lasts. When it has been busy longer than the threshold it
 *     reads
 *     /proc/self/task/<tid>/{stat,syscall,wchan} of the main thread (on or
 *     off CPU, which system call, which kernel wait) and asks the Lua VM
 *     for a backtrace at a safe point: it never touches the VM itself.
 *     LuaJIT's profiler is started with its timer disarmed, so SIGPROF
 *     only arrives when the watchdog sends it: on CPU with pthread_kill,
 *     off CPU through a hardware breakpoint (perf_event_open) on the
 *     return address of the blocking system call, which raises SIGPROF
 *     the moment the call returns without interrupting it. LuaJIT's own
 *     SIGPROF handler then sets its profile hook, and our C callback runs
 *     at the next VM instruction on the main thread, where it dumps the
 *     stack and notes the request or timer.
 *   - When the stalled iteration ends the main thread closes the report
 *     and posts an ngx.semaphore the Lua side waits on.
 *
 * This file: the module, the loop timing and the closing of a report.
 * ngx_loom_watchdog_ffi.c: what the Lua side calls; _sample.c: the Lua
 * backtrace taken on the main thread; _thread.c: the watchdog thread.
 */


#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "ngx_loom_watchdog.h"
#include <dlfcn.h>
#include <signal.h>
#include <sys/time.h>
#include <sys/syscall.h>


static ngx_int_t ngx_loom_wd_postconfiguration(ngx_conf_t *cf);
static ngx_int_t ngx_loom_wd_init_process(ngx_cycle_t *cycle);
static void ngx_loom_wd_exit_process(ngx_cycle_t *cycle);
static ngx_int_t ngx_loom_wd_process_events(ngx_cycle_t *cycle,
    ngx_msec_t timer, ngx_uint_t flags);
static void ngx_loom_wd_finish(uint64_t now, uint64_t since, uint64_t busy);


static ngx_http_module_t  ngx_loom_watchdog_module_ctx = {
    NULL,                              /* preconfiguration */
    ngx_loom_wd_postconfiguration,     /* postconfiguration */
    NULL,                              /* create main configuration */
    NULL,                              /* init main configuration */
    NULL,                              /* create server configuration */
    NULL,                              /* merge server configuration */
    NULL,                              /* create location configuration */
    NULL                               /* merge location configuration */
};


ngx_module_t  ngx_loom_watchdog_module = {
    NGX_MODULE_V1,
    &ngx_loom_watchdog_module_ctx,     /* module context */
    NULL,                              /* module directives */
    NGX_HTTP_MODULE,                   /* module type */
    NULL,                              /* init master */
    NULL,                              /* init module */
    ngx_loom_wd_init_process,          /* init process */
    NULL,                              /* init thread */
    NULL,                              /* exit thread */
    ngx_loom_wd_exit_process,          /* exit process */
    NULL,                              /* exit master */
    NGX_MODULE_V1_PADDING
};


/* ngx_lua's main Lua VM, taken at postconfiguration */
static lua_State  *wd_L;

static ngx_int_t (*wd_orig_process_events)(ngx_cycle_t *cycle,
    ngx_msec_t timer, ngx_uint_t flags);

/* configuration; the thresholds are read by both threads */
loom_wd_conf_t          wd_conf;
int                     wd_want;
int                     wd_process_inited;
int                     wd_enabled;
uint64_t                wd_threshold_ns;
uint64_t                wd_interval_ns;
uint64_t                wd_long_ns;
int                     wd_max_samples;
void                   *wd_sem;

/* loop state shared with the thread (atomics) */
uint64_t                wd_seq;
uint64_t                wd_busy_since;
uint64_t                wd_req_seq;
int                     wd_req_offcpu;
uint64_t                wd_cb_seq;
int                     wd_cb_n;
int                     wd_stop;

loom_wd_stats_t         wd_stats;

/* guarded by wd_lock */
pthread_mutex_t         wd_lock = PTHREAD_MUTEX_INITIALIZER;
loom_wd_report_t        wd_cur;
uint64_t                wd_seen_seq;
uint64_t                wd_seen_wall;
uint64_t                wd_seen_cpu;
uint64_t                wd_seen_rq;
loom_wd_report_t        wd_done[LOOM_WD_REPORTS];
ngx_uint_t              wd_done_head;
ngx_uint_t              wd_done_n;
char                    wd_first_bt[LOOM_WD_BT_LEN];
uint64_t                wd_first_bt_seq;

/* main thread only: context and stack samples */
uint64_t                wd_ctx_seq;
int32_t                 wd_ctx_phase;
int32_t                 wd_ctx_timer;
char                    wd_ctx_request[LOOM_WD_REQUEST_LEN];
char                    wd_ctx_site[LOOM_WD_SITE_LEN];
loom_wd_sample_t        wd_samples[LOOM_WD_SAMPLES];
int                     wd_nsamples;
char                    wd_text[LOOM_WD_TEXT];
uint32_t                wd_text_used;
int                     wd_mark_n;      /* samples of finished stalls */
uint32_t                wd_mark_used;

/* thread side */
static pthread_t        wd_thread;
int                     wd_thread_running;
pthread_t               wd_main;
pid_t                   wd_main_tid;
clockid_t               wd_main_clock;


static ngx_int_t
ngx_loom_wd_postconfiguration(ngx_conf_t *cf)
{
    lua_State  *(*get_state)(ngx_conf_t *cf);

    get_state = (lua_State *(*)(ngx_conf_t *))
                dlsym(RTLD_DEFAULT, "ngx_http_lua_get_global_state");

    if (get_state != NULL
        && ngx_http_conf_get_module_main_conf(cf, ngx_http_core_module))
    {
        /* NULL when ngx_lua is not loaded or has no http{} config */
        wd_L = get_state(cf);
    }

    return NGX_OK;
}


/* -- the main thread ---------------------------------------------------- */


static ngx_int_t
ngx_loom_wd_init_process(ngx_cycle_t *cycle)
{
    int               rc;
    sigset_t          all, old;
    struct sigaction  sa;
    struct itimerval  tm;

    wd_process_inited = 1;

    if (!wd_want
        || (ngx_process != NGX_PROCESS_WORKER
            && ngx_process != NGX_PROCESS_SINGLE))
    {
        return NGX_OK;
    }

    wd_want = 0;

    if (ngx_event_actions.process_events == NULL) {
        ngx_log_error(NGX_LOG_WARN, cycle->log, 0,
                      "[loom.watchdog] no event module, not started");
        return NGX_OK;
    }

    wd_main = pthread_self();
    wd_main_tid = (pid_t) syscall(SYS_gettid);

    if (pthread_getcpuclockid(wd_main, &wd_main_clock) != 0) {
        wd_main_clock = CLOCK_THREAD_CPUTIME_ID;
    }

    (void) wd_resolve();

    if (wd_conf.profile && wd_L != NULL && wd_profile_start != NULL
        && wd_dumpstack != NULL)
    {
        /*
         * 'l' makes traces check for the profile hook at line changes,
         * so a sample can be taken inside compiled loops; the interval
         * timer is then disarmed: samples are only taken on request
         */
        wd_profile_start(wd_L, "li1000", ngx_loom_wd_profile_cb, NULL);

        ngx_memzero(&tm, sizeof(struct itimerval));
        (void) setitimer(ITIMER_PROF, &tm, NULL);

        if (sigaction(SIGPROF, NULL, &sa) == 0
            && sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN)
        {
            wd_stats.profiler = 1;
        }
    }

    wd_orig_process_events = ngx_event_actions.process_events;
    ngx_event_actions.process_events = ngx_loom_wd_process_events;

    wd_stats.started_ns = wd_now();
    wd_store(&wd_stop, 0);
    wd_store(&wd_enabled, 1);
    wd_stats.running = 1;

    /* the thread takes no signal: SIGPROF must reach the main thread */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&wd_thread, NULL, ngx_loom_wd_thread, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);

    if (rc != 0) {
        ngx_log_error(NGX_LOG_ALERT, cycle->log, rc,
                      "[loom.watchdog] pthread_create() failed");
        ngx_event_actions.process_events = wd_orig_process_events;
        wd_store(&wd_enabled, 0);
        wd_stats.running = 0;
        return NGX_OK;
    }

    wd_thread_running = 1;

    ngx_log_error(NGX_LOG_INFO, cycle->log, 0,
                  "[loom.watchdog] started: threshold %.1f ms, "
                  "backtraces %s", wd_conf.threshold_ms,
                  wd_stats.profiler ? "on" : "off");

    return NGX_OK;
}


static void
ngx_loom_wd_exit_process(ngx_cycle_t *cycle)
{
    if (!wd_thread_running) {
        return;
    }

    wd_store(&wd_enabled, 0);
    wd_store(&wd_stop, 1);
    ngx_loom_wd_wake();
    pthread_join(wd_thread, NULL);

    /* a SIGPROF still pending must not sample the VM being closed */
    wd_store(&wd_req_seq, 0);
    wd_store(&wd_busy_since, 0);

    wd_thread_running = 0;
    wd_stats.running = 0;
    wd_sem = NULL;

    if (ngx_event_actions.process_events == ngx_loom_wd_process_events) {
        ngx_event_actions.process_events = wd_orig_process_events;
    }
}


static ngx_int_t
ngx_loom_wd_process_events(ngx_cycle_t *cycle, ngx_msec_t timer,
    ngx_uint_t flags)
{
    uint64_t   now, since, busy;
    ngx_int_t  rc;

    if (!__atomic_load_n(&wd_enabled, __ATOMIC_RELAXED)) {
        return wd_orig_process_events(cycle, timer, flags);
    }

    if (wd_iter_end(&now, &since, &busy)) {
        ngx_loom_wd_finish(now, since, busy);

        /* the Lua side was posted: do not sleep before it runs */
        timer = 0;
    }

    rc = wd_orig_process_events(cycle, timer, flags | NGX_POST_EVENTS);

    wd_iter_start();

    return rc;
}


static void
ngx_loom_wd_finish(uint64_t now, uint64_t since, uint64_t busy)
{
    uint64_t           seq, cpu_end, cpu, wall, pre, rq_end, rq;
    loom_wd_report_t  *r;

    seq = wd_seq;
    wd_stats.stalls++;
    wd_store(&wd_req_seq, 0);

    cpu_end = wd_clock(CLOCK_THREAD_CPUTIME_ID);
    rq_end = wd_run_delay(-1, "/proc/thread-self/schedstat");

    pthread_mutex_lock(&wd_lock);

    if (wd_done_n == LOOM_WD_REPORTS) {
        wd_done_n--;
        wd_stats.reports_dropped++;
    }

    r = &wd_done[wd_done_head];
    wd_done_head = (wd_done_head + 1) % LOOM_WD_REPORTS;
    wd_done_n++;

    if (wd_cur.seq == seq) {
        *r = wd_cur;

    } else {
        ngx_memzero(r, sizeof(loom_wd_report_t));
    }

    wd_cur.seq = 0;
    r->seq = seq;

    if (wd_seen_seq == seq && cpu_end != 0 && wd_seen_cpu != 0
        && cpu_end >= wd_seen_cpu && now > wd_seen_wall)
    {
        cpu = cpu_end - wd_seen_cpu;
        wall = now - wd_seen_wall;
        pre = wd_seen_wall > since ? wd_seen_wall - since : 0;

        /* the part before the thread first looked: same CPU share */
        cpu += (uint64_t) ((double) pre * ((double) cpu / (double) wall));
        if (cpu > busy) {
            cpu = busy;
        }

        r->cpu_ms = (double) cpu / 1e6;
        r->cpu_known = 1;

        if (rq_end != 0 && wd_seen_rq != 0 && rq_end >= wd_seen_rq) {
            rq = rq_end - wd_seen_rq;
            rq += (uint64_t) ((double) pre * ((double) rq / (double) wall));
            if (rq > busy - cpu) {
                rq = busy - cpu;
            }

            r->runq_ms = (double) rq / 1e6;
            r->runq_known = 1;
        }
    }

    pthread_mutex_unlock(&wd_lock);

    r->start = (double) wd_clock(CLOCK_REALTIME) / 1e9
               - (double) (now - since) / 1e9;
    r->duration_ms = (double) busy / 1e6;

    if (wd_ctx_seq == seq) {
        r->phase = wd_ctx_phase;
        r->timer = wd_ctx_timer;
        ngx_memcpy(r->request, wd_ctx_request, LOOM_WD_REQUEST_LEN);
        ngx_memcpy(r->site, wd_ctx_site, LOOM_WD_SITE_LEN);
    }

    r->lua_samples = (wd_load(&wd_cb_seq) == seq) ? wd_cb_n : 0;

    /* the samples so far belong to finished stalls: keep them */
    wd_mark_n = wd_nsamples;
    wd_mark_used = wd_text_used;
    r->report_ms = (double) (wd_now() - since) / 1e6;

    if (wd_sem != NULL && wd_sema_post != NULL) {
        (void) wd_sema_post(wd_sem, 1);
    }
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
