
/*
 * Copyright (C) resty-loom authors
 *
 * The watchdog thread: while an iteration runs too long it reads the main
 * thread's /proc state and asks for a Lua sample, with SIGPROF on CPU or
 * a return breakpoint off CPU; it logs a stall that lasts.
 */


#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "ngx_loom_watchdog.h"
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <linux/perf_event.h>
#include <linux/hw_breakpoint.h>


static uint64_t ngx_loom_wd_tick(void);
static void ngx_loom_wd_bp_close(void);
static ssize_t wd_read(int fd, char *buf, size_t size);


static int              wd_fd_stat = -1;
static int              wd_fd_syscall = -1;
static int              wd_fd_wchan = -1;
static int              wd_fd_sched = -1;
static int              wd_bp_fd = -1;
static uint64_t         wd_bp_seq;
static uint64_t         wd_bp_pc;
static int              wd_bp_cb_n;
static uint64_t         wd_bp_cpu;
/* the off-CPU SIGPROF sent without a breakpoint: its stall, and the main
   thread's CPU clock then */
static uint64_t         wd_sig_seq;
static uint64_t         wd_sig_cpu;
static uint64_t         wd_logged_seq;

/* the thread's sleep, cut short by ngx_loom_wd_wake() */
static pthread_mutex_t  wd_sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t   wd_sleep_cond = PTHREAD_COND_INITIALIZER;
static int              wd_woken;


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
uint64_t
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


/* stop, or new options: the thread looks again now */
void
ngx_loom_wd_wake(void)
{
    pthread_mutex_lock(&wd_sleep_lock);
    wd_woken = 1;
    pthread_cond_signal(&wd_sleep_cond);
    pthread_mutex_unlock(&wd_sleep_lock);
}


static void
wd_sleep_until(uint64_t deadline)
{
    struct timespec  ts;

    ts.tv_sec = deadline / 1000000000;
    ts.tv_nsec = deadline % 1000000000;

    pthread_mutex_lock(&wd_sleep_lock);

    while (!wd_woken
           && pthread_cond_clockwait(&wd_sleep_cond, &wd_sleep_lock,
                                     CLOCK_MONOTONIC, &ts) == 0)
    {
        /* spurious wake-up */
    }

    wd_woken = 0;
    pthread_mutex_unlock(&wd_sleep_lock);
}


void *
ngx_loom_wd_thread(void *arg)
{
    uint64_t  next;

    /* named, so that its CPU can be told from the worker's own */
    (void) pthread_setname_np(pthread_self(), "loom-watchdog");

    wd_fd_stat = wd_open_task("stat");
    wd_fd_syscall = wd_open_task("syscall");
    wd_fd_wchan = wd_open_task("wchan");
    wd_fd_sched = wd_open_task("schedstat");

    next = wd_now() + wd_load(&wd_interval_ns);

    while (!wd_load(&wd_stop)) {
        wd_sleep_until(next);

        if (wd_load(&wd_stop)) {
            break;
        }

        next = ngx_loom_wd_tick();
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


/* one look at the loop; returns when to look next (CLOCK_MONOTONIC ns) */
static uint64_t
ngx_loom_wd_tick(void)
{
    int                n, early;
    char               state, *p, buf[256], wchan[48];
    long               nr;
    uint64_t           s1, s2, since, now, elapsed, pc, cpu, rq,
                       threshold, interval;
    unsigned long      a[8];
    ngx_uint_t         i;
    loom_wd_report_t  *r;

    now = wd_now();
    threshold = wd_load(&wd_threshold_ns);
    interval = wd_load(&wd_interval_ns);

    if (!wd_load(&wd_enabled)) {
        ngx_loom_wd_bp_close();
        return now + threshold / 2 + interval;
    }

    s1 = wd_load(&wd_seq);
    since = wd_load(&wd_busy_since);
    s2 = wd_load(&wd_seq);

    if (s1 != s2 || since == 0) {
        if (wd_bp_fd != -1) {
            ngx_loom_wd_bp_close();
        }

        /*
         * waiting for events (or just between two iterations): the next
         * one starts later than now, so it cannot have run half the
         * threshold before now + threshold / 2
         */
        return now + (s1 != s2 ? interval : threshold / 2);
    }

    if (wd_bp_fd != -1 && wd_bp_seq != s1) {
        ngx_loom_wd_bp_close();
    }

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

    /*
     * from half the threshold on, take one sample already: a stall that
     * ends soon after the threshold still says what was running
     */
    if (elapsed < threshold / 2) {
        return since + threshold / 2;
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

        } else if (state == 'R' && wd_sig_seq == s1 && n == 0
                   && wd_load(&wd_req_offcpu) && wd_load(&wd_req_seq) == s1
                   && wd_clock(wd_main_clock) < wd_sig_cpu + 5000000)
        {
            /*
             * likewise for the off-CPU SIGPROF of a restartable call: the
             * call returned, the hook has not run yet (the sample would
             * lose the call's line)
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
                        wd_sig_seq = s1;
                        wd_sig_cpu = wd_clock(wd_main_clock);
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

    return now + interval;
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
