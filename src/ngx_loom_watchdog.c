
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
 *   - A watchdog pthread per worker wakes every few milliseconds. When the
 *     current iteration has been busy longer than the threshold it reads
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
 */


#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "ngx_loom.h"
#include "ngx_loom_watchdog.h"
#include <ngx_event.h>
#include <ngx_http.h>
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <linux/perf_event.h>
#include <linux/hw_breakpoint.h>


#define LOOM_WD_REPORTS      16
#define LOOM_WD_SAMPLES     512
#define LOOM_WD_TEXT     131072
#define LOOM_WD_DEPTH        48
#define LOOM_WD_LUA_TIMER  0x0080
#define LOOM_LUA_REGISTRY  (-10000)


/* the public Lua C API, declared here: the module does not link LuaJIT */
typedef struct lua_State  lua_State;

typedef struct {
    int          event;
    const char  *name;
    const char  *namewhat;
    const char  *what;
    const char  *source;
    int          currentline;
    int          nups;
    int          linedefined;
    int          lastlinedefined;
    char         short_src[60];
    int          i_ci;
} loom_lua_debug_t;

typedef void (*loom_profile_cb_pt)(void *data, lua_State *L, int samples,
    int vmstate);


static ngx_int_t ngx_loom_wd_postconfiguration(ngx_conf_t *cf);
static ngx_int_t ngx_loom_wd_init_process(ngx_cycle_t *cycle);
static void ngx_loom_wd_exit_process(ngx_cycle_t *cycle);
static ngx_int_t ngx_loom_wd_process_events(ngx_cycle_t *cycle,
    ngx_msec_t timer, ngx_uint_t flags);
static void ngx_loom_wd_finish(uint64_t now, uint64_t since, uint64_t busy);
static void *ngx_loom_wd_thread(void *arg);
static void ngx_loom_wd_tick(void);
static void ngx_loom_wd_profile_cb(void *data, lua_State *L, int samples,
    int vmstate);
static void ngx_loom_wd_bp_close(void);
static ssize_t wd_read(int fd, char *buf, size_t size);
static uint64_t wd_run_delay(int fd, const char *path);

/* FFI entry points */
int ngx_loom_ffi_watchdog_start(const loom_wd_conf_t *conf, void *sem,
    char **err);
int ngx_loom_ffi_watchdog_configure(const loom_wd_conf_t *conf);
int ngx_loom_ffi_watchdog_enable(int on);
void ngx_loom_ffi_watchdog_detach(void);
const loom_wd_stats_t *ngx_loom_ffi_watchdog_stats(void);
int ngx_loom_ffi_watchdog_pop(loom_wd_report_t *out);
const loom_wd_sample_t *ngx_loom_ffi_watchdog_samples(int *n,
    const char **text);
void ngx_loom_ffi_watchdog_samples_reset(void);
double ngx_loom_ffi_watchdog_busy_ms(void);
double ngx_loom_ffi_watchdog_wall(void);


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


/* Lua VM and ngx_lua entry points, resolved with dlsym */
static lua_State  *wd_L;
static void (*wd_profile_start)(lua_State *L, const char *mode,
    loom_profile_cb_pt cb, void *data);
static const char *(*wd_dumpstack)(lua_State *L, const char *fmt,
    int depth, size_t *len);
static int (*wd_getstack)(lua_State *L, int level, loom_lua_debug_t *ar);
static const char *(*wd_getlocal)(lua_State *L, const loom_lua_debug_t *ar,
    int n);
static const char *(*wd_tolstring)(lua_State *L, int idx, size_t *len);
static void (*wd_settop)(lua_State *L, int idx);
static int (*wd_getinfo)(lua_State *L, const char *what,
    loom_lua_debug_t *ar);
static void (*wd_setfield)(lua_State *L, int idx, const char *k);
static void *(*wd_get_request)(lua_State *L);
static int (*wd_get_phase)(void *r, char **err);
static int (*wd_sema_post)(void *sem, int n);

static ngx_int_t (*wd_orig_process_events)(ngx_cycle_t *cycle,
    ngx_msec_t timer, ngx_uint_t flags);

