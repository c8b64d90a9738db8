
/*
 * Copyright (C) resty-loom authors
 *
 * The watchdog's FFI entry points (lib/resty/loom/watchdog.lua): start,
 * options, stats, and the hand-over of finished reports and samples.
 */


#include "ngx_loom_watchdog.h"


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

    if (wd_thread_running) {
        /* a shorter threshold or tick applies from now */
        ngx_loom_wd_wake();
    }

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
    ngx_loom_wd_wake();

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

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
