
/*
 * Copyright (C) resty-loom authors
 *
 * Offload statistics: the per-queue latency histogram (8 sub-buckets per
 * power of two, in microseconds) and the read-out behind rt:stats()
 * (ngx_loom_offload_ffi_stats; lib/resty/loom/offload.lua declares the
 * same ngx_loom_offload_stats_t with ffi.cdef). The counters themselves
 * are bumped where things happen, on the main thread.
 *
 * Layer 5, the bottom of the offload files (ngx_loom_offload.c lists
 * them): called by completion.c (and Lua, through the FFI); calls none of
 * them.
 */


#include "ngx_loom_offload.h"


typedef struct {
    double                       state;
    double                       threads;
    double                       queued;
    double                       running;
    double                       submitted;
    double                       completed;
    double                       errors;
    double                       timeouts;
    double                       rejected;
    double                       closed;
    double                       aborted;
    double                       late;
    double                       lat_n;
    double                       lat_mean;
    double                       lat_max;
    double                       p50;
    double                       p90;
    double                       p99;
    double                       p999;
    double                       polled;
    double                       polled_hits;
    double                       peak_queued;
    double                       reclaimed;
    double                       misused;
} ngx_loom_offload_stats_t;


static ngx_uint_t ngx_loom_offload_hist_index(uint64_t us);
static double ngx_loom_offload_hist_value(ngx_uint_t i);

void ngx_loom_offload_ffi_stats(loom_offload_queue_t *q,
    ngx_loom_offload_stats_t *st);
void ngx_loom_offload_ffi_histogram(loom_offload_queue_t *q, int which,
    const double *le, int n, double *out);


/* a call's latency, submission to result, for rt:stats() */
void
ngx_loom_offload_latency(loom_offload_queue_t *q, uint64_t us)
{
    q->lat_n++;
    q->lat_sum += us;

    if (us > q->lat_max) {
        q->lat_max = us;
    }

    q->hist[ngx_loom_offload_hist_index(us)]++;
}


/* how long a call waited for a thread, for resty.loom.status */
void
ngx_loom_offload_queue_wait(loom_offload_queue_t *q, uint64_t us)
{
    q->wait_sum += us;
    q->wait_hist[ngx_loom_offload_hist_index(us)]++;
}


static ngx_uint_t
ngx_loom_offload_hist_index(uint64_t us)
{
    ngx_uint_t  e, i;

    if (us < LOOM_HIST_SUB) {
        return (ngx_uint_t) us;
    }

    e = 63 - __builtin_clzll(us);           /* e >= LOOM_HIST_SUB_BITS */

    i = LOOM_HIST_SUB * (e - LOOM_HIST_SUB_BITS + 1)
        + ((us >> (e - LOOM_HIST_SUB_BITS)) & (LOOM_HIST_SUB - 1));

    return i < LOOM_HIST_BUCKETS ? i : LOOM_HIST_BUCKETS - 1;
}


/* the middle of bucket i, in microseconds */
static double
ngx_loom_offload_hist_value(ngx_uint_t i)
{
    ngx_uint_t  e, sub;
    double      lo, width;

    if (i < LOOM_HIST_SUB) {
        return (double) i;
    }

    e = i / LOOM_HIST_SUB + LOOM_HIST_SUB_BITS - 1;
    sub = i % LOOM_HIST_SUB;

    width = (double) ((uint64_t) 1 << (e - LOOM_HIST_SUB_BITS));
    lo = (double) ((uint64_t) 1 << e) + sub * width;

    return lo + width / 2;
}


void
ngx_loom_offload_ffi_stats(loom_offload_queue_t *q,
    ngx_loom_offload_stats_t *st)
{
    double      *pct[4], want[4];
    uint64_t     seen;
    ngx_uint_t   i, k;

    st->state = q->state;
    st->threads = q->threads;
    st->queued = (double) ngx_loom_load(&q->npending);
    st->running = (double) (ngx_loom_load(&q->taken) - q->answered
                            - q->reclaimed_held);
    st->submitted = (double) q->submitted;
    st->completed = (double) q->completed;
    st->errors = (double) q->errors;
    st->timeouts = (double) q->timeouts;
    st->rejected = (double) q->rejected;
    st->closed = (double) q->closed_calls;
    st->aborted = (double) q->aborted;
    st->late = (double) q->late;
    st->lat_n = (double) q->lat_n;
    st->lat_mean = q->lat_n ? (double) q->lat_sum / q->lat_n : 0;
    st->lat_max = (double) q->lat_max;
    st->polled = (double) q->polled;
    st->polled_hits = (double) q->polled_hits;
    st->peak_queued = (double) q->peak_queued;
    st->reclaimed = (double) q->reclaimed;
    st->misused = (double) __atomic_load_n(&q->misused, __ATOMIC_RELAXED);

    pct[0] = &st->p50;
    pct[1] = &st->p90;
    pct[2] = &st->p99;
    pct[3] = &st->p999;

    want[0] = 0.50;
    want[1] = 0.90;
    want[2] = 0.99;
    want[3] = 0.999;

    for (k = 0; k < 4; k++) {
        *pct[k] = 0;
    }

    if (q->lat_n == 0) {
        return;
    }

    seen = 0;
    k = 0;

    for (i = 0; i < LOOM_HIST_BUCKETS && k < 4; i++) {
        seen += q->hist[i];

        while (k < 4 && (double) seen >= want[k] * (double) q->lat_n) {
            *pct[k] = ngx_loom_offload_hist_value(i);

            if (*pct[k] > st->lat_max) {
                *pct[k] = st->lat_max;
            }

            k++;
        }
    }
}

/*
 * the call-time (which 0) or queue-wait (which 1) histogram as n
 * cumulative counts at the upper bounds le[] (seconds, increasing), each
 * bucket counted at the first bound at or above its middle; out[n] is the
 * count, out[n + 1] the sum in seconds (rt:histogram(), resty.loom.status)
 */
void
ngx_loom_offload_ffi_histogram(loom_offload_queue_t *q, int which,
    const double *le, int n, double *out)
{
    int         j;
    double      mid;
    uint64_t   *h, total;
    ngx_uint_t  i;

    h = which ? q->wait_hist : q->hist;

    for (j = 0; j < n; j++) {
        out[j] = 0;
    }

    total = 0;

    for (i = 0; i < LOOM_HIST_BUCKETS; i++) {
        if (h[i] == 0) {
            continue;
        }

        total += h[i];
        mid = ngx_loom_offload_hist_value(i) / 1e6;

        for (j = 0; j < n && le[j] < mid; j++) {
            /* void */
        }

        for ( /* void */ ; j < n; j++) {
            out[j] += (double) h[i];
        }
    }

    out[n] = (double) total;
    out[n + 1] = (double) (which ? q->wait_sum : q->lat_sum) / 1e6;
}


/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