/* configuration; the thresholds are read by both threads */
static loom_wd_conf_t   wd_conf;
static int              wd_want;
static int              wd_process_inited;
static int              wd_enabled;
static uint64_t         wd_threshold_ns;
static uint64_t         wd_interval_ns;
static uint64_t         wd_long_ns;
static int              wd_max_samples;
static void            *wd_sem;

/* loop state shared with the thread (atomics) */
static uint64_t         wd_seq;
static uint64_t         wd_busy_since;
static uint64_t         wd_req_seq;
static int              wd_req_offcpu;
static uint64_t         wd_cb_seq;
static int              wd_cb_n;
static int              wd_stop;

static loom_wd_stats_t  wd_stats;

/* guarded by wd_lock */
static pthread_mutex_t  wd_lock = PTHREAD_MUTEX_INITIALIZER;
static loom_wd_report_t wd_cur;
static uint64_t         wd_seen_seq;
static uint64_t         wd_seen_wall;
static uint64_t         wd_seen_cpu;
static uint64_t         wd_seen_rq;
static loom_wd_report_t wd_done[LOOM_WD_REPORTS];
static ngx_uint_t       wd_done_head;
static ngx_uint_t       wd_done_n;
static char             wd_first_bt[LOOM_WD_BT_LEN];
static uint64_t         wd_first_bt_seq;

/* main thread only: context and stack samples */
static uint64_t         wd_ctx_seq;
static uint64_t         wd_fn_seq;
static int32_t          wd_ctx_phase;
static int32_t          wd_ctx_timer;
static char             wd_ctx_request[LOOM_WD_REQUEST_LEN];
static char             wd_ctx_site[LOOM_WD_SITE_LEN];
static loom_wd_sample_t wd_samples[LOOM_WD_SAMPLES];
static int              wd_nsamples;
static char             wd_text[LOOM_WD_TEXT];
static uint32_t         wd_text_used;
static int              wd_mark_n;      /* samples of finished stalls */
static uint32_t         wd_mark_used;

/* thread side */
static pthread_t        wd_thread;
static int              wd_thread_running;
static pthread_t        wd_main;
static pid_t            wd_main_tid;
static clockid_t        wd_main_clock;
static int              wd_fd_stat = -1;
static int              wd_fd_syscall = -1;
static int              wd_fd_wchan = -1;
static int              wd_fd_sched = -1;
static int              wd_bp_fd = -1;
static uint64_t         wd_bp_seq;
static uint64_t         wd_bp_pc;
static int              wd_bp_cb_n;
static uint64_t         wd_bp_cpu;
static uint64_t         wd_logged_seq;


#define wd_load(p)      __atomic_load_n(p, __ATOMIC_ACQUIRE)
#define wd_store(p, v)  __atomic_store_n(p, v, __ATOMIC_RELEASE)


static ngx_inline uint64_t
wd_now(void)
{
    struct timespec  ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);

    return (uint64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}


