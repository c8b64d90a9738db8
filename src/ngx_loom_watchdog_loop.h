
/*
 * Copyright (C) resty-loom authors
 *
 * What the watchdog adds to every event-loop iteration, with no nginx
 * type in it: ngx_loom_watchdog.c runs it around process_events, and
 * bench/watchdog/loop_cost.c times the very same code N times.
 */


#ifndef _NGX_LOOM_WATCHDOG_LOOP_H_INCLUDED_
#define _NGX_LOOM_WATCHDOG_LOOP_H_INCLUDED_


#include <stdint.h>
#include <time.h>


#define LOOM_WD_NBUCKETS      18


/* loop figures, written by the worker's main thread only */
typedef struct {
    uint64_t  iterations;
    uint64_t  busy_ns;          /* sum of busy time */
    uint64_t  max_ns;
    uint64_t  stalls;           /* iterations over the threshold */
    uint64_t  reports_dropped;
    uint64_t  samples;          /* Lua stack samples taken */
    uint64_t  samples_dropped;
    uint64_t  signals;          /* sample requests sent by the thread */
    uint64_t  breakpoints;      /* return breakpoints armed */
    uint64_t  started_ns;       /* CLOCK_MONOTONIC at start */
    uint64_t  buckets[LOOM_WD_NBUCKETS];
    int       running;
    int       profiler;         /* 1: backtraces available */
    int       bp_state;         /* 0 untried, 1 works, -1 unavailable */
    int       bp_errno;
} loom_wd_stats_t;


#define wd_load(p)      __atomic_load_n(p, __ATOMIC_ACQUIRE)
#define wd_store(p, v)  __atomic_store_n(p, v, __ATOMIC_RELEASE)


#pragma GCC visibility push(hidden)

/* the loop state the watchdog thread reads (ngx_loom_watchdog.c) */
extern int               wd_enabled;
extern uint64_t          wd_threshold_ns;
extern uint64_t          wd_seq;
extern uint64_t          wd_busy_since;
extern loom_wd_stats_t   wd_stats;

#pragma GCC visibility pop


static inline uint64_t
wd_now(void)
{
    struct timespec  ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);

    return (uint64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}


/* bucket upper bounds in microseconds; the last bucket is open */
static const uint64_t  wd_bounds_us[LOOM_WD_NBUCKETS - 1] = {
    50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000,
    250000, 500000, 1000000, 2500000, 5000000, 10000000
};


static inline void
wd_record(uint64_t busy)
{
    unsigned  i;
    uint64_t  us;

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


/*
 * Before the loop waits for events: the busy part of the iteration that
 * ends goes into the histogram. Returns 1 when it was a stall (*now,
 * *since and *busy then say when and how long).
 */
static inline int
wd_iter_end(uint64_t *now, uint64_t *since, uint64_t *busy)
{
    int  stall;

    stall = 0;
    *since = __atomic_load_n(&wd_busy_since, __ATOMIC_RELAXED);

    if (*since != 0) {
        *now = wd_now();
        *busy = *now - *since;
        wd_record(*busy);

        stall = (*busy >= __atomic_load_n(&wd_threshold_ns,
                                          __ATOMIC_RELAXED));
    }

    wd_store(&wd_busy_since, 0);

    return stall;
}


/* the wait returned: a new iteration is busy from now */
static inline void
wd_iter_start(void)
{
    uint64_t  now;

    now = wd_now();
    wd_store(&wd_seq, wd_seq + 1);
    wd_store(&wd_busy_since, now);
}


#endif /* _NGX_LOOM_WATCHDOG_LOOP_H_INCLUDED_ */

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
