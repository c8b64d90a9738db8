
/*
 * Copyright (C) resty-loom authors
 *
 * Shared layouts of the event-loop watchdog, and what its files
 * (src/ngx_loom_watchdog*.c) share. lib/resty/loom/watchdog/cdef.lua
 * declares the same structures with ffi.cdef: keep both in step.
 */


#ifndef _NGX_LOOM_WATCHDOG_H_INCLUDED_
#define _NGX_LOOM_WATCHDOG_H_INCLUDED_


#include "ngx_loom.h"
#include <ngx_event.h>
#include <ngx_http.h>
#include <pthread.h>
#include <stdint.h>
#include "ngx_loom_watchdog_loop.h"


#define LOOM_WD_NSYSCALLS      4
#define LOOM_WD_REQUEST_LEN  256
#define LOOM_WD_SITE_LEN     320
#define LOOM_WD_BT_LEN      1024


/* options handed over by watchdog.start() and watchdog.configure() */
typedef struct {
    double    threshold_ms;     /* an iteration this long is a stall */
    double    interval_ms;      /* watchdog tick */
    double    long_ms;          /* log "still blocked" from the thread */
    int       max_samples;      /* Lua stack samples per stall */
    int       profile;          /* take Lua backtraces (jit.profile hook) */
    int       breakpoints;      /* use a return breakpoint off-CPU */
} loom_wd_conf_t;


/* one finished stall */
typedef struct {
    uint64_t  seq;              /* loop iteration number */
    double    start;            /* wall clock, seconds since the epoch */
    double    duration_ms;
    double    cpu_ms;           /* on-CPU time of the main thread */
    double    runq_ms;          /* runnable, waiting for a CPU */
    double    detect_ms;        /* stall start -> the thread noticed */
    double    report_ms;        /* stall start -> report ready in C */
    uint32_t  ticks;            /* /proc samples taken during the stall */
    uint32_t  ticks_running;
    uint32_t  ticks_sleeping;
    uint32_t  ticks_disk;
    int32_t   sys_nr[LOOM_WD_NSYSCALLS];
    uint32_t  sys_n[LOOM_WD_NSYSCALLS];
    uint32_t  lua_samples;
    int32_t   phase;            /* ngx_lua context bit, 0: unknown */
    int32_t   detected;         /* noticed while it happened */
    int32_t   cpu_known;
    int32_t   runq_known;
    int32_t   timer;            /* 1: a timer (fake request) ran */
    int32_t   bt_signal;        /* samples asked for with a signal */
    int32_t   bt_breakpoint;    /* samples asked for with a breakpoint */
    char      wchan[48];
    char      request[LOOM_WD_REQUEST_LEN];
    char      site[LOOM_WD_SITE_LEN];   /* timer creation site */
} loom_wd_report_t;


/* one Lua stack sample; text is in the samples arena */
typedef struct {
    uint64_t  seq;
    uint32_t  off;
    uint32_t  len;
    int32_t   vmstate;          /* 'N' 'I' 'C' 'G' 'J' */
    int32_t   offcpu;           /* taken right after a blocking call */
} loom_wd_sample_t;


/* -- inside the module ------------------------------------------------- */


#define LOOM_WD_REPORTS      16
#define LOOM_WD_SAMPLES     512
#define LOOM_WD_TEXT     131072


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


static ngx_inline uint64_t
wd_clock(clockid_t clk)
{
    struct timespec  ts;

    if (clock_gettime(clk, &ts) != 0) {
        return 0;
    }

    return (uint64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}


/*
 * what the files share stays inside the module: the .so exports the
 * FFI entry points and ngx_loom_watchdog_module only, as when this was
 * one file
 */
#pragma GCC visibility push(hidden)

/* ngx_loom_watchdog.c: options; the thresholds are read by both threads */
extern loom_wd_conf_t    wd_conf;
extern int               wd_want;
extern int               wd_process_inited;
extern uint64_t          wd_interval_ns;
extern uint64_t          wd_long_ns;
extern int               wd_max_samples;
extern void             *wd_sem;

/* loop state shared with the thread (atomics) */
extern uint64_t          wd_req_seq;
extern int               wd_req_offcpu;
extern uint64_t          wd_cb_seq;
extern int               wd_cb_n;
extern int               wd_stop;


/* guarded by wd_lock */
extern pthread_mutex_t   wd_lock;
extern loom_wd_report_t  wd_cur;
extern uint64_t          wd_seen_seq;
extern uint64_t          wd_seen_wall;
extern uint64_t          wd_seen_cpu;
extern uint64_t          wd_seen_rq;
extern loom_wd_report_t  wd_done[LOOM_WD_REPORTS];
extern ngx_uint_t        wd_done_head;
extern ngx_uint_t        wd_done_n;
extern char              wd_first_bt[LOOM_WD_BT_LEN];
extern uint64_t          wd_first_bt_seq;

/* main thread only: context and stack samples */
extern uint64_t          wd_ctx_seq;
extern int32_t           wd_ctx_phase;
extern int32_t           wd_ctx_timer;
extern char              wd_ctx_request[LOOM_WD_REQUEST_LEN];
extern char              wd_ctx_site[LOOM_WD_SITE_LEN];
extern loom_wd_sample_t  wd_samples[LOOM_WD_SAMPLES];
extern int               wd_nsamples;
extern char              wd_text[LOOM_WD_TEXT];
extern uint32_t          wd_text_used;
extern int               wd_mark_n;
extern uint32_t          wd_mark_used;

/* thread side */
extern int               wd_thread_running;
extern pthread_t         wd_main;
extern pid_t             wd_main_tid;
extern clockid_t         wd_main_clock;

/* ngx_loom_watchdog_sample.c: Lua entry points, resolved with dlsym */
extern void (*wd_profile_start)(lua_State *L, const char *mode,
    loom_profile_cb_pt cb, void *data);
extern const char *(*wd_dumpstack)(lua_State *L, const char *fmt,
    int depth, size_t *len);
extern int (*wd_sema_post)(void *sem, int n);

int wd_resolve(void);
void ngx_loom_wd_profile_cb(void *data, lua_State *L, int samples,
    int vmstate);

/* ngx_loom_watchdog_thread.c */
void *ngx_loom_wd_thread(void *arg);
void ngx_loom_wd_wake(void);
uint64_t wd_run_delay(int fd, const char *path);

#pragma GCC visibility pop


#endif /* _NGX_LOOM_WATCHDOG_H_INCLUDED_ */

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