static uint64_t
wd_clock(clockid_t clk)
{
    struct timespec  ts;

    if (clock_gettime(clk, &ts) != 0) {
        return 0;
    }

    return (uint64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}


/* bucket upper bounds in microseconds; the last bucket is open */
static const uint64_t  wd_bounds_us[LOOM_WD_NBUCKETS - 1] = {
    50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000,
    250000, 500000, 1000000, 2500000, 5000000, 10000000
};


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


static int
wd_resolve(void)
{
    wd_profile_start = (void (*)(lua_State *, const char *,
                                 loom_profile_cb_pt, void *))
                       dlsym(RTLD_DEFAULT, "luaJIT_profile_start");
    wd_dumpstack = (const char *(*)(lua_State *, const char *, int,
                                    size_t *))
                   dlsym(RTLD_DEFAULT, "luaJIT_profile_dumpstack");
    wd_getstack = (int (*)(lua_State *, int, loom_lua_debug_t *))
                  dlsym(RTLD_DEFAULT, "lua_getstack");
    wd_getlocal = (const char *(*)(lua_State *, const loom_lua_debug_t *,
                                   int))
                  dlsym(RTLD_DEFAULT, "lua_getlocal");
    wd_tolstring = (const char *(*)(lua_State *, int, size_t *))
                   dlsym(RTLD_DEFAULT, "lua_tolstring");
    wd_settop = (void (*)(lua_State *, int)) dlsym(RTLD_DEFAULT,
                                                   "lua_settop");
    wd_getinfo = (int (*)(lua_State *, const char *, loom_lua_debug_t *))
                 dlsym(RTLD_DEFAULT, "lua_getinfo");
    wd_setfield = (void (*)(lua_State *, int, const char *))
                  dlsym(RTLD_DEFAULT, "lua_setfield");
    wd_get_request = (void *(*)(lua_State *))
                     dlsym(RTLD_DEFAULT, "ngx_http_lua_get_request");
    wd_get_phase = (int (*)(void *, char **))
                   dlsym(RTLD_DEFAULT, "ngx_http_lua_ffi_get_phase");
    wd_sema_post = (int (*)(void *, int))
                   dlsym(RTLD_DEFAULT, "ngx_http_lua_ffi_sema_post");

    return wd_profile_start != NULL && wd_dumpstack != NULL
           && wd_getstack != NULL && wd_getlocal != NULL
           && wd_tolstring != NULL && wd_settop != NULL;
}


static void
wd_apply_conf(const loom_wd_conf_t *conf)
{
    double  interval;

    wd_conf = *conf;

    interval = conf->interval_ms;
    if (interval <= 0) {
        interval = conf->threshold_ms / 4;
        if (interval > 10) {
            interval = 10;
        }
    }

    if (interval < 1) {
        interval = 1;
    }

    wd_store(&wd_interval_ns, (uint64_t) (interval * 1e6));
    wd_store(&wd_threshold_ns, (uint64_t) (conf->threshold_ms * 1e6));
    wd_store(&wd_long_ns, (uint64_t) (conf->long_ms * 1e6));
    wd_store(&wd_max_samples, conf->max_samples);
}


int
ngx_loom_ffi_watchdog_start(const loom_wd_conf_t *conf, void *sem,
    char **err)
{
    if (ngx_process != NGX_PROCESS_WORKER
        && ngx_process != NGX_PROCESS_SINGLE)
    {
        *err = "not in a worker process";
        return LOOM_FFI_BAD_CONTEXT;
    }

    if (wd_thread_running || wd_want) {
        *err = "already started";
        return LOOM_FFI_DECLINED;
    }

    if (wd_process_inited) {
        *err = "ngx_loom_module must be loaded after ngx_http_lua_module";
        return LOOM_FFI_ERROR;
    }

    wd_apply_conf(conf);
    wd_sem = sem;
    wd_want = 1;

    /* the rest happens in init_process, which runs after init_worker */
    return LOOM_FFI_OK;
}


int
ngx_loom_ffi_watchdog_configure(const loom_wd_conf_t *conf)
{
    wd_apply_conf(conf);
    return LOOM_FFI_OK;
}


int
ngx_loom_ffi_watchdog_enable(int on)
{
    if (!wd_thread_running) {
        return LOOM_FFI_DECLINED;
    }

    wd_store(&wd_busy_since, 0);
    wd_store(&wd_enabled, on ? 1 : 0);
    wd_stats.running = on ? 1 : 0;

    return LOOM_FFI_OK;
}


/* the Lua side drops its semaphore: never post it again */
void
ngx_loom_ffi_watchdog_detach(void)
{
    wd_sem = NULL;
}


const loom_wd_stats_t *
ngx_loom_ffi_watchdog_stats(void)
{
    return &wd_stats;
}


double
ngx_loom_ffi_watchdog_busy_ms(void)
{
    uint64_t  since;

    since = wd_load(&wd_busy_since);
    if (since == 0) {
        return 0;
    }

    return (double) (wd_now() - since) / 1e6;
}


/* CLOCK_REALTIME in seconds, finer than ngx.now() */
double
ngx_loom_ffi_watchdog_wall(void)
{
    return (double) wd_clock(CLOCK_REALTIME) / 1e9;
}


/*
 * A report line on the cycle's log: ngx.log in the report timer would end
 * it with "context: ngx.timer" (and a request's stall is not a timer's)
 */
void
ngx_loom_ffi_watchdog_log(int level, const u_char *msg, size_t len)
{
    ngx_log_error((ngx_uint_t) level, ngx_cycle->log, 0, "%*s", len, msg);
}


int
ngx_loom_ffi_watchdog_pop(loom_wd_report_t *out)
{
    ngx_uint_t  i;

    pthread_mutex_lock(&wd_lock);

    if (wd_done_n == 0) {
        pthread_mutex_unlock(&wd_lock);
        return 0;
    }

    i = (wd_done_head + LOOM_WD_REPORTS - wd_done_n) % LOOM_WD_REPORTS;
    *out = wd_done[i];
    wd_done_n--;

    pthread_mutex_unlock(&wd_lock);

    return 1;
}


const loom_wd_sample_t *
ngx_loom_ffi_watchdog_samples(int *n, const char **text)
{
    *n = wd_nsamples;
    *text = wd_text;
    return wd_samples;
}


void
ngx_loom_ffi_watchdog_samples_reset(void)
{
    uint64_t  since;

    /* keep the samples of a stall that is still going on */
    since = wd_load(&wd_busy_since);
    if (since != 0 && wd_nsamples > 0
        && wd_samples[wd_nsamples - 1].seq == wd_load(&wd_seq))
    {
        return;
    }

    wd_nsamples = 0;
    wd_text_used = 0;
    wd_mark_n = 0;
    wd_mark_used = 0;
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


static ngx_inline void
wd_record(uint64_t busy)
{
    ngx_uint_t  i;
    uint64_t    us;

    us = busy / 1000;

    for (i = 0; i < LOOM_WD_NBUCKETS - 1; i++) {
        if (us < wd_bounds_us[i]) {
            break;
        }
    }

    wd_stats.buckets[i]++;
    wd_stats.iterations++;
    wd_stats.busy_ns += busy;

    if (busy > wd_stats.max_ns) {
        wd_stats.max_ns = busy;
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

    since = __atomic_load_n(&wd_busy_since, __ATOMIC_RELAXED);

    if (since != 0) {
        now = wd_now();
        busy = now - since;
        wd_record(busy);

        if (busy >= __atomic_load_n(&wd_threshold_ns, __ATOMIC_RELAXED)) {
            ngx_loom_wd_finish(now, since, busy);

            /* the Lua side was posted: do not sleep before it runs */
            timer = 0;
        }
    }

    wd_store(&wd_busy_since, 0);

    rc = wd_orig_process_events(cycle, timer, flags | NGX_POST_EVENTS);

    now = wd_now();
    wd_store(&wd_seq, wd_seq + 1);
    wd_store(&wd_busy_since, now);

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


/*
 * Where the running timer comes from: the innermost frame with a local
 * "loom_timer_site" ("<created at>|<callback defined at>": the watchdog's
 * ngx.timer wrapper, or resty.loom.timer's run_next) and, in the same
 * frame, "loom_timer_name" (a resty.loom.timer name), appended after a
 * second "|".
 */
static void
wd_timer_site(lua_State *L)
{
    int                level, n, found;
    size_t             len, nlen, room;
    const char        *name, *s, *tname;
    loom_lua_debug_t   ar;

    for (level = 0; level < 200 && wd_getstack(L, level, &ar); level++) {
        found = 0;
        tname = NULL;
        nlen = 0;

        for (n = 1; n < 256; n++) {
            name = wd_getlocal(L, &ar, n);
            if (name == NULL) {
                break;
            }

            if (ngx_strcmp(name, "loom_timer_site") == 0) {
                s = wd_tolstring(L, -1, &len);
                if (s != NULL) {
                    len = ngx_min(len, LOOM_WD_SITE_LEN - 1);
                    ngx_memcpy(wd_ctx_site, s, len);
                    wd_ctx_site[len] = '\0';
                    found = 1;
                }

            } else if (ngx_strcmp(name, "loom_timer_name") == 0) {
                /* the value stays referenced by the frame once popped */
                tname = wd_tolstring(L, -1, &nlen);
            }

            wd_settop(L, -2);
        }

        if (!found) {
            continue;
        }

        if (tname != NULL) {
            len = ngx_strlen(wd_ctx_site);
            room = LOOM_WD_SITE_LEN - 1 - len;
            if (room > 1) {
                nlen = ngx_min(nlen, room - 1);
                wd_ctx_site[len] = '|';
                ngx_memcpy(wd_ctx_site + len + 1, tname, nlen);
                wd_ctx_site[len + 1 + nlen] = '\0';
            }
        }

        return;
    }
}


/* where the sampled coroutine comes from: request or timer */
static void
wd_describe(lua_State *L, uint64_t seq)
{
    int                  phase;
    char                *err;
    u_char              *p, *last;
    ngx_http_request_t  *r;

    wd_ctx_seq = seq;
    wd_ctx_phase = 0;
    wd_ctx_timer = 0;
    wd_ctx_request[0] = '\0';
    wd_ctx_site[0] = '\0';

    r = (wd_get_request != NULL) ? wd_get_request(L) : NULL;
    if (r == NULL) {
        return;
    }

    phase = (wd_get_phase != NULL) ? wd_get_phase(r, &err) : 0;
    wd_ctx_phase = phase > 0 ? phase : 0;

    if (phase == LOOM_WD_LUA_TIMER) {
        wd_ctx_timer = 1;
        wd_timer_site(L);
        return;
    }

    p = (u_char *) wd_ctx_request;
    last = p + LOOM_WD_REQUEST_LEN - 1;

    p = ngx_slprintf(p, last, "%V %V", &r->main->method_name,
                     &r->main->unparsed_uri);

    if (r != r->main) {
        p = ngx_slprintf(p, last, " (subrequest %V)", &r->uri);
    }

    *p = '\0';
}


static void
ngx_loom_wd_profile_cb(void *data, lua_State *L, int samples, int vmstate)
{
    int                n;
    int                sm_offcpu;
    size_t             len, bt_len;
    uint64_t           seq;
    const char        *s;
    loom_lua_debug_t   ar;
    loom_wd_sample_t  *sm;

    seq = wd_load(&wd_req_seq);
    sm_offcpu = wd_load(&wd_req_offcpu);

    /* only for the stall in progress: never a late or stray SIGPROF */
    if (seq == 0 || seq != wd_seq || wd_busy_since == 0) {
        return;
    }

    if (wd_ctx_seq != seq) {
        wd_describe(L, seq);
    }

    n = (wd_load(&wd_cb_seq) == seq) ? wd_cb_n : 0;
    if (n >= wd_max_samples) {
        return;
    }

    s = wd_dumpstack(L, "pf@lZ;", -LOOM_WD_DEPTH, &len);
    if (s == NULL) {
        return;
    }

    wd_store(&wd_cb_n, n + 1);
    wd_store(&wd_cb_seq, seq);
    wd_stats.samples++;

    if (n == 0) {
        bt_len = ngx_min(len, LOOM_WD_BT_LEN - 1);
        pthread_mutex_lock(&wd_lock);
        ngx_memcpy(wd_first_bt, s, bt_len);
        wd_first_bt[bt_len] = '\0';
        wd_first_bt_seq = seq;
        pthread_mutex_unlock(&wd_lock);
    }

    if (wd_nsamples > wd_mark_n
        && wd_samples[wd_nsamples - 1].seq != seq)
    {
        /* early samples of an iteration that did not become a stall */
        wd_nsamples = wd_mark_n;
        wd_text_used = wd_mark_used;
    }

    if (wd_nsamples == LOOM_WD_SAMPLES
        || wd_text_used + len > LOOM_WD_TEXT)
    {
        wd_stats.samples_dropped++;
        return;
    }

    sm = &wd_samples[wd_nsamples++];
    sm->seq = seq;
    sm->off = wd_text_used;
    sm->len = (uint32_t) len;
    sm->vmstate = vmstate;
    sm->offcpu = sm_offcpu;

    ngx_memcpy(wd_text + wd_text_used, s, len);
    wd_text_used += len;

    if (sm_offcpu && wd_fn_seq != seq && wd_getinfo != NULL
        && wd_setfield != NULL)
    {
        /*
         * the sample is taken at the instruction after the blocking call;
         * the Lua side finds the call's line in this function's bytecode
         */
        wd_fn_seq = seq;
        if (wd_getstack(L, 0, &ar) && wd_getinfo(L, "f", &ar)) {
            wd_setfield(L, LOOM_LUA_REGISTRY, "loom.watchdog.fn");
        }
    }

    if (sm_offcpu) {
        /* one sample per blocking call; the next request says its kind */
        wd_store(&wd_req_offcpu, 0);
    }
}


/* -- the watchdog thread ------------------------------------------------ */


static int
wd_open_task(const char *file)
{
    char  path[64];

    (void) ngx_snprintf((u_char *) path, sizeof(path),
                        "/proc/self/task/%d/%s%Z", (int) wd_main_tid, file);

    return open(path, O_RDONLY | O_CLOEXEC);
}


static ssize_t
wd_read(int fd, char *buf, size_t size)
{
    ssize_t  n;

    if (fd == -1) {
        return -1;
    }

    n = pread(fd, buf, size - 1, 0);
    if (n < 0) {
        return -1;
    }

    buf[n] = '\0';
    return n;
}


/* run_delay (ns waiting on a run queue) from a schedstat file */
static uint64_t
wd_run_delay(int fd, const char *path)
{
    int                 own;
    char                buf[128];
    unsigned long long  run, delay;

    own = 0;
    if (fd == -1) {
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd == -1) {
            return 0;
        }
        own = 1;
    }

    if (wd_read(fd, buf, sizeof(buf)) <= 0
        || sscanf(buf, "%llu %llu", &run, &delay) != 2)
    {
        delay = 0;
    }

    if (own) {
        close(fd);
    }

    return (uint64_t) delay;
}


static void *
ngx_loom_wd_thread(void *arg)
{
    uint64_t         ns;
    struct timespec  ts;

    wd_fd_stat = wd_open_task("stat");
    wd_fd_syscall = wd_open_task("syscall");
    wd_fd_wchan = wd_open_task("wchan");
    wd_fd_sched = wd_open_task("schedstat");

    while (!wd_load(&wd_stop)) {
        ns = wd_load(&wd_interval_ns);
        ts.tv_sec = ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        (void) nanosleep(&ts, NULL);

        ngx_loom_wd_tick();
    }

    ngx_loom_wd_bp_close();

    if (wd_fd_stat != -1) {
        close(wd_fd_stat);
    }

    if (wd_fd_syscall != -1) {
        close(wd_fd_syscall);
    }

    if (wd_fd_wchan != -1) {
        close(wd_fd_wchan);
    }

    if (wd_fd_sched != -1) {
        close(wd_fd_sched);
    }

    return NULL;
}


static int
wd_handler_installed(void)
{
    struct sigaction  sa;

    if (sigaction(SIGPROF, NULL, &sa) != 0) {
        return 0;
    }

    return sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN;
}


/* system calls that SA_RESTART restarts transparently (x86_64) */
static int
wd_restartable(long nr)
{
#if defined(__x86_64__)
    switch (nr) {
    case 0:     /* read */
    case 1:     /* write */
    case 2:     /* open */
    case 17:    /* pread64 */
    case 18:    /* pwrite64 */
    case 19:    /* readv */
    case 20:    /* writev */
    case 43:    /* accept */
    case 61:    /* wait4 */
    case 72:    /* fcntl */
    case 73:    /* flock */
    case 74:    /* fsync */
    case 75:    /* fdatasync */
    case 247:   /* waitid */
    case 257:   /* openat */
    case 288:   /* accept4 */
        return 1;
    }
#endif

    return 0;
}


static void
ngx_loom_wd_bp_close(void)
{
    if (wd_bp_fd != -1) {
        close(wd_bp_fd);
        wd_bp_fd = -1;
    }

    wd_bp_seq = 0;
    wd_bp_pc = 0;
}


/* a one-shot breakpoint on the return address of the blocking call */
static int
wd_bp_arm(uint64_t seq, uint64_t pc)
{
    int                     fd;
    struct f_owner_ex       owner;
    struct perf_event_attr  attr;

    if (wd_stats.bp_state == -1 || !wd_conf.breakpoints) {
        return 0;
    }

    if (wd_bp_fd != -1 && wd_bp_pc == pc) {
        if (ioctl(wd_bp_fd, PERF_EVENT_IOC_REFRESH, 1) == 0) {
            wd_bp_seq = seq;
            return 1;
        }
    }

    ngx_loom_wd_bp_close();

    ngx_memzero(&attr, sizeof(struct perf_event_attr));
    attr.type = PERF_TYPE_BREAKPOINT;
    attr.size = sizeof(struct perf_event_attr);
    attr.bp_type = HW_BREAKPOINT_X;
    attr.bp_addr = pc;
    attr.bp_len = sizeof(long);
    attr.sample_period = 1;
    attr.wakeup_events = 1;
    attr.disabled = 1;
    attr.exclude_kernel = 1;
    attr.exclude_hv = 1;

    fd = (int) syscall(SYS_perf_event_open, &attr, wd_main_tid, -1, -1,
                       PERF_FLAG_FD_CLOEXEC);
    if (fd == -1) {
        wd_stats.bp_errno = errno;
        wd_stats.bp_state = -1;
        return 0;
    }

    owner.type = F_OWNER_TID;
    owner.pid = wd_main_tid;

    if (fcntl(fd, F_SETOWN_EX, &owner) == -1
        || fcntl(fd, F_SETSIG, SIGPROF) == -1
        || fcntl(fd, F_SETFL, O_ASYNC) == -1
        || ioctl(fd, PERF_EVENT_IOC_REFRESH, 1) == -1)
    {
        wd_stats.bp_errno = errno;
        wd_stats.bp_state = -1;
        close(fd);
        return 0;
    }

    wd_stats.bp_state = 1;
    wd_bp_fd = fd;
    wd_bp_pc = pc;
    wd_bp_seq = seq;

    return 1;
}


static void
wd_log_long(uint64_t seq, uint64_t elapsed, char state, long nr,
    const char *wchan)
{
    char  bt[LOOM_WD_BT_LEN];

    bt[0] = '\0';

    pthread_mutex_lock(&wd_lock);
    if (wd_first_bt_seq == seq) {
        ngx_memcpy(bt, wd_first_bt, LOOM_WD_BT_LEN);
    }
    pthread_mutex_unlock(&wd_lock);

    ngx_log_error(NGX_LOG_WARN, ngx_cycle->log, 0,
                  "[loom.watchdog] event loop still blocked after %uL ms: "
                  "state %c, syscall %l, wchan %s, lua: %s",
                  (unsigned long long) (elapsed / 1000000), state, nr,
                  wchan[0] ? wchan : "-", bt[0] ? bt : "-");
}


static void
ngx_loom_wd_tick(void)
{
    int                n, early;
    char               state, *p, buf[256], wchan[48];
    long               nr;
    uint64_t           s1, s2, since, now, elapsed, pc, cpu, rq,
                       threshold;
    unsigned long      a[8];
    ngx_uint_t         i;
    loom_wd_report_t  *r;

    if (!wd_load(&wd_enabled)) {
        ngx_loom_wd_bp_close();
        return;
    }

    s1 = wd_load(&wd_seq);
    since = wd_load(&wd_busy_since);
    s2 = wd_load(&wd_seq);

    if (s1 != s2 || since == 0) {
        if (wd_bp_fd != -1) {
            ngx_loom_wd_bp_close();
        }

        return;
    }

    if (wd_bp_fd != -1 && wd_bp_seq != s1) {
        ngx_loom_wd_bp_close();
    }

    now = wd_now();

    if (wd_seen_seq != s1) {
        cpu = wd_clock(wd_main_clock);
        rq = wd_run_delay(wd_fd_sched, NULL);

        pthread_mutex_lock(&wd_lock);
        wd_seen_seq = s1;
        wd_seen_wall = now;
        wd_seen_cpu = cpu;
        wd_seen_rq = rq;
        pthread_mutex_unlock(&wd_lock);
    }

    elapsed = now > since ? now - since : 0;
    threshold = wd_load(&wd_threshold_ns);

    /*
     * from half the threshold on, take one sample already: a stall that
     * ends soon after the threshold still says what was running
     */
    if (elapsed < threshold / 2) {
        return;
    }

    early = (elapsed < threshold);

    /* a stall in progress: look at the main thread */

    state = '?';
    if (wd_read(wd_fd_stat, buf, sizeof(buf)) > 0) {
        p = strrchr(buf, ')');
        if (p != NULL && p[1] == ' ') {
            state = p[2];
        }
    }

    nr = -2;
    pc = 0;

    if (wd_read(wd_fd_syscall, buf, sizeof(buf)) > 0) {
        if (ngx_strncmp(buf, "running", 7) == 0) {
            nr = -1;

        } else {
            n = sscanf(buf, "%ld %lx %lx %lx %lx %lx %lx %lx %lx", &nr,
                       &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6],
                       &a[7]);
            if (n == 9) {
                pc = a[7];

            } else {
                /* "-1 sp pc": blocked outside a system call */
                nr = -3;
            }
        }
    }

    wchan[0] = '\0';
    if (nr != -1 && wd_read(wd_fd_wchan, buf, sizeof(buf)) > 0
        && buf[0] != '0')
    {
        ngx_cpystrn((u_char *) wchan, (u_char *) buf, sizeof(wchan));
    }

    if (nr == -1) {
        state = 'R';
    }

    pthread_mutex_lock(&wd_lock);

    r = &wd_cur;

    if (r->seq != s1) {
        ngx_memzero(r, sizeof(loom_wd_report_t));
        r->seq = s1;
    }

    if (!early && !r->detected) {
        r->detected = 1;
        r->detect_ms = (double) elapsed / 1e6;
    }

    r->ticks++;

    if (state == 'R') {
        r->ticks_running++;

    } else if (state == 'D') {
        r->ticks_disk++;

    } else {
        r->ticks_sleeping++;
    }

    if (nr >= 0 && state != 'R') {
        for (i = 0; i < LOOM_WD_NSYSCALLS; i++) {
            if (r->sys_n[i] == 0 || r->sys_nr[i] == nr) {
                r->sys_nr[i] = (int32_t) nr;
                r->sys_n[i]++;
                break;
            }
        }
    }

    if (wchan[0]) {
        ngx_memcpy(r->wchan, wchan, sizeof(wchan));
    }

    pthread_mutex_unlock(&wd_lock);

    /* ask the VM for a backtrace at its next safe point */

    n = (wd_load(&wd_cb_seq) == s1) ? wd_load(&wd_cb_n) : 0;

    if (wd_stats.profiler && n < wd_load(&wd_max_samples)
        && (!early || n == 0) && wd_handler_installed())
    {
        if (state == 'R' && wd_bp_fd != -1 && wd_bp_seq == s1
            && wd_bp_cb_n == n
            && wd_clock(wd_main_clock) < wd_bp_cpu + 5000000)
        {
            /*
             * the blocking call has returned (the thread may still wait
             * for a CPU): its breakpoint sample is on its way, do not
             * relabel it as a CPU sample
             */

        } else if (state == 'R') {
            wd_store(&wd_req_offcpu, 0);
            wd_store(&wd_req_seq, s1);

            if (pthread_kill(wd_main, SIGPROF) == 0) {
                __atomic_fetch_add(&wd_stats.signals, 1, __ATOMIC_RELAXED);
                pthread_mutex_lock(&wd_lock);
                if (wd_cur.seq == s1) {
                    wd_cur.bt_signal++;
                }
                pthread_mutex_unlock(&wd_lock);
            }

        } else if (nr >= 0 && pc != 0) {

            if (wd_bp_fd != -1 && wd_bp_seq == s1 && wd_bp_pc == pc
                && wd_bp_cb_n == n)
            {
                /* armed and not hit yet */

            } else {
                wd_store(&wd_req_offcpu, 1);
                wd_store(&wd_req_seq, s1);

                if (wd_bp_arm(s1, pc)) {
                    wd_bp_cb_n = n;
                    wd_bp_cpu = wd_clock(wd_main_clock);
                    __atomic_fetch_add(&wd_stats.breakpoints, 1,
                                       __ATOMIC_RELAXED);
                    pthread_mutex_lock(&wd_lock);
                    if (wd_cur.seq == s1) {
                        wd_cur.bt_breakpoint++;
                    }
                    pthread_mutex_unlock(&wd_lock);

                } else if ((wd_restartable(nr) || state == 'D')
                           && n == 0)
                {
                    if (pthread_kill(wd_main, SIGPROF) == 0) {
                        __atomic_fetch_add(&wd_stats.signals, 1,
                                           __ATOMIC_RELAXED);
                        pthread_mutex_lock(&wd_lock);
                        if (wd_cur.seq == s1) {
                            wd_cur.bt_signal++;
                        }
                        pthread_mutex_unlock(&wd_lock);
                    }
                }
            }
        }
    }

    if (wd_long_ns != 0 && elapsed >= wd_load(&wd_long_ns)
        && wd_logged_seq != s1)
    {
        wd_logged_seq = s1;
        wd_log_long(s1, elapsed, state, nr, wchan);
    }
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
